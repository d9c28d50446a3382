"""``kvxfer demo``: the whole path on one machine, in well under a minute.

Starts a prefill and a decode daemon on loopback (CPU pools; their peer APIs
over mutual TLS, with certificates of a CA made for the run), attaches a worker
to each, writes K/V through the prefill worker's per-layer views, pushes the
pages to scattered destination pages, checks through the decode worker's views
that every layer arrived intact and no other page changed, prints a summary and
stops both daemons. ``--model`` instead runs a small transformer end to end.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from rich.console import Console
from rich.table import Table

from kvxfer.client.handoff import hand_off
from kvxfer.client.library import KvxferClient
from kvxfer.client.spawn import LocalDaemon, dev_certs
from kvxfer.pages import PageRuns

console = Console()

#: llama-8B-like per-token KV (32 layers, 8 KV heads, head_dim 128, bf16; 2 MiB pages).
DEMO_POOL = "name=kv,preset=llama8b,num_pages={pages}"


def add_demo_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvxfer demo``."""
    p.add_argument("--pages", type=int, default=64, help="pages per pool (default 64 = 128 MiB)")
    p.add_argument("--transfer-pages", type=int, default=32,
                   help="pages moved (default 32 = 64 MiB)")
    p.add_argument("--model", choices=["mha", "mla", "hybrid", "all"],
                   help="run the disaggregated model example instead (prefill -> decode tokens)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 only if every byte arrived where it should."""
    if args.model:
        from kvxfer.client.examples.disagg import run_model_demo

        return run_model_demo(args.model, seed=args.seed)
    rng = random.Random(args.seed)
    pool = DEMO_POOL.format(pages=args.pages)
    console.print(f"[bold]kvxfer demo[/]: starting a prefill and a decode daemon ({args.pages} "
                  "pages of 2 MiB each, CPU shared memory, loopback) ...")
    with dev_certs("prefill", "decode") as tls, LocalDaemon("prefill", [pool], tls=tls) as pre, \
            LocalDaemon("decode", [pool], tls=tls) as dec, \
            KvxferClient(pre.worker_address) as prefill, KvxferClient(dec.worker_address) as decode, \
            prefill.attach("kv") as src_pool, decode.attach("kv") as dst_pool:
        n = args.transfer_pages
        src_pages = rng.sample(range(args.pages), n)
        dst_pages = rng.sample(range(args.pages), n)
        gen = torch.Generator().manual_seed(args.seed)
        for k, v in zip(src_pool.views.k, src_pool.views.v):
            for p in src_pages:
                k[p].copy_(torch.randn(k[p].shape, generator=gen).to(k.dtype))
                v[p].copy_(torch.randn(v[p].shape, generator=gen).to(v.dtype))
        before = dst_pool.raw.clone()
        src, dst = PageRuns.from_pages(src_pages), PageRuns.from_pages(dst_pages)
        start = time.perf_counter()
        done = hand_off(prefill, decode, "demo-request", pool="kv", src=src, dst=dst,
                        decode_peer=dec.peer_address, verify=True, timeout_s=30)
        wall = time.perf_counter() - start
        sent, got = done.sent, done.received
        layers_ok = all(
            torch.equal(sk[s], dk[d]) and torch.equal(sv[s], dv[d])
            for sk, sv, dk, dv in zip(src_pool.views.k, src_pool.views.v,
                                      dst_pool.views.k, dst_pool.views.v)
            for s, d in zip(src_pages, dst_pages)
        )
        for s, d in zip(src_pages, dst_pages):
            off = dst_pool.descriptor.layout.page_offset(d)
            before[off : off + dst_pool.descriptor.page_bytes] = src_pool.page_bytes_view(s)
        others_ok = torch.equal(dst_pool.raw, before)
        table = Table(title="kvxfer demo: prefill -> decode over UCX")
        table.add_column("what")
        table.add_column("result", justify="right")
        for row in (
            ("pages moved", f"{n} x {src_pool.descriptor.page_bytes // 2**20} MiB "
                            f"({got.extents} UCX messages)"),
            ("sender / receiver state", f"{sent.state.name} / {got.state.name}"),
            ("daemons authenticated each other", "yes: mutual TLS, a CA made for the demo"),
            ("checksums verified by the receiver", "yes" if got.verified else "no"),
            ("all 32 layers' K and V equal through the decode views", "yes" if layers_ok else "NO"),
            ("every other destination page unchanged", "yes" if others_ok else "NO"),
            ("transfer time (receiver)", f"{got.seconds * 1e3:.1f} ms"),
            ("throughput", f"{got.bytes / got.seconds / 1e9:.2f} GB/s" if got.seconds else "-"),
            ("wall time incl. gRPC calls", f"{wall * 1e3:.1f} ms"),
        ):
            table.add_row(*row)
        console.print(table)
        ok = sent.ok and got.ok and got.verified and layers_ok and others_ok
    console.print("[green]demo OK[/]" if ok else "[red]demo FAILED[/]")
    return 0 if ok else 1
