"""Disaggregated prefill -> decode with real model compute, through two kvxfer daemons.

    python -m kvxfer.client.examples.disagg --flavour hybrid      # or: kvxfer demo --model hybrid

The orchestrator starts a prefill and a decode daemon on loopback, then two
worker *processes*:

- the prefill worker attaches to its daemon's pools, allocates pages (and a
  Mamba slot) per prompt, runs prefill writing KV in place, offers the pages
  under the request's id, and prints each request's first token with the
  offers' capabilities (the secrets the pulls present);
- the decode worker attaches to its own daemon, pulls each transfer into
  pages it chose (scattered, different from the prefill side), waits, and
  greedily generates the remaining tokens reading the transferred cache.

The same model run in one process (no transfer) is the reference: the tokens
must be equal and the logits equal within float tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvxfer.client.examples.model import ModelConfig, RequestCache, TinyModel
from kvxfer.ucx_settings import LOOPBACK_ENV

PROMPTS = [[5, 17, 3, 88, 41, 9, 23], [60, 2, 2, 71, 13, 30, 44, 8, 19, 1, 77, 52, 6],
           [11, 90], [33, 4, 58, 21, 67, 12, 45, 3, 8, 95, 16, 28, 39, 71, 2, 50, 61, 14, 7]]


def _allocate(model: TinyModel, lengths: list[int], seed: int) -> list[list[int]]:
    """Scattered, disjoint pages for each request (a stand-in for the engine's allocator)."""
    free = list(range(model.cfg.num_pages))
    random.Random(seed).shuffle(free)
    tables = []
    for n in lengths:
        need = model.pages_needed(n)
        tables.append(free[:need])
        del free[:need]
    return tables


def _views(kv: Any, ssm: Any, table: list[int], slot: int, cfg: ModelConfig) -> RequestCache:
    return RequestCache(kv.views, table, cfg.page_size, ssm.views if ssm is not None else None, slot)


def _clear(cache: RequestCache) -> None:
    for view in (*cache.kv.k, *cache.kv.v, *cache.kv.latent):
        view[cache.pages] = 0
    if cache.ssm is not None:
        cache.ssm.conv[0][:, cache.slot] = 0
        cache.ssm.temporal[:, cache.slot] = 0  # type: ignore[index]


@dataclass
class Worker:
    """What both worker processes start from: the model, the requests, the client and
    the attached pools (``ssm`` only for the hybrid flavour)."""

    cfg: ModelConfig
    model: TinyModel
    requests: list[dict[str, Any]]
    client: Any
    kv: Any
    ssm: Any


@contextmanager
def _worker(args: argparse.Namespace) -> Iterator[Worker]:
    """Build the model, attach to the local daemon's pools; detach and close on exit."""
    from kvxfer.client import KvxferClient

    cfg = ModelConfig(flavour=args.flavour)
    with KvxferClient(args.address) as client:
        kv = client.attach("kv")
        ssm = client.attach("ssm") if cfg.flavour == "hybrid" else None
        try:
            yield Worker(cfg, TinyModel(cfg), json.loads(args.requests), client, kv, ssm)
        finally:
            kv.detach()
            if ssm is not None:
                ssm.detach()


def prefill_worker(args: argparse.Namespace) -> None:
    """Prefill every request, offer its cache, print its first token and the offers'
    capabilities, then wait for the pulls."""
    from kvxfer.pages import PageRuns

    with _worker(args) as w:
        cfg, model, requests, kv_client, kv, ssm = w.cfg, w.model, w.requests, w.client, w.kv, w.ssm
        tables = _allocate(model, [len(r["prompt"]) for r in requests], seed=1)
        ids = []
        for slot, (req, table) in enumerate(zip(requests, tables)):
            cache = _views(kv, ssm, table, slot, cfg)
            _clear(cache)
            logits = model.prefill(req["prompt"], cache)
            parts = {"kv": PageRuns.from_pages(table)}
            if ssm is not None:
                parts["ssm"] = PageRuns.of([(slot, 1)])
            capabilities = {}
            for pool, runs in parts.items():
                offered = kv_client.offer(f"{req['id']}/{pool}", pool, runs, timeout_s=60,
                                          verify=args.verify)
                capabilities[pool] = offered.capability
                ids.append(f"{req['id']}/{pool}")
            print(json.dumps({"id": req["id"], "first_token": int(logits.argmax()),
                              "logits": logits.tolist(), "capabilities": capabilities}), flush=True)
        states = {i: kv_client.wait(i, timeout_s=60).state.name for i in ids}
        print(json.dumps({"offered": states}), flush=True)


def decode_worker(args: argparse.Namespace) -> None:
    """Pull every request's cache into our own pages, wait, then generate greedily."""
    from kvxfer.pages import PageRuns

    with _worker(args) as w:
        cfg, model, requests, kv_client, kv, ssm = w.cfg, w.model, w.requests, w.client, w.kv, w.ssm
        lengths = [len(r["prompt"]) + r["new_tokens"] for r in requests]
        tables = _allocate(model, lengths, seed=2)
        slots = list(range(cfg.num_slots - 1, cfg.num_slots - 1 - len(requests), -1))
        for req, table, slot in zip(requests, tables, slots):
            prompt_pages = table[: model.pages_needed(len(req["prompt"]))]
            parts = {"kv": PageRuns.from_pages(prompt_pages)}
            if ssm is not None:
                parts["ssm"] = PageRuns.of([(slot, 1)])
            for pool, runs in parts.items():
                kv_client.pull(f"{req['id']}/{pool}", args.peer, pool, runs, timeout_s=60,
                               capability=req["capabilities"][pool])
        results = {}
        for req, table, slot in zip(requests, tables, slots):
            for part in ("kv", "ssm") if ssm is not None else ("kv",):
                status = kv_client.wait(f"{req['id']}/{part}", timeout_s=60)
                if not status.ok:
                    raise SystemExit(f"transfer {req['id']}/{part} {status.state.name}: {status.error}")
            cache = _views(kv, ssm, table, slot, cfg)
            token, position = req["first_token"], len(req["prompt"])
            tokens, logits_seen = [token], []
            for _ in range(req["new_tokens"] - 1):
                logits = model.decode(token, position, cache)
                token, position = int(logits.argmax()), position + 1
                tokens.append(token)
                logits_seen.append(logits.tolist())
            results[req["id"]] = {"tokens": tokens, "logits": logits_seen}
        print(json.dumps(results), flush=True)


def reference(flavour: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The same model in one process with local pools: prefill then decode, no transfer."""
    from kvxfer.descriptor import PoolDescriptor
    from kvxfer.layout import PoolLayout
    from kvxfer.layout.kinds import spec_from_mapping

    cfg = ModelConfig(flavour=flavour)
    model = TinyModel(cfg)

    class Local:
        def __init__(self, entry: dict[str, Any]) -> None:
            entry = dict(entry)
            desc = PoolDescriptor(entry.pop("name"), PoolLayout(spec_from_mapping(entry)))
            self.views = desc.build_views(torch.zeros(desc.layout.end_bytes, dtype=torch.uint8))

    pools = [Local(e) for e in cfg.pools()]
    kv, ssm = pools[0], pools[1] if len(pools) > 1 else None
    out = {}
    tables = _allocate(model, [len(p) + new_tokens for p in prompts], seed=3)
    for i, (prompt, table) in enumerate(zip(prompts, tables)):
        cache = _views(kv, ssm, table, i, cfg)
        logits = model.prefill(prompt, cache)
        token, position = int(logits.argmax()), len(prompt)
        tokens, seen = [token], []
        for _ in range(new_tokens - 1):
            logits = model.decode(token, position, cache)
            token, position = int(logits.argmax()), position + 1
            tokens.append(token)
            seen.append(logits.tolist())
        out[f"r{i}"] = {"tokens": tokens, "logits": seen}
    return out


def daemon_config(flavour: str, path: Path) -> Path:
    """A ``kvxfer serve`` config with the model's pools in one arena."""
    import yaml  # the daemon install's, like the daemons this example starts
    pools = ModelConfig(flavour=flavour).pools()
    path.write_text(yaml.safe_dump({"arenas": [{"name": "model", "pools": pools}]}))
    return path


def run_disaggregated(flavour: str, prompts: list[list[int]], new_tokens: int, *,
                      verify: bool = False, daemons: tuple[Any, Any] | None = None,
                      decode_launcher: list[str] | None = None) -> dict[str, Any]:
    """Prefill and decode in two worker processes through two daemons; the decode results.

    ``daemons`` reuses a running (prefill, decode) ``LocalDaemon`` pair serving the
    flavour's pools; otherwise a pair is started and stopped here. ``decode_launcher`` is
    the command that runs this module's ``decode-worker`` with its arguments (default:
    this module).
    """
    from kvxfer.client.spawn import LocalDaemon

    if daemons is None:
        with tempfile.TemporaryDirectory(prefix="kvxfer-model-") as tmp:
            config = str(daemon_config(flavour, Path(tmp) / "pools.yaml"))
            with LocalDaemon("prefill", [], extra_args=["--config", config]) as pre, \
                    LocalDaemon("decode", [], extra_args=["--config", config]) as dec:
                return run_disaggregated(flavour, prompts, new_tokens, verify=verify,
                                         daemons=(pre, dec), decode_launcher=decode_launcher)
    pre, dec = daemons
    requests: list[dict[str, Any]] = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(prompts)]
    env = {**os.environ, **LOOPBACK_ENV}
    me = [sys.executable, "-m", "kvxfer.client.examples.disagg"]
    prefill = subprocess.Popen(
        [*me, "prefill-worker", "--flavour", flavour, "--address", pre.worker_address,
         "--requests", json.dumps(requests),
         *(["--verify"] if verify else [])],
        stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert prefill.stdout is not None
        firsts = [json.loads(prefill.stdout.readline()) for _ in requests]
        for req, first in zip(requests, firsts):
            req.update(first_token=first["first_token"], new_tokens=new_tokens,
                       capabilities=first["capabilities"])
        decode = subprocess.run(
            [*(decode_launcher or me), "decode-worker", "--flavour", flavour, "--address",
             dec.worker_address, "--peer", pre.peer_address, "--requests", json.dumps(requests)],
            capture_output=True, text=True, env=env, timeout=120)
        if decode.returncode != 0:
            raise RuntimeError(f"decode worker failed:\n{decode.stderr[-3000:]}")
        offered = json.loads(prefill.stdout.readline())
        prefill.wait(60)
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait(10)
    results: dict[str, Any] = json.loads(decode.stdout)
    for req, first in zip(requests, firsts):
        results[req["id"]]["prefill_logits"] = first["logits"]
    results["_offered"] = offered["offered"]
    return results


def compare(got: dict[str, Any], want: dict[str, Any], atol: float = 1e-4) -> dict[str, Any]:
    """Per request: tokens equal? largest logit difference."""
    report = {}
    for rid, ref in want.items():
        mine = got[rid]
        diffs = [float((torch.tensor(a) - torch.tensor(b)).abs().max())
                 for a, b in zip(mine["logits"], ref["logits"])]
        report[rid] = {"tokens_equal": mine["tokens"] == ref["tokens"],
                       "max_logit_diff": max(diffs) if diffs else 0.0,
                       "logits_close": all(d <= atol for d in diffs),
                       "tokens": mine["tokens"]}
    return report


def run_model_demo(flavour: str, seed: int = 0, new_tokens: int = 8) -> int:
    """``kvxfer demo --model``: every flavour (or one) against its single-process reference."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    flavours = ["mha", "mla", "hybrid"] if flavour == "all" else [flavour]
    table = Table(title="disaggregated prefill -> decode vs one process")
    for col in ("flavour", "request", "prompt len", "tokens (decode worker)", "equal", "max |dlogit|"):
        table.add_column(col)
    ok = True
    for f in flavours:
        console.print(f"running {f}: two daemons, a prefill and a decode worker process ...")
        got = run_disaggregated(f, PROMPTS, new_tokens, verify=True)
        report = compare(got, reference(f, PROMPTS, new_tokens))
        for rid, r in report.items():
            ok &= r["tokens_equal"] and r["logits_close"]
            table.add_row(f, rid, str(len(PROMPTS[int(rid[1:])])), str(r["tokens"]),
                          "yes" if r["tokens_equal"] else "NO", f"{r['max_logit_diff']:.2e}")
    console.print(table)
    console.print("[green]model demo OK[/]" if ok else "[red]model demo FAILED[/]")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvxfer.client.examples.disagg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    for name in ("prefill-worker", "decode-worker"):
        p = sub.add_parser(name, help=f"run the {name.split('-')[0]} worker (started by the demo)")
        p.add_argument("--flavour", required=True, choices=["mha", "mla", "hybrid"])
        p.add_argument("--address", required=True, help="this worker's daemon (worker address)")
        p.add_argument("--requests", required=True, help="JSON list of requests")
        p.add_argument("--peer", help="prefill daemon's peer address (decode worker)")
        p.add_argument("--verify", action="store_true", help="checksums on the offers")
    parser.add_argument("--flavour", default="all", choices=["mha", "mla", "hybrid", "all"])
    args = parser.parse_args(argv)
    if args.command == "prefill-worker":
        prefill_worker(args)
        return 0
    if args.command == "decode-worker":
        decode_worker(args)
        return 0
    return run_model_demo(args.flavour)


if __name__ == "__main__":
    sys.exit(main())
