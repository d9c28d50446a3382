"""The ``kvxfer`` command line: run a daemon, inspect it, load-test it, run the demo."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvxfer.client import logs
from kvxfer.errors import KvxferError, PeerUnavailableError

DEFAULT_ADDRESS = "unix:///run/kvxfer/kvxfer.sock"
#: How often ``kvxfer health --wait`` asks again.
HEALTH_POLL_S = 0.2
console = Console()
#: What the commands that run daemons (or make certificates) say in the worker install.
DAEMON_MISSING = ("kvxfer {command} needs the daemon install, which this one is not (the "
                  "worker install holds the client library, the connector and this command): "
                  "pip install 'kvxfer[daemon]'")


def has_daemon() -> bool:
    """Whether this install has the daemon (``kvxfer-server``), hence ``kvxfer serve``."""
    return importlib.util.find_spec("kvxfer.server") is not None


def cmd_missing(args: argparse.Namespace) -> int:
    """A command of the daemon install, called in another: say what to install."""
    console.print(f"[red]error:[/] {escape(DAEMON_MISSING.format(command=args.command))}",
                  soft_wrap=True)
    return 2


def _client(args: argparse.Namespace) -> Any:
    from kvxfer.client.library import KvxferClient

    return KvxferClient(args.address, timeout_s=args.timeout)


def cmd_serve(args: argparse.Namespace) -> int:
    import faulthandler

    from kvxfer.server.config import load_config
    from kvxfer.server.daemon import run

    faulthandler.enable()  # a crash in native code (UCX) still leaves a stack trace in the log
    config = load_config(args.config, pool_flags=args.pool, cli=args.settings(parsed_args=args))
    return run(config, args.ready_file)


def cmd_pools(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        pools = kv.pools()
        leased = kv.leased_pages()
        leases = kv.leases() if args.leases else []
    if args.json:
        out: Any = [{**_descriptor_dict(d, m), "leased_pages": leased[d.name],
                     "free_pages": d.num_pages - leased[d.name]} for d, m in pools]
        if args.leases:
            out = {"pools": out, "leases": [
                {"lease_id": x.lease_id, "pool": x.pool, "runs": x.runs.pairs(),
                 "pages": x.runs.num_pages, "expires_in_s": round(x.expires_in_s, 3),
                 "holder": x.holder} for x in leases]}
        print(json.dumps(out, indent=2))
        return 0
    table = Table(title=f"pools at {args.address}")
    for col in ("pool", "kind", "device", "pages", "free", "leased", "page_bytes", "anchor", "arena"):
        table.add_column(col)
    for d, m in pools:
        table.add_row(d.name, d.kind.value, m.device, str(d.num_pages),
                      str(d.num_pages - leased[d.name]), str(leased[d.name]), str(d.page_bytes),
                      str(d.layout.anchor_bytes), m.arena)
    console.print(table)
    if args.leases:
        lease_table = Table(title="leases")
        for col in ("lease", "pool", "pages", "runs", "expires in", "holder"):
            lease_table.add_column(col)
        for x in leases:
            lease_table.add_row(x.lease_id, x.pool, str(x.runs.num_pages), str(x.runs.pairs())[:60],
                                f"{x.expires_in_s:.1f} s", x.holder)
        console.print(lease_table)
    return 0


def _descriptor_dict(d: Any, memory: Any) -> dict[str, Any]:
    return {
        "name": d.name, "kind": d.kind.value, "device": memory.device, "arena": memory.arena,
        "anchor_bytes": d.layout.anchor_bytes, "page_bytes": d.page_bytes,
        "num_pages": d.num_pages, "page_size": d.spec.page_size,
        "spec": {k: v for k, v in d.spec.__dict__.items()},
        "views": [{"role": v.role.value, "index": v.index, "dtype": v.dtype, "shape": list(v.shape),
                   "stride": list(v.stride), "offset_bytes": v.offset_bytes} for v in d.views],
    }


def cmd_describe(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        d, m = kv.describe(args.pool)
    info = _descriptor_dict(d, m)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    console.print(f"[bold]{d.name}[/]: {d.kind.value} on {m.device}, {d.num_pages} pages x "
                  f"{d.page_bytes} B, anchor {d.layout.anchor_bytes} in arena {m.arena}")
    console.print(f"spec: {info['spec']}")
    table = Table()
    for col in ("view", "dtype", "shape", "stride (elements)", "offset_bytes"):
        table.add_column(col)
    for v in d.views:
        table.add_row(f"{v.role.value}[{v.index}]", v.dtype, str(v.shape), str(v.stride),
                      str(v.offset_bytes))
    console.print(table)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    while True:  # with --wait, until SERVING or the deadline; an unreachable daemon is retried
        try:
            with _client(args) as kv:
                status = kv.health()
        except PeerUnavailableError:
            if time.monotonic() >= deadline:
                raise
            status = ""
        if status == "SERVING" or time.monotonic() >= deadline:
            break
        time.sleep(HEALTH_POLL_S)
    print(json.dumps({"address": args.address, "status": status}) if args.json else status)
    return 0 if status == "SERVING" else 1


def cmd_transfers(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        transfers = kv.transfers()
    if args.json:
        print(json.dumps([t.as_dict() for t in transfers], indent=2))
        return 0
    table = Table(title=f"transfers at {args.address}")
    for col in ("id", "role", "state", "pool", "peer", "pages", "bytes", "seconds", "error"):
        table.add_column(col)
    for t in transfers:
        table.add_row(t.transfer_id, t.role.name, t.state.name, t.pool, t.peer, str(t.pages),
                      str(t.bytes), f"{t.seconds:.3f}", t.error[:60])
    console.print(table)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        info, peers = kv.info(), kv.peers()
    rows = [{"peer": p.peer_address, "direction": "outbound" if p.outbound else "inbound",
             "data_plane": p.data_plane.label, "lanes": p.lanes, "session": p.session_id,
             "identity": p.identity} for p in peers]
    if args.json:
        print(json.dumps({"address": args.address, **info, "peers": rows}, indent=2))
        return 0
    console.print(f"kvxfer {info['version']} at {args.address}: peers dial "
                  f"{info['peer_address']}; memory epoch {info['epoch'][:12]}")
    table = Table(title="sessions with peer daemons (outbound: this daemon sends)")
    for col in ("peer", "direction", "data plane", "lanes", "session", "identity"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["peer"], row["direction"], row["data_plane"], str(row["lanes"]),
                      row["session"][:8], row["identity"])
    console.print(table)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvxfer.client.bench import run_bench

    if args.spawn and not has_daemon():  # it starts two daemons
        return cmd_missing(args)
    return run_bench(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvxfer.client.demo import run_demo

    if not has_daemon():  # it starts two daemons
        return cmd_missing(args)
    return run_demo(args)


def cmd_vllm(args: argparse.Namespace) -> int:
    from kvxfer.client.integrations.vllm.command import run_vllm

    if not has_daemon():  # it starts two daemons
        return cmd_missing(args)
    return run_vllm(args)


def cmd_certs(args: argparse.Namespace) -> int:
    from pathlib import Path

    if importlib.util.find_spec("cryptography") is None:
        return cmd_missing(args)
    from kvxfer.certs import LOOPBACK_HOSTS, issue_certs

    hosts = tuple(args.host) or LOOPBACK_HOSTS
    written = issue_certs(Path(args.out), args.node, hosts, days=args.days)
    for files in written:
        print(f"{files.name}: --peer-tls-cert {files.cert} --peer-tls-key {files.key} "
              f"--peer-tls-ca {Path(args.out) / 'ca.pem'}")
    return 0


EXAMPLES = {
    "serve": "kvxfer serve --pool kv=llama8b --peer-address 0.0.0.0:7500 \\\n"
             "      --advertise-address $(hostname -i):7500 --ucx-host $(hostname -i)\n"
             "  kvxfer serve --config /etc/kvxfer/daemon.yaml",
    "pools": "kvxfer pools --address unix:///run/kvxfer/kvxfer.sock --leases",
    "describe": "kvxfer describe kv --json",
    "health": "kvxfer health --address 127.0.0.1:7501",
    "transfers": "kvxfer transfers --json",
    "status": "kvxfer status --address unix:///run/kvxfer/kvxfer.sock",
    "bench": "kvxfer bench --spawn --preset llama8b --pages 128 --transfers 20 --verify\n"
             "  kvxfer bench --prefill unix:///run/a.sock --decode unix:///run/b.sock "
             "--decode-peer 10.0.0.2:7500 --json",
    "demo": "kvxfer demo\n  kvxfer demo --model hybrid",
    "certs": "kvxfer certs --out /etc/kvxfer/tls --node prefill-0 --node decode-0 \\\n"
             "      --host 127.0.0.1 --host localhost",
    "vllm": ".venv-vllm/bin/kvxfer vllm\n  .venv-vllm/bin/kvxfer vllm --model /models/llama --pages 4096 --port 9000",
}


SERVE_HELP = ("Run a kvxfer daemon that owns KV pools and serves them over gRPC. Every "
              "setting below is also a key of the --config file and an environment "
              "variable KVXFER_<KEY> (flag > environment > file > default).")


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    """``kvxfer serve``'s flags: the daemon's settings (the daemon install's)."""
    s.add_argument("--config", help="YAML config file (settings, pools, arenas)")
    s.add_argument("--pool", action="append", default=[], metavar="SPEC",
                   help="a pool: NAME=PRESET (llama8b, llama8b-ps1, tiny, mla-small, mamba-small) "
                        "or name=N,kind=mha,layer_num=..,head_num=..,... (repeatable; served "
                        "after the config file's pools)")
    s.add_argument("--ready-file", help="write a JSON line with the bound addresses and ports "
                                        "once serving (it appears whole: polling for it is safe)")
    s.add_argument("--log-level", default="info", help="debug, info, warning (default info)")
    s.add_argument("--log-format", choices=logs.FORMATS,
                   default=os.environ.get("KVXFER_LOG_FORMAT", "text"),
                   help="text lines, or JSON lines with transfer_id and trace_id on every line "
                        "about a transfer (default: $KVXFER_LOG_FORMAT, else text)")
    from pydantic_settings import CliSettingsSource

    from kvxfer.server.config import DaemonConfig

    s.set_defaults(settings=CliSettingsSource(DaemonConfig, root_parser=s))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvxfer",
        description="kvxfer moves page-major KV caches between prefill and decode daemons: "
                    "run the daemon, inspect it, load-test it.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, func: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_,
                           epilog=f"example:\n  {EXAMPLES[name]}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    def add_daemon_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default=DEFAULT_ADDRESS,
                       help=f"the daemon's worker address (default {DEFAULT_ADDRESS})")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    if has_daemon():
        add_serve_flags(add("serve", SERVE_HELP, cmd_serve))
    else:  # every argument, --help included, gets the refusal
        sub.add_parser("serve", help=SERVE_HELP, add_help=False).set_defaults(func=cmd_missing)

    pools = add("pools", "List the pools a daemon serves, with their free and leased pages.",
                cmd_pools)
    pools.add_argument("--leases", action="store_true", help="also list every live page lease")
    add_daemon_flags(pools)
    health = add("health", "Ask a daemon for its health (exit 0 when SERVING).", cmd_health)
    health.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="ask again until SERVING, for up to SECONDS, also while the daemon "
                             "is not reachable yet (a daemon starting; default 0: ask once)")
    add_daemon_flags(health)
    for name, help_, func in (
        ("transfers", "List a daemon's in-flight and recent transfers.", cmd_transfers),
        ("status", "Show a daemon's version, peer address and memory epoch, and its sessions "
                   "with peer daemons: each one's direction and data plane (local-copy: same "
                   "host, the receiver copies; ucx-tagged: UCX messages).", cmd_status),
    ):
        add_daemon_flags(add(name, help_, func))
    d = add("describe", "Show a pool's descriptor: anchor, page_bytes, per-layer shapes and strides.",
            cmd_describe)
    d.add_argument("pool", help="the pool's name")
    add_daemon_flags(d)

    c = add("certs", "Make a CA and a certificate per node for the peer API's mutual TLS (for "
                     "development and tests; in production use your cluster's CA). Writes "
                     "ca.pem, ca.key, NODE.pem and NODE.key (keys owner-only) and prints each "
                     "node's serve flags.", cmd_certs)
    c.add_argument("--out", required=True, help="directory to write into (its CA is replaced)")
    c.add_argument("--node", action="append", required=True,
                   help="a node name: its certificate's identity (repeatable)")
    c.add_argument("--host", action="append", default=[],
                   help="an IP address or DNS name peers dial the nodes at (repeatable; "
                        "default 127.0.0.1 and localhost)")
    c.add_argument("--days", type=int, default=365, help="validity in days (default 365)")

    from kvxfer.client.bench import add_bench_flags
    from kvxfer.client.demo import add_demo_flags

    add_bench_flags(add("bench", "Load-test transfers between two daemons and summarize them.",
                        cmd_bench))
    add_demo_flags(add("demo", "Start a prefill and a decode daemon on loopback, move KV pages "
                               "through them, check them, and summarize.", cmd_demo))
    from kvxfer.client.integrations.vllm.command import add_vllm_flags

    add_vllm_flags(add("vllm", "Serve a model disaggregated on this machine: two daemons, a prefill "
                               "and a decode vLLM engine with KvxferConnector, and "
                               "vLLM's router (vllm-router) in front, until Ctrl-C (needs "
                               "vLLM).", cmd_vllm))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``kvxfer`` command line."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.func is not cmd_missing:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logs.configure(getattr(args, "log_level", "warning"), getattr(args, "log_format", "text"))
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
    except KvxferError as exc:
        console.print(f"[red]error:[/] {type(exc).__name__}: {escape(str(exc))}", soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
