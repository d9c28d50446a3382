"""``kvxfer bench``: drive real transfers between two daemons and summarize them.

Each transfer moves ``--pages`` pages from seeded pseudo-random source runs
(lengths drawn from ``--run-length``) in the prefill pool to random, disjoint
destination runs in the decode pool. ``--concurrency`` workers run at once;
each owns its own slice of the decode pool so verification stays exact.
``--verify`` turns on per-chunk checksums in the daemons *and* compares every
destination page with its source page through attached views. That comparison
runs between a worker's transfers, so it counts in the run's wall time
(reported as ``verify_seconds``) but not in any transfer's latency.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvxfer.client.handoff import Handoff, hand_off
from kvxfer.client.library import AttachedPool, KvxferClient
from kvxfer.client.spawn import LocalDaemon, dev_certs
from kvxfer.pages import PageRuns

stderr = Console(stderr=True)


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvxfer bench``."""
    where = p.add_argument_group("daemons")
    where.add_argument("--spawn", action="store_true",
                       help="start a local prefill/decode pair on loopback for the run")
    where.add_argument("--prefill", help="prefill daemon's worker address (without --spawn)")
    where.add_argument("--decode", help="decode daemon's worker address (without --spawn)")
    where.add_argument("--decode-peer", help="decode daemon's peer address host:port (push mode)")
    where.add_argument("--prefill-peer", help="prefill daemon's peer address host:port (pull mode)")
    where.add_argument("--pool", default="kv", help="pool name on both daemons (default kv)")
    where.add_argument("--preset", default="llama8b",
                       help="pool preset for --spawn: llama8b (2 MiB pages, the standard workload), "
                            "llama8b-ps1 (128 KiB pages), tiny, mla-small (default llama8b)")
    where.add_argument("--num-pages", type=int, help="pool size for --spawn (default: the preset's)")
    where.add_argument("--shm-dir", help="shared-memory directory for --spawn's daemons, e.g. a "
                                         "tmpfs mounted with huge=always (default /dev/shm)")
    where.add_argument("--no-ucx-error-handling", dest="ucx_error_handling", action="store_false",
                       help="start --spawn's daemons without UCX peer error handling (docs/how-to/tuning.md)")
    where.add_argument("--local-copy", action="store_true",
                       help="start --spawn's daemons with --local-copy: same-host transfers are "
                            "copied by the receiving daemon from the sender's pool, no UCX")
    where.add_argument("--plaintext-peers", dest="tls", action="store_false",
                       help="--spawn's daemons talk in plaintext (default: mutual TLS with "
                            "certificates of a CA made for the run)")
    work = p.add_argument_group("workload")
    work.add_argument("--pages", type=int, default=128, help="pages per transfer (default 128)")
    work.add_argument("--run-length", default="1-16",
                      help="source/destination run lengths, MIN-MAX pages (default 1-16)")
    work.add_argument("--concurrency", type=int, default=1, help="transfers in flight (default 1)")
    work.add_argument("--transfers", type=int, default=10, help="measured transfers (default 10)")
    work.add_argument("--duration", type=float, help="run for this many seconds instead of --transfers")
    work.add_argument("--warmup", type=int, default=1, help="unmeasured transfers first (default 1)")
    work.add_argument("--mode", choices=["push", "pull"], default="push",
                      help="push (prefill sends after decode expects) or pull (default push)")
    work.add_argument("--verify", action="store_true",
                      help="checksums in the daemons and a byte comparison of every page")
    work.add_argument("--seed", type=int, default=0, help="random seed of the page runs (default 0)")
    work.add_argument("--timeout", type=float, default=60.0, help="deadline per transfer (default 60 s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def parse_run_length(text: str) -> tuple[int, int]:
    """``"1-16"`` -> (1, 16)."""
    low, _, high = text.partition("-")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise SystemExit(f"--run-length {text!r}: expected MIN-MAX with 1 <= MIN <= MAX")
    return lo, hi


def random_runs(rng: random.Random, pages: list[int], total: int, lengths: tuple[int, int]) -> PageRuns:
    """``total`` pages as runs of consecutive pages from ``pages``, in shuffled order."""
    runs: list[tuple[int, int]] = []
    placed = i = 0
    while placed < total:
        n = min(rng.randint(*lengths), total - placed)
        if i + n > len(pages):
            raise SystemExit(f"pool too small for the workload: {total} pages in runs of "
                             f"{lengths[0]}-{lengths[1]} with gaps do not fit in {len(pages)}; "
                             f"lower --pages or --concurrency")
        runs.append((pages[i], n))
        placed += n
        i += n + rng.randint(1, 3)
    rng.shuffle(runs)
    return PageRuns.of(runs)


@dataclass
class Results:
    """What the run measured."""

    latencies: list[float] = field(default_factory=list)
    bytes: int = 0
    transfers: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    mismatched: int = 0
    copied_locally: int = 0
    verify_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _one_transfer(args: argparse.Namespace, prefill: KvxferClient, decode: KvxferClient,
                  tid: str, src: PageRuns, dst: PageRuns) -> Handoff:
    return hand_off(prefill, decode, tid, pool=args.pool, src=src, dst=dst,
                    decode_peer=args.decode_peer or "", prefill_peer=args.prefill_peer or "",
                    mode=args.mode, verify=args.verify, timeout_s=args.timeout)


def _same_pages(src_pool: AttachedPool, dst_pool: AttachedPool, src: PageRuns, dst: PageRuns) -> bool:
    for s, d in zip(src.pages(), dst.pages()):
        if not torch.equal(src_pool.page_bytes_view(s), dst_pool.page_bytes_view(d)):
            return False
    return True


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; exit code 1 if any transfer or verification failed."""
    lengths = parse_run_length(args.run_length)
    with ExitStack() as stack:
        if args.spawn:
            spec = f"name={args.pool},preset={args.preset}"
            if args.num_pages:
                spec += f",num_pages={args.num_pages}"
            stderr.print(f"starting a prefill and a decode daemon ({args.preset}) on loopback ...")
            extra = ([] if args.ucx_error_handling else ["--no-ucx-error-handling"]) + \
                (["--local-copy"] if args.local_copy else [])
            where: dict[str, Any] = {"shm_dir": args.shm_dir} if args.shm_dir else {}
            if args.tls:
                where["tls"] = stack.enter_context(dev_certs("prefill", "decode"))
            try:
                pre = stack.enter_context(LocalDaemon("prefill", [spec], extra_args=extra, **where))
                dec = stack.enter_context(LocalDaemon("decode", [spec], extra_args=extra, **where))
            except (RuntimeError, TimeoutError) as exc:
                raise SystemExit(f"bench: could not start the daemons: {exc}") from None
            args.prefill, args.decode = pre.worker_address, dec.worker_address
            args.decode_peer, args.prefill_peer = dec.peer_address, pre.peer_address
        if not (args.prefill and args.decode):
            raise SystemExit("give --spawn, or --prefill and --decode worker addresses")
        if args.mode == "push" and not args.decode_peer:
            raise SystemExit("push mode needs --decode-peer (the decode daemon's peer address)")
        if args.mode == "pull" and not args.prefill_peer:
            raise SystemExit("pull mode needs --prefill-peer (the prefill daemon's peer address)")
        return _run(args, lengths, stack)


def _run(args: argparse.Namespace, lengths: tuple[int, int], stack: ExitStack) -> int:
    prefill = stack.enter_context(KvxferClient(args.prefill))
    decode = stack.enter_context(KvxferClient(args.decode))
    src_desc, _ = prefill.describe(args.pool)
    dst_desc, _ = decode.describe(args.pool)
    slice_pages = dst_desc.num_pages // args.concurrency
    if args.pages > src_desc.num_pages or args.pages > slice_pages:
        raise SystemExit(f"--pages {args.pages} does not fit: the source pool has "
                         f"{src_desc.num_pages} pages, each of {args.concurrency} workers gets "
                         f"{slice_pages} destination pages")
    src_pool = dst_pool = None
    if args.verify:
        src_pool = stack.enter_context(prefill.attach(args.pool))
        dst_pool = stack.enter_context(decode.attach(args.pool))
        gen = torch.Generator().manual_seed(args.seed)
        src_pool.raw.copy_(torch.randint(0, 256, src_pool.raw.shape, dtype=torch.uint8, generator=gen))
    results = Results()
    total = None if args.duration else args.transfers
    stop_at = time.monotonic() + args.duration if args.duration else None
    counter = iter(range(10**9))
    counter_lock = threading.Lock()

    def next_index() -> int | None:
        with counter_lock:
            i = next(counter)
        if stop_at is not None:
            return i if time.monotonic() < stop_at else None
        return i if i < args.transfers else None

    progress = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                        console=stderr, transient=args.json)
    bar = progress.add_task("transfers", total=total, rate="")

    stopped: list[BaseException] = []  # why workers ended early (a thread's exception is lost)

    def worker(w: int) -> None:
        try:
            transfers(w)
        except BaseException as exc:  # noqa: BLE001 - reported after the run
            stopped.append(exc)

    def transfers(w: int) -> None:
        rng = random.Random(args.seed * 1000 + w)
        my_pages = list(range(w * slice_pages, (w + 1) * slice_pages))
        with KvxferClient(args.prefill) as pre, KvxferClient(args.decode) as dec:
            for warm in range(args.warmup):
                src = random_runs(rng, list(range(src_desc.num_pages)), args.pages, lengths)
                dst = random_runs(rng, my_pages, args.pages, lengths)
                _one_transfer(args, pre, dec, f"warmup-{w}-{warm}-{time.time_ns()}", src, dst)
            while (i := next_index()) is not None:
                src = random_runs(rng, list(range(src_desc.num_pages)), args.pages, lengths)
                dst = random_runs(rng, my_pages, args.pages, lengths)
                start = time.perf_counter()
                copied = False
                try:
                    done = _one_transfer(args, pre, dec, f"bench-{i}-{time.time_ns()}", src, dst)
                    ok, why, copied = done.ok, done.why, done.received.lanes == 0
                except Exception as exc:  # noqa: BLE001 - counted as an error of its kind
                    ok, why = False, type(exc).__name__
                elapsed = time.perf_counter() - start
                same = ok and (src_pool is None or _same_pages(src_pool, dst_pool, src, dst))  # type: ignore[arg-type]
                verifying = time.perf_counter() - start - elapsed
                with results.lock:
                    results.verify_seconds += verifying
                    if ok:
                        results.copied_locally += copied
                        results.latencies.append(elapsed)
                        results.bytes += args.pages * src_desc.page_bytes
                        results.transfers += 1
                        if not same:
                            results.mismatched += 1
                    else:
                        results.errors[why] += 1
                    mbs = results.bytes / max(sum(results.latencies), 1e-9) / 1e9 * args.concurrency
                progress.update(bar, advance=1, rate=f"{mbs:.2f} GB/s")

    start = time.perf_counter()
    with progress:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    seconds = time.perf_counter() - start
    if stopped:
        raise SystemExit(f"bench: a worker stopped early: {stopped[0]}")
    summary = _summary(args, results, seconds, src_desc.page_bytes)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    failed = sum(results.errors.values()) > 0 or results.mismatched > 0
    return 1 if failed or results.transfers == 0 else 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _summary(args: argparse.Namespace, r: Results, seconds: float, page_bytes: int) -> dict[str, Any]:
    per_transfer = [args.pages * page_bytes / s / 1e9 for s in r.latencies]
    return {
        "mode": args.mode, "pool": args.pool, "pages_per_transfer": args.pages,
        "page_bytes": page_bytes, "bytes_per_transfer": args.pages * page_bytes,
        "concurrency": args.concurrency, "transfers": r.transfers, "bytes": r.bytes,
        "seconds": round(seconds, 4), "gbps": round(r.bytes / seconds / 1e9, 4) if seconds else 0.0,
        "verify_seconds": round(r.verify_seconds, 4),
        "gbps_per_transfer_median": round(statistics.median(per_transfer), 4) if per_transfer else 0.0,
        "gbps_per_transfer_min": round(min(per_transfer), 4) if per_transfer else 0.0,
        "gbps_per_transfer_max": round(max(per_transfer), 4) if per_transfer else 0.0,
        "p50_ms": round(_percentile(r.latencies, 0.5) * 1e3, 3),
        "p90_ms": round(_percentile(r.latencies, 0.9) * 1e3, 3),
        "p99_ms": round(_percentile(r.latencies, 0.99) * 1e3, 3),
        "errors": dict(r.errors), "mismatched_transfers": r.mismatched,
        "copied_locally": r.copied_locally,
        "verified": bool(args.verify and r.transfers and r.mismatched == 0 and not r.errors),
    }


def _print_summary(s: dict[str, Any]) -> None:
    table = Table(title="kvxfer bench")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("mode / concurrency", f"{s['mode']} / {s['concurrency']}"),
        ("transfers", str(s["transfers"])),
        ("bytes", f"{s['bytes']:,} ({s['bytes_per_transfer'] / 2**20:.1f} MiB each)"),
        ("seconds (client-side verifying)", f"{s['seconds']:.3f} ({s['verify_seconds']:.3f})"),
        ("throughput", f"{s['gbps']:.2f} GB/s"),
        ("per transfer GB/s median \\[min, max]",
         f"{s['gbps_per_transfer_median']:.2f} [{s['gbps_per_transfer_min']:.2f}, "
         f"{s['gbps_per_transfer_max']:.2f}]"),
        ("latency p50 / p90 / p99", f"{s['p50_ms']:.1f} / {s['p90_ms']:.1f} / {s['p99_ms']:.1f} ms"),
        ("errors", json.dumps(s["errors"]) if s["errors"] else "none"),
        ("verified", "yes" if s["verified"] else "no"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console(file=sys.stdout).print(table)
