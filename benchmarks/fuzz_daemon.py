"""Hostile requests against both of a daemon's services, while real transfers run beside them.

Two daemons on loopback with mutual TLS: prefill P and decode D. Hypothesis
draws requests for every method of D's worker API (``kvxfer.v1.Kvxfer``) and
its peer API (``kvxfer.v1.KvxferPeer``, as "fuzzer": a peer with a valid
certificate and a session of its own), from the generated message types: random
field values, negative and huge numbers, NaN and infinite deadlines, unknown
enum values, overlapping and out-of-range page runs, enormous ids and repeated
fields, wrong pools, the ids of the transfers running beside them, and its own
and made-up session ids. Addresses come only from a fixed loopback list, so no
request makes a daemon dial anywhere else.

Meanwhile P pushes verified transfers to D, one after another, each reserved for
P's identity ("alongside"). The run reports how many requests were sent, their
status codes, and what it checked:

- the daemon never crashed (its process lives and its health is SERVING);
- every refused request got a status that names what was wrong: a non-empty
  message and no UNKNOWN or INTERNAL (a call still waiting when its 0.1 s
  deadline passed is counted apart, as the caller's deadline);
- a checksum of every pool is unchanged, except D's pages the alongside
  transfers fill, and those equal their source pages after every transfer;
- every alongside transfer completed, verified;
- every transfer the fuzz got registered has a deadline from 0 to 3600 s (none
  can wait forever), and neither daemon logged an error or a traceback.

usage: python benchmarks/fuzz_daemon.py [--requests 10000] [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import xxhash
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from kvxfer.client import KvxferClient
from kvxfer.client.library import AttachedPool
from kvxfer.client.spawn import LocalDaemon, dev_certs
from kvxfer.pages import PageRuns
from kvxfer.server.limits import MAX_TIMEOUT_S
from kvxfer.v1 import kvxfer_pb2 as pb

POOL = "name=kv,preset=tiny,num_pages=64"
#: Both daemons dial loopback IPv4 and IPv6 only (the fuzz names 127.0.0.2 too).
DIAL_ALLOW = ["--dial-allow", "127.0.0.1/32", "--dial-allow", "::1/128"]
#: D's pages the alongside transfers fill, from P's pages 0-15 and 16-31 in turn.
ALONGSIDE_DST = PageRuns.of([(48, 16)])
ALONGSIDE_SRC = (PageRuns.of([(0, 16)]), PageRuns.of([(16, 16)]))
CALL_TIMEOUT_S = 0.1
#: A client-side deadline: the request was valid enough to wait for something.
CALLER_DEADLINE = "DEADLINE_EXCEEDED (the caller's deadline: the call was waiting)"
F = FieldDescriptor


class Vocabulary:
    """Values that make requests hostile rather than merely random: real ids, real and
    wrong pools, and the only addresses a request may name."""

    def __init__(self, prefill: LocalDaemon, decode: LocalDaemon, session_id: str) -> None:
        fuzz_ids = [f"f{i}" for i in range(8)]
        alongside_ids = [f"along-{i}" for i in range(40)]
        hostile_text = ["", "x" * 257, "y" * 5000, "\x00", "é" * 300]
        # 127.0.0.2 is outside both daemons' --dial-allow (DIAL_ALLOW): refused, never dialled.
        addresses = [prefill.peer_address, decode.peer_address, "127.0.0.1:1", "127.0.0.1:0",
                     "127.0.0.1:99999", "127.0.0.2:1", "[::1]:1", "nonsense", ""]
        self.worker = self._fields(fuzz_ids, hostile_text, addresses, session_id)
        self.peer = self._fields(fuzz_ids + alongside_ids, hostile_text, addresses, session_id)

    @staticmethod
    def _fields(ids: list[str], text: list[str], addresses: list[str],
                session_id: str) -> dict[str, st.SearchStrategy[str]]:
        def some(values: list[str]) -> st.SearchStrategy[str]:
            """A real value 6 times in 10 (so requests get past the first check and reach
            deeper states), else a hostile or random one."""
            hostile = st.one_of(st.sampled_from(text), st.text(max_size=12))
            return st.integers(0, 9).flatmap(lambda i: st.sampled_from(values) if i < 6 else hostile)

        address = st.sampled_from(addresses)
        return {
            "transfer_id": some(ids), "lease_id": some(["", "lease-0"]),
            "session_id": some([session_id, "s-made-up"]),
            "pool": some(["kv", "nope"]), "src_pool": some(["kv", "nope"]),
            "dst_pool": some(["kv", "nope"]), "name": some(["kv"]),
            "peer_identity": some(["prefill", "fuzzer"]),
            # Every field a daemon dials, or hands to a peer to dial: loopback only.
            "peer": address, "reply_to": address, "peer_address": address,
            "ucx_host": st.sampled_from(["127.0.0.1", "", "0.0.0.0"]),
        }


def scalar(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    """Values for one scalar field: its type's edges, small numbers (valid-looking), anything;
    a 70,000-character string only in a top-level field that is not repeated."""
    t = field.type
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.one_of(st.sampled_from([0.0, 0.05, 0.2, -1.0, math.nan, math.inf, -math.inf,
                                           1e308, 3600.0, 3601.0]), st.floats(width=32))
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        lo, hi = -(1 << 31), (1 << 31) - 1
    elif t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        lo, hi = -(1 << 63), (1 << 63) - 1
    elif t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        lo, hi = 0, (1 << 32) - 1
    elif t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        lo, hi = 0, (1 << 64) - 1
    elif t == F.TYPE_BOOL:
        return st.booleans()
    elif t == F.TYPE_STRING:
        huge = ["z" * 300] if field.is_repeated or depth else ["z" * 300, "w" * 70_000]
        return st.one_of(st.text(max_size=16), st.sampled_from(["", *huge]))
    elif t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    elif t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 1000))
    else:
        raise TypeError(f"no strategy for field {field.full_name} of type {t}")
    edges = sorted({lo, hi, 0, 1, max(lo, -1)})
    return st.one_of(st.sampled_from(edges), st.integers(0, 80), st.integers(lo, hi))


def message(desc: Descriptor, named: dict[str, st.SearchStrategy[str]],
            depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of type ``desc``: each field set or not, with ``named`` values for the
    fields of those names, nested messages to depth 3, and repeated fields of 0-4
    values or, at the top level, one value repeated many times (3000 numbers or 300
    messages), so a request stays well under a megabyte of memory."""
    cls = GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    values: dict[str, st.SearchStrategy[Any]] = {}
    always: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        if field.type == F.TYPE_MESSAGE:
            one = message(field.message_type, named, depth + 1)
            if field.message_type.name == "PageRun":  # runs in, across and past the 64 pages
                inside = st.builds(pb.PageRun, start=st.integers(0, 47), count=st.integers(1, 16))
                one = st.one_of(one, inside, st.builds(pb.PageRun, start=st.integers(0, 70),
                                                       count=st.integers(0, 70)))
                if field.is_repeated and depth == 0:  # often exactly one run inside the pool
                    always[field.name] = st.one_of(st.lists(inside, min_size=1, max_size=1),
                                                   _repeated(one, field))
                    continue
        elif field.type == F.TYPE_STRING and field.name in named and not field.is_repeated:
            always[field.name] = named[field.name]
            continue
        else:
            one = scalar(field, depth)
        values[field.name] = _repeated(one, field, depth) if field.is_repeated else one
    return st.fixed_dictionaries(always, optional=values).map(lambda kw: _build(cls, kw))


def _repeated(one: st.SearchStrategy[Any], field: FieldDescriptor,
              depth: int = 0) -> st.SearchStrategy[list[Any]]:
    """0-4 values, or at the top level one value many times (3000 numbers or 300 messages)."""
    many = st.lists(one, max_size=4)
    if depth:
        return many
    times = 300 if field.type == F.TYPE_MESSAGE else 3000
    return st.one_of(many, st.tuples(one, st.just(times)).map(lambda v: [v[0]] * v[1]))


def _build(cls: type[Message], values: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in values.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if field.is_repeated:
            target = getattr(msg, name)
            if field.type == F.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif field.type == F.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


Request = tuple[str, MethodDescriptor, Message]


def requests(vocabulary: Vocabulary) -> st.SearchStrategy[Request]:
    """(which channel, method, request) for every method of both services."""
    choices = []
    for service, named, channel in (("Kvxfer", vocabulary.worker, "worker"),
                                    ("KvxferPeer", vocabulary.peer, "peer")):
        for method in pb.DESCRIPTOR.services_by_name[service].methods:
            choices.append(st.tuples(st.just(channel), st.just(method),
                                     message(method.input_type, named)))
    return st.one_of(choices)


def call(channel: grpc.Channel, method: MethodDescriptor, request: Message) -> str:
    """Send ``request``; the status code it ended with (a violation is raised as such)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    response = GetMessageClass(method.output_type).FromString
    try:
        if method.server_streaming:  # Watch: one request, then wait for one reply
            stream = channel.stream_stream(path, request_serializer=_serialize,
                                           response_deserializer=response)
            replies = stream(iter([request]), timeout=CALL_TIMEOUT_S)
            try:
                next(replies)
            finally:
                replies.cancel()  # type: ignore[attr-defined]
        else:
            unary = channel.unary_unary(path, request_serializer=_serialize,
                                        response_deserializer=response)
            unary(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            return CALLER_DEADLINE
        if code == grpc.StatusCode.CANCELLED and method.server_streaming:
            return "OK"  # the first heartbeat came; we hung up
        if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) or not details.strip():
            raise Violation(f"{method.name}: {code.name} {details!r} for {_short(request)}") from None
        return code.name
    return "OK"


def beats(session_id: str, stop: threading.Event) -> Iterator[pb.WatchRequest]:
    """The fuzzer's side of its own session's Watch stream: the session, then beats."""
    yield pb.WatchRequest(session_id=session_id)
    while not stop.wait(0.5):
        yield pb.WatchRequest(unix_time=time.time())


def _serialize(msg: Message) -> bytes:
    return msg.SerializeToString()


class Violation(Exception):
    """The daemon answered in a way the fuzz run forbids."""


def _short(request: Message) -> str:
    text = str(request).replace("\n", " ")
    return text if len(text) < 300 else text[:300] + "..."


def checksums(pool: AttachedPool, skip: PageRuns | None) -> list[int]:
    """xxh3 of every page of ``pool`` outside ``skip``."""
    skipped = set(skip.pages()) if skip is not None else set()
    return [xxhash.xxh3_64_intdigest(pool.page_bytes_view(p).numpy().tobytes())
            for p in range(pool.descriptor.num_pages) if p not in skipped]


class Alongside(threading.Thread):
    """P pushes verified transfers reserved for its identity to D, one after another,
    and checks every one's bytes."""

    def __init__(self, p: KvxferClient, d: KvxferClient, src: AttachedPool, dst: AttachedPool,
                 decode_peer: str) -> None:
        super().__init__(name="alongside", daemon=True)
        self._p, self._d, self._src, self._dst, self._peer = p, d, src, dst, decode_peer
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            tid, src_runs = f"along-{n}", ALONGSIDE_SRC[n % 2]
            n += 1
            try:
                expected = self._d.expect(tid, "kv", ALONGSIDE_DST, timeout_s=30,
                                          peer_identity="prefill")
                self._p.push(tid, "kv", src_runs, peer=self._peer, timeout_s=30, verify=True,
                             capability=expected.capability)
                sent, got = self._p.wait(tid, timeout_s=35), self._d.wait(tid, timeout_s=35)
            except Exception as exc:  # noqa: BLE001 - reported, not raised, from this thread
                self.failures.append(f"{tid}: {type(exc).__name__}: {exc}")
                continue
            if not (sent.ok and got.ok and got.verified):
                self.failures.append(f"{tid}: sent {sent.state.name} {sent.error}, "
                                     f"received {got.state.name} {got.error}")
            for s, d in zip(src_runs.pages(), ALONGSIDE_DST.pages(), strict=True):
                if not self._src.page_bytes_view(s).equal(self._dst.page_bytes_view(d)):
                    self.failures.append(f"{tid}: page {s} -> {d} differs")
                    break
            self.done += 1
            time.sleep(0.05)


def fuzz(count: int, seed: int, workdir: Path) -> dict[str, Any]:
    """Run the whole fuzz; what it measured and checked."""
    with dev_certs("prefill", "decode", "fuzzer") as tls, \
            LocalDaemon("prefill", [POOL], workdir=str(workdir / "prefill"), tls=tls,
                        extra_args=DIAL_ALLOW) as pre, \
            LocalDaemon("decode", [POOL], workdir=str(workdir / "decode"), tls=tls,
                        extra_args=DIAL_ALLOW) as dec, \
            KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        for page in range(src.descriptor.num_pages):  # distinct bytes in every source page
            src.page_bytes_view(page).copy_(src.page_bytes_view(page).new_full(
                src.page_bytes_view(page).shape, page * 7 % 251))
        before = {"prefill": checksums(src, None), "decode": checksums(dst, ALONGSIDE_DST)}

        creds = grpc.ssl_channel_credentials((tls / "ca.pem").read_bytes(),
                                             (tls / "fuzzer.key").read_bytes(),
                                             (tls / "fuzzer.pem").read_bytes())
        peer = grpc.secure_channel(dec.peer_address, creds)
        worker = grpc.insecure_channel(dec.worker_address)
        channels = {"peer": peer, "worker": worker}
        session_id = "fuzzer-session"
        own = pb.HandshakeRequest(protocol_version=1, session_id=session_id, ucx_host="127.0.0.1", ucx_ports=[1],
                                  ucx_error_handling=True, peer_address="127.0.0.1:1")
        peer.unary_unary("/kvxfer.v1.KvxferPeer/Handshake",
                         request_serializer=_serialize,
                         response_deserializer=pb.HandshakeResponse.FromString)(own, timeout=5)
        stop_beating = threading.Event()
        watch = peer.stream_stream("/kvxfer.v1.KvxferPeer/Watch",
                                   request_serializer=_serialize,
                                   response_deserializer=pb.Heartbeat.FromString)(
            beats(session_id, stop_beating))

        codes: Counter[str] = Counter()
        by_method: Counter[str] = Counter()
        violations: list[str] = []
        alongside = Alongside(p, d, src, dst, dec.peer_address)

        @fixed_seed(seed)
        @settings(max_examples=count, phases=[Phase.generate], database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests(Vocabulary(pre, dec, session_id)))
        def one(request: Request) -> None:
            channel, method, msg = request
            if violations:
                return
            try:
                codes[call(channels[channel], method, msg)] += 1
            except Violation as exc:
                violations.append(str(exc))
            by_method[f"{method.containing_service.name}.{method.name}"] += 1
            if sum(codes.values()) % 500 == 0 and dec.process is not None \
                    and dec.process.poll() is not None:
                violations.append(f"the decode daemon exited with {dec.process.returncode}")

        started = time.monotonic()
        alongside.start()
        one()
        seconds = time.monotonic() - started
        alongside.stop.set()
        alongside.join(60)
        stop_beating.set()
        watch.cancel()
        peer.close()
        worker.close()

        for t in d.transfers():
            if not 0 < t.timeout_s <= MAX_TIMEOUT_S:
                violations.append(f"transfer {t.transfer_id[:40]!r} has a deadline of "
                                  f"{t.timeout_s} s")
        for daemon in (pre, dec):
            for line in daemon.log().splitlines():
                if "Traceback" in line or " ERROR " in line:
                    violations.append(f"{daemon.name} logged: {line[:300]}")
        alive = all(x.process is not None and x.process.poll() is None for x in (pre, dec))
        serving = alive and d.health() == "SERVING" and p.health() == "SERVING"
        after = {"prefill": checksums(src, None), "decode": checksums(dst, ALONGSIDE_DST)}
        return {
            "requests": sum(codes.values()), "seed": seed, "seconds": round(seconds, 1),
            "requests_per_s": round(sum(codes.values()) / seconds, 1),
            "codes": dict(codes.most_common()), "methods": dict(sorted(by_method.items())),
            "violations": violations, "daemons_alive": alive, "serving": serving,
            "pools_unchanged": before == after,
            "alongside_done": alongside.done, "alongside_failures": alongside.failures,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000, help="requests to send")
    parser.add_argument("--seed", type=int, default=1, help="hypothesis seed (fixed in CI)")
    parser.add_argument("--workdir", default="", help="where the daemons' logs go (default: a "
                                                      "temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvxfer-fuzz-") as tmp:
        result = fuzz(args.requests, args.seed, Path(args.workdir or tmp))
    ok = (not result["violations"] and result["serving"] and result["pools_unchanged"]
          and result["alongside_done"] > 0 and not result["alongside_failures"])
    if args.json:
        print(json.dumps({**result, "ok": ok}))
    else:
        print(f"{result['requests']} requests in {result['seconds']} s "
              f"({result['requests_per_s']}/s), seed {result['seed']}")
        for code, n in result["codes"].items():
            print(f"  {n:6d}  {code}")
        print(f"daemons alive and serving: {result['serving']}; pools unchanged: "
              f"{result['pools_unchanged']}; alongside transfers: {result['alongside_done']} "
              f"done, {len(result['alongside_failures'])} failed")
        for line in result["violations"] + result["alongside_failures"]:
            print(f"  ! {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
