"""Imports go one way, and the worker side loads nothing of the daemon's stack (a static
check of every module; tests/test_packaging.py checks the installed packages, slowly).

- the core (``kvxfer/``) imports neither ``kvxfer.server`` nor ``kvxfer.client``;
- the daemon (``server/``) does not import ``kvxfer.client``;
- the worker side (``client/``) imports ``kvxfer.server`` only in ``cli.py`` (``kvxfer serve``);
- the engine-neutral core (``kvxfer.client.engine_core``) imports no engine integration and
  no engine (vLLM, SGLang), so another engine's adapter reuses it unchanged;
- no module of the core or the worker side imports the daemon's stack at module level
  (UCX, cryptography, exporters, the Prometheus client, settings, YAML), except the core
  modules that are that stack's own (``kvxfer.transport``, ``kvxfer.certs``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE, SERVER, CLIENT = REPO / "kvxfer", REPO / "server" / "kvxfer", REPO / "client" / "kvxfer"
#: Modules of the daemon's install (kvxfer-server's dependencies and kvxfer's extras).
DAEMON_STACK = ("ucxx", "libucxx", "cryptography", "prometheus_client", "opentelemetry.sdk",
                "opentelemetry.exporter", "pydantic_settings", "yaml", "pythonjsonlogger",
                "grpc_reflection", "kvxfer.server", "kvxfer.transport", "kvxfer.certs")


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "v1" not in p.relative_to(root).parts[:1])


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The modules ``path`` imports (with ``top_level_only``, those imported when it loads:
    not inside a function)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, (ast.Try, ast.If)) and top_level_only:
            nodes.extend(node.body)
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize(("root", "forbidden", "allowed_in"), [
    (CORE, ("kvxfer.server", "kvxfer.client", "kvxfer.integrations"), ()),
    (SERVER, ("kvxfer.client", "kvxfer.integrations"), ()),
    (CLIENT, ("kvxfer.server",), ("client/cli.py",)),
    (CLIENT / "client" / "engine_core",
     ("kvxfer.server", "kvxfer.client.integrations", "kvxfer.integrations", "vllm", "sglang"), ()),
], ids=["core", "server", "client", "engine-core"])
def test_imports_go_one_way(root: Path, forbidden: tuple[str, ...], allowed_in: tuple[str, ...]) -> None:
    upward = {f"{p.relative_to(root)}: {name}" for p in modules(root)
              for name in imports(p, top_level_only=False)
              if within(name, forbidden) and str(p.relative_to(root)) not in allowed_in}
    assert upward == set()


def test_the_worker_side_loads_nothing_of_the_daemons_stack() -> None:
    own = {CORE / "certs.py", *(CORE / "transport").rglob("*.py")}
    loaded = {f"{p.relative_to(REPO)}: {name}" for root in (CORE, CLIENT) for p in modules(root)
              if p not in own for name in imports(p, top_level_only=True)
              if within(name, DAEMON_STACK)}
    assert loaded == set()
