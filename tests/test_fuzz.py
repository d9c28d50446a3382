"""10,000 hostile requests to both services of a daemon, with a fixed seed, while real
transfers run beside them (``benchmarks/fuzz_daemon.py`` runs more, with any seed)."""

from __future__ import annotations

import pytest
from test_benchmarks import run_benchmark

from kvxfer.v1 import kvxfer_pb2 as pb

pytestmark = pytest.mark.slow  # about 1 min; see docs/development.md


def test_ten_thousand_hostile_requests_change_nothing_and_break_nothing() -> None:
    got = run_benchmark("fuzz_daemon.py", "--requests", "10000", "--seed", "1", "--json",
                        timeout=600)
    assert got["requests"] == 10_000
    assert got["violations"] == [], got["violations"]
    assert got["daemons_alive"] and got["serving"]
    assert got["pools_unchanged"]
    assert got["alongside_done"] >= 10 and got["alongside_failures"] == [], got["alongside_failures"]
    refused = {code for code in got["codes"] if code != "OK"}
    # No PERMISSION_DENIED: every transfer holds a capability the fuzzer never learns, so a
    # claim or abort of one reserved for another peer is NOT_FOUND before any identity check.
    assert {"INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE", "RESOURCE_EXHAUSTED",
            "ALREADY_EXISTS"} <= refused
    every = {f"{service.name}.{method.name}" for service in pb.DESCRIPTOR.services_by_name.values()
             for method in service.methods}
    assert set(got["methods"]) == every  # every method of both services was called
    assert got["ok"]
