"""kvxfer against NIXL end to end, on the standard workload, in alternating rounds.

Each round runs every case back to back (``--per-round`` transfers each, the order
rotating from round to round) and each ratio is the median of the per-round ratios,
because this machine is shared and noisy:

- kvxfer: two daemons on loopback; a transfer is what an engine waits for: the decode
  side's expect, the prefill side's push, both waits (``hand_off``), 128 pages of 2 MiB
  in seeded random runs of 1-16 (256 MiB), or 2048 pages of 128 KiB for page_size 1.
- NIXL 1.5.1 (``benchmarks/nixl_peer.py`` in ``.venv-nixl``, made by
  ``scripts/setup-nixl.sh``): an initiator and a target agent with the UCX backend and
  the same error-handling mode; a transfer is one WRITE of the same runs (coalesced
  where both sides are contiguous) with a notification, timed until the initiator saw
  it DONE and the target got the notification. NIXL registers memory the engine owns:
  both a /dev/shm file like kvxfer's pools (``nixl_shm``) and anonymous memory
  (``nixl_anon``) are measured, and "NIXL best" is the faster of the two in each round.

Printed: GB/s medians, the ratios kvxfer / NIXL best (target >= 1.3), page_size 1 /
page_size 16 (target >= 0.9), kvxfer with 4 transfers in flight / back to back (target
>= 1.0, with the spread of per-transfer times), and the latency of a one-page transfer in
gRPC round trips: (its median time - the time of its bytes at the standard workload's data
rate) / the median round trip of a trivial call, measured in the same run (target <= 3).

With ``--local-copy`` kvxfer's daemons copy same-host transfers themselves (the receiver
maps the sender's pool read-only: no UCX, safe against a dying peer); NIXL has no such
mode, so compare against its best configuration, error handling off (cma).

usage: python benchmarks/vs_nixl.py [--rounds 5] [--per-round 3] [--eh on|off|both]
                                    [--local-copy] [--json]
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transfer_bandwidth import daemon_pair, print_result, rounds_parser, ucx_env

from kvxfer.client.bench import random_runs
from kvxfer.layout.kinds import spec_from_mapping
from kvxfer.pages import PageRuns
from kvxfer.ucx_settings import LOOPBACK_ENV

REPO = Path(__file__).resolve().parent.parent
NIXL_PYTHON = REPO / ".venv-nixl" / "bin" / "python"
PAGES = {"llama8b": 128, "llama8b-ps1": 2048}
CHUNK_BYTES = 4 << 20


def page_bytes(preset: str) -> int:
    return int(spec_from_mapping({"preset": preset}).page_bytes)


def segments(src: PageRuns, dst: PageRuns, size: int) -> list[list[int]]:
    """[src_offset, dst_offset, nbytes] for each stretch contiguous on both sides."""
    out: list[list[int]] = []
    for s, d in zip(src.pages(), dst.pages(), strict=True):
        last = out[-1] if out else None
        if last is not None and last[0] + last[2] == s * size and last[1] + last[2] == d * size:
            last[2] += size
        else:
            out.append([s * size, d * size, size])
    return out


class _Agent:
    def __init__(self, role: str, size: int, memory: str, eh: str, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [str(NIXL_PYTHON), str(Path(__file__).with_name("nixl_peer.py")), role, "--bytes",
             str(size), "--memory", memory, "--eh", eh], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.hello = self.read()

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def read(self) -> dict[str, Any]:
        """The agent's next answer (NIXL's own log lines on stdout are skipped)."""
        assert self.process.stdout is not None
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"the NIXL agent exited with {self.process.wait(10)}")
            if line.startswith("{"):
                return dict(json.loads(line))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


class NixlPair:
    """An initiator and a target NIXL agent over pools of ``num_pages`` pages."""

    def __init__(self, preset: str, memory: str, eh: str, env: dict[str, str]) -> None:
        self.size = page_bytes(preset)
        self.num_pages = int(spec_from_mapping({"preset": preset}).num_pages)
        total = self.size * self.num_pages
        self.initiator = _Agent("initiator", total, memory, eh, env)
        self.target = _Agent("target", total, memory, eh, env)
        for a, b in ((self.initiator, self.target), (self.target, self.initiator)):
            a.send(op="peer", metadata=b.hello["metadata"], addr=b.hello["addr"])
            a.read()
        self.rng = random.Random(0)
        self.count = 0

    def move(self, pages: int, check: bool = False) -> float:
        """One WRITE of ``pages`` pages in random runs; seconds until both sides saw it end."""
        src = random_runs(self.rng, list(range(self.num_pages)), pages, (1, 16))
        dst = random_runs(self.rng, list(range(self.num_pages)), pages, (1, 16))
        parts = segments(src, dst, self.size)
        self.count += 1
        name = f"nixl-{self.count}"
        start = time.perf_counter()
        self.target.send(op="await", id=name)
        self.initiator.send(op="write", id=name, segments=parts)
        sent = self.initiator.read()
        self.target.read()
        elapsed = time.perf_counter() - start
        if sent.get("state") != "DONE":
            raise RuntimeError(f"NIXL transfer {name} ended {sent}")
        if check:
            self.initiator.send(op="digest", segments=[[s, n] for s, _, n in parts])
            self.target.send(op="digest", segments=[[d, n] for _, d, n in parts])
            if self.initiator.read()["digest"] != self.target.read()["digest"]:
                raise RuntimeError("NIXL moved other bytes than the source's")
        return elapsed

    def pause(self) -> None:
        """Stop both agents (SIGSTOP): an idle NIXL agent's progress thread keeps polling,
        and on 2 cores eight of them slowed every other case tenfold."""
        for agent in (self.initiator, self.target):
            agent.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        for agent in (self.initiator, self.target):
            agent.process.send_signal(signal.SIGCONT)

    @contextmanager
    def running(self) -> Iterator[NixlPair]:
        """The pair, resumed for the block and stopped again after it."""
        self.resume()
        try:
            yield self
        finally:
            self.pause()

    def close(self) -> None:
        self.resume()
        self.initiator.close()
        self.target.close()


@contextmanager
def nixl_pair(preset: str, memory: str, eh: str, env: dict[str, str]) -> Iterator[NixlPair]:
    pair = NixlPair(preset, memory, eh, env)
    try:
        pair.initiator.send(op="fill", seed=1)
        pair.initiator.read()
        pair.move(PAGES[preset], check=True)  # warm-up: connection, and the bytes are right
        pair.pause()
        yield pair
    finally:
        pair.close()


def back_to_back(move: Any, count: int, nbytes: int) -> float:
    """GB/s of ``count`` transfers one after another (transfers/s x bytes)."""
    start = time.perf_counter()
    for _ in range(count):
        move()
    return count * nbytes / (time.perf_counter() - start) / 1e9


def nixl_back_to_back(pair: NixlPair, pages: int, count: int, nbytes: int) -> float:
    """``back_to_back`` of a NIXL pair, resumed for it."""
    with pair.running():
        return back_to_back(lambda: pair.move(pages), count, nbytes)


def in_flight(pair: Any, streams: int, each: int, pages: int, nbytes: int) -> tuple[float, list[float]]:
    """Total GB/s of ``streams`` threads each moving ``each`` transfers, and every
    transfer's seconds."""
    times: list[float] = []
    lock = threading.Lock()
    failures: list[BaseException] = []

    def stream() -> None:
        try:
            for _ in range(each):
                _, seconds = pair.move(pages)
                with lock:
                    times.append(seconds)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=stream) for _ in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if failures:
        raise failures[0]
    return streams * each * nbytes / (time.perf_counter() - start) / 1e9, times


def round_trip_s(client: Any, count: int = 50) -> float:
    """Median seconds of a trivial worker call (DaemonInfo)."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        client.peer_address()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_mode(eh: str, rounds: int, per_round: int, shm_dir: str,
             local_copy: bool) -> dict[str, object]:
    env = ucx_env()
    # NIXL with its own UCX settings: kvxfer's (rendezvous put_zcopy from 32 KiB) made its
    # bundled UCX 4-5x slower here (0.8 instead of 3-4 GB/s).
    nixl_env = {**os.environ, **LOOPBACK_ENV}
    gbps: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {k: [] for k in (
        "kvxfer/nixl_best ps16", "kvxfer/nixl_best ps1", "kvxfer ps1/ps16",
        "nixl_best ps1/ps16", "4 in flight/back to back", "16 in flight/back to back")}
    one_page: list[float] = []
    nixl_one_page: list[float] = []
    round_trips: list[float] = []
    spreads: list[float] = []
    data_rate: list[float] = []
    with daemon_pair("llama8b", PAGES["llama8b"], env, CHUNK_BYTES, eh == "on", shm_dir,
                     local_copy=local_copy) as k16, \
            daemon_pair("llama8b-ps1", PAGES["llama8b-ps1"], env, CHUNK_BYTES, eh == "on",
                        shm_dir, local_copy=local_copy) as k1, \
            nixl_pair("llama8b", "shm", eh, nixl_env) as n16s, \
            nixl_pair("llama8b", "anon", eh, nixl_env) as n16a, \
            nixl_pair("llama8b-ps1", "shm", eh, nixl_env) as n1s, \
            nixl_pair("llama8b-ps1", "anon", eh, nixl_env) as n1a:
        nbytes = PAGES["llama8b"] * page_bytes("llama8b")
        cases = {
            "kvxfer_ps16": lambda: back_to_back(lambda: k16.move(PAGES["llama8b"]), per_round, nbytes),
            "kvxfer_ps1": lambda: back_to_back(lambda: k1.move(PAGES["llama8b-ps1"]), per_round, nbytes),
            "nixl_shm_ps16": lambda: nixl_back_to_back(n16s, PAGES["llama8b"], per_round, nbytes),
            "nixl_anon_ps16": lambda: nixl_back_to_back(n16a, PAGES["llama8b"], per_round, nbytes),
            "nixl_shm_ps1": lambda: nixl_back_to_back(n1s, PAGES["llama8b-ps1"], per_round, nbytes),
            "nixl_anon_ps1": lambda: nixl_back_to_back(n1a, PAGES["llama8b-ps1"], per_round, nbytes),
        }
        for r in range(rounds):
            names = list(cases)
            names = names[r % len(names):] + names[:r % len(names)]
            got = {name: cases[name]() for name in names}
            for name, value in got.items():
                gbps.setdefault(name, []).append(value)
            for ps in ("ps16", "ps1"):
                best = max(got[f"nixl_shm_{ps}"], got[f"nixl_anon_{ps}"])
                ratios[f"kvxfer/nixl_best {ps}"].append(got[f"kvxfer_{ps}"] / best)
            ratios["kvxfer ps1/ps16"].append(got["kvxfer_ps1"] / got["kvxfer_ps16"])
            ratios["nixl_best ps1/ps16"].append(max(got["nixl_shm_ps1"], got["nixl_anon_ps1"])
                                                / max(got["nixl_shm_ps16"], got["nixl_anon_ps16"]))
            single = back_to_back(lambda: k16.move(PAGES["llama8b"]), per_round, nbytes)
            for streams in (4, 16):
                total, times = in_flight(k16, streams, max(1, per_round * 4 // streams),
                                         PAGES["llama8b"], nbytes)
                ratios[f"{streams} in flight/back to back"].append(total / single)
                gbps.setdefault(f"kvxfer_{streams}_in_flight", []).append(total)
                if streams == 4:
                    spreads.append(max(times) / min(times))
            info, _ = k16.move(PAGES["llama8b"])
            data_rate.append(info.bytes / info.data_seconds)
            round_trips.append(round_trip_s(k16.sender))
            one_page.extend(k16.move(1)[1] for _ in range(20))
            with n16a.running():
                nixl_one_page.extend(n16a.move(1) for _ in range(20))
    rtt = statistics.median(round_trips)
    wire = page_bytes("llama8b") / statistics.median(data_rate)
    page_s = statistics.median(one_page)
    return {
        **{f"{name}_gbps": round(statistics.median(v), 3) for name, v in gbps.items()},
        **{name: round(statistics.median(v), 3) for name, v in ratios.items()},
        "4_in_flight_slowest/fastest_transfer": round(statistics.median(spreads), 2),
        "one_page_kvxfer_ms": round(page_s * 1e3, 3),
        "one_page_nixl_ms": round(statistics.median(nixl_one_page) * 1e3, 3),
        "grpc_round_trip_ms": round(rtt * 1e3, 3),
        "one_page_wire_ms": round(wire * 1e3, 3),
        "one_page_in_round_trips": round((page_s - wire) / rtt, 1),
    }


def main() -> int:
    parser = rounds_parser(__doc__, per_round=3, eh_default="both")
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--local-copy", action="store_true",
                        help="run kvxfer's daemons with --local-copy (same host: the receiver "
                             "copies from the sender's mapped pool, no UCX)")
    args = parser.parse_args()
    if not NIXL_PYTHON.exists():
        print("no .venv-nixl: run scripts/setup-nixl.sh", file=sys.stderr)
        return 2
    modes = ("on", "off") if args.eh == "both" else (args.eh,)
    result = {f"eh_{eh}": run_mode(eh, args.rounds, args.per_round, args.shm_dir, args.local_copy)
              for eh in modes}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for mode, figures in result.items():
            print(f"== UCX error handling {mode[3:]}")
            print_result(figures, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
