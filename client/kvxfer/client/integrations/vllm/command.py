"""``kvxfer vllm``: disaggregated vLLM on this machine, until Ctrl-C.

Starts two kvxfer daemons, a prefill and a decode ``vllm serve`` with
KvxferConnector, and vLLM's own router (``vllm-router``) in front of them (or, with
``--proxy``, kvxfer's small development proxy), all on loopback; prints where
they are and a request to try; stops everything on SIGINT/SIGTERM. Run it
where vLLM is installed (``.venv-vllm/bin/kvxfer vllm``). Without ``--model``
it builds the tiny test model (no download).
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import threading
from pathlib import Path


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvxfer vllm``."""
    p.add_argument("--model", help="a Hugging Face model directory (default: build the tiny "
                                   "test model in the work directory)")
    p.add_argument("--port", type=int, default=8000,
                   help="the port requests go to: vllm-router's, or the proxy's (default 8000)")
    p.add_argument("--proxy", action="store_true",
                   help="put kvxfer's development proxy in front instead of vllm-router")
    p.add_argument("--prefill-port", type=int, default=8101,
                   help="the prefill engine's port (default 8101)")
    p.add_argument("--decode-port", type=int, default=8102,
                   help="the decode engine's port (default 8102)")
    p.add_argument("--pages", type=int, default=1024,
                   help="pages of each daemon's pool, one vLLM block each (default 1024)")
    p.add_argument("--verify", action="store_true", help="checksum every transfer")
    p.add_argument("--workdir", help="logs, sockets, stats (default: a temporary directory)")


def run_vllm(args: argparse.Namespace) -> int:
    """Start the deployment, print where it is, wait for a signal, stop it."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("kvxfer vllm needs vLLM: run it from the vLLM environment "
                         "(./scripts/setup-vllm.sh, then .venv-vllm/bin/kvxfer vllm)") from None
    from kvxfer.client.integrations.vllm.deploy import Disaggregation
    from kvxfer.client.integrations.vllm.tiny_model import build

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvxfer-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or str(build(str(workdir / "tiny-model")))
    print(f"starting 2 kvxfer daemons and 2 vLLM engines for {model} (logs in {workdir}) ...",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ports = (args.port, args.prefill_port, args.decode_port)
    with Disaggregation(model, workdir, num_pages=args.pages, verify=args.verify, ports=ports,
                        router=not args.proxy) as d:
        assert d.prefill_daemon is not None and d.decode_daemon is not None
        assert d.prefill is not None and d.decode is not None
        front = "proxy" if args.proxy else "router"
        print(json.dumps({front: d.front_address, "prefill": d.prefill.address,
                          "decode": d.decode.address,
                          "prefill_daemon": d.prefill_daemon.worker_address,
                          "decode_daemon": d.decode_daemon.worker_address}, indent=2))
        body = json.dumps({"model": model, "prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0})
        print(f"try:  curl -s {d.front_address}/v1/completions -H 'content-type: application/json' "
              f"-d '{body}'\nCtrl-C stops everything.", flush=True)
        stop.wait()
    print("stopped")
    return 0
