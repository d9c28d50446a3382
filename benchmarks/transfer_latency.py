"""kvxfer's fixed cost per transfer: small transfers against a gRPC round trip, in one run.

A short prompt moves few pages, and then a transfer's time is mostly control
plane: the expect and push calls, the daemons' Claim (and Commit, with verify)
between each other, and both waits. This starts two daemons on loopback and
times transfers of 1 and 16 pages of the standard llama-8B-like pool (2 MiB
pages), pushed (from the expect call to both waits returning) and pulled (from
the offer call to both waits returning), with verification off (the library's
default) and on.

The reference is a trivial gRPC call to the same daemon (``Health.Check``),
timed in the same rounds, so the figure printed per case is how many such round
trips a transfer costs; the machine is shared and noisy, so cases run
interleaved and each ratio is the median of the per-round ratios.

It also counts the CPU time each case costs, per transfer, in the prefill daemon,
the decode daemon and this client (user + system, from ``/proc``), and the CPU time
of the trivial call: on a machine with few cores a transfer's time is bounded by
the CPU it needs, however few round trips it waits for.

usage: python benchmarks/transfer_latency.py [--rounds 5] [--per-round 20] [--eh on|off] [--lanes 1]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

from transfer_bandwidth import daemon_pair, print_result, rounds_parser, ucx_env


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = rounds_parser(__doc__, per_round=20)
    parser.add_argument("--lanes", type=int, default=1,
                        help="the daemons' UCX data lanes (default 1, the daemon default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    cases = [(verb, pages, verify) for verb in ("push", "pull") for pages in (1, 16)
             for verify in (False, True)]
    seconds: dict[str, list[float]] = {"grpc_health": []}
    per_round: dict[str, list[float]] = {}
    cpu: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
    with daemon_pair("llama8b", 1, ucx_env(), 4 << 20, args.eh == "on", "/dev/shm",
                     args.lanes) as pair:
        pids = {"prefill": pair.prefill.pid, "decode": pair.decode.pid}

        def timed(name: str, one: Callable[[], float]) -> list[float]:
            """``per_round`` runs of ``one``, counting the CPU they cost into ``cpu[name]``."""
            before = {side: cpu_seconds(pid) for side, pid in pids.items()}
            client = time.process_time()
            samples = [one() for _ in range(args.per_round)]
            cpu[name]["client"] += time.process_time() - client
            for side, pid in pids.items():
                cpu[name][side] += cpu_seconds(pid) - before[side]
            return samples

        def one_transfer(verb: str, pages: int, verify: bool) -> float:
            return (pair.move if verb == "push" else pair.pull)(pages, verify)[1]

        def one_health() -> float:
            start = time.perf_counter()
            pair.receiver.health()
            return time.perf_counter() - start

        for _ in range(args.rounds):
            health = timed("grpc_health", one_health)
            seconds["grpc_health"] += health
            for verb, pages, verify in cases:
                name = f"{verb}_pages{pages}_verify_{'on' if verify else 'off'}"
                samples = timed(name, partial(one_transfer, verb, pages, verify))
                seconds.setdefault(name, []).extend(samples)
                per_round.setdefault(name, []).append(
                    statistics.median(samples) / statistics.median(health))

    result: dict[str, object] = {"eh": args.eh, "lanes": args.lanes, "rounds": args.rounds,
                                 "per_round": args.per_round, "page_bytes": 2 << 20,
                                 "cpu_count": os.cpu_count()}
    for name, values in seconds.items():
        result[f"{name}_ms_median"] = _median_ms(values)
    for name, values in per_round.items():
        result[f"ratio_{name}_vs_grpc_health"] = round(statistics.median(values), 1)
    calls = args.rounds * args.per_round
    for name, by_process in cpu.items():
        for process, used in by_process.items():
            result[f"{name}_cpu_ms_{process}"] = round(used / calls * 1e3, 3)
        result[f"{name}_cpu_ms_total"] = round(sum(by_process.values()) / calls * 1e3, 3)
    health_cpu = sum(cpu["grpc_health"].values())
    for name in per_round:
        if health_cpu > 0:
            result[f"cpu_ratio_{name}_vs_grpc_health"] = round(
                sum(cpu[name].values()) / health_cpu, 1)
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
