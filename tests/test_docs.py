"""The docs: the site builds with ``mkdocs build --strict``, its reference pages match the
code, and the README stays short. The staleness, link and nav checks each have a negative
control that breaks a copy."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MOST_LINES = 200


def _reference_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the site at ``root`` (not ``-q``: it hides the warnings
    that strict mode turns into a failure)."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_reference_pages_are_what_the_code_gives() -> None:
    out = subprocess.run([sys.executable, "scripts/docs_reference.py", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_stale_reference_page_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: one committed page edited by hand fails the check, by name."""
    reference = _reference_module()
    shutil.copytree(REPO / "docs" / "reference", tmp_path / "reference")
    page = tmp_path / "reference" / "configuration.md"
    page.write_text(page.read_text().replace("`127.0.0.1:7500`", "`127.0.0.1:7600`"))
    monkeypatch.setattr(reference, "REFERENCE", tmp_path / "reference")
    monkeypatch.setattr(reference, "REPO", tmp_path)
    assert reference.main(["--check"]) == 1


def test_the_site_builds_with_strict_checks(tmp_path: Path) -> None:
    """Every page in the nav exists, every link and anchor resolves, every report is published."""
    out = _build(REPO, tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    reports = sorted(p.name for p in (REPO / "benchmarks" / "reports").glob("*.md"))
    published = sorted(p.parent.name + ".md" for p in (tmp_path / "site" / "reports").glob("*/index.html"))
    assert reports and published == reports


def _copy_of_the_site(root: Path) -> Path:
    for folder in ("docs", "benchmarks/reports"):
        shutil.copytree(REPO / folder, root / folder)
    shutil.copy(REPO / "mkdocs.yml", root)
    return root / "docs"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The negative control: a copy of the docs with one dead link does not build."""
    index = _copy_of_the_site(tmp_path) / "index.md"
    index.write_text(index.read_text() + "\n[gone](how-to/no-such-page.md)\n")
    out = _build(tmp_path, tmp_path / "site")
    assert out.returncode != 0 and "no-such-page.md" in out.stderr, out.stderr


def test_a_page_missing_from_the_nav_fails_the_build(tmp_path: Path) -> None:
    """The negative control: a copy of the docs without one page of the nav does not build."""
    (_copy_of_the_site(tmp_path) / "how-to" / "tls.md").unlink()
    out = _build(tmp_path, tmp_path / "site")
    assert out.returncode != 0 and "how-to/tls.md" in out.stderr, out.stderr


def test_the_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MOST_LINES, f"README.md has {len(lines)} lines"
