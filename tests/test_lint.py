"""The code passes ruff (style, imports, likely bugs) and mypy --strict with the project's settings."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "kvxfer", "server", "client",
                          "tests", "benchmarks", "scripts", "docs/hooks"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_is_clean() -> None:
    """kvxfer, kvxfer.server and kvxfer.client (the packages of pyproject's [tool.mypy])."""
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found" in out.stdout


def test_the_three_distributions_are_released_together() -> None:
    """One version: kvxfer's, kvxfer-client's and kvxfer-server's, the pins between them, and
    what the installed kvxfer reports."""
    from kvxfer.version import __version__

    projects = [tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
                for folder in (".", "client", "server")]
    assert {p["version"] for p in projects} == {__version__}
    pins = [dep for p in projects
            for dep in [*p.get("dependencies", []), *sum(p.get("optional-dependencies", {}).values(), [])]
            if dep.startswith("kvxfer")]
    assert pins and all(dep.endswith(f"=={__version__}") for dep in pins), pins
