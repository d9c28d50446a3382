"""Batched completion: every transfer that ended since a cursor, in one call per engine step."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from fake_transport import FakeNetwork
from inprocess import run, side

from kvxfer.errors import InvalidArgumentError, TransferAbortedError
from kvxfer.pages import PageRuns

RUNS = PageRuns.of([(0, 1)])


def test_completions_return_what_ended_since_the_cursor_in_order(tmp_path: Path) -> None:
    async def body() -> None:
        network = FakeNetwork()
        async with side(tmp_path, "prefill", network) as sender, \
                side(tmp_path, "decode", network) as receiver:
            verbs = receiver.transfers
            ended, cursor, missed = await verbs.completions(0, 0)
            assert (ended, cursor, missed) == ([], 0, False)
            for i in range(3):
                expected = verbs.expect(f"r{i}", "kv", PageRuns.of([(i, 1)]), 10)
                sender.transfers.push(f"r{i}", "kv", RUNS, receiver.peer_address, 10, False,
                                      capability=expected.capability)
                await receiver.final(f"r{i}")
            verbs.expect("cancelled", "kv", PageRuns.of([(9, 1)]), 10)
            verbs.abort("cancelled", "the client went away")
            ended, cursor, missed = await verbs.completions(0, 0)
            assert [i.transfer_id for i in ended] == ["r0", "r1", "r2", "cancelled"]
            assert [i.ok for i in ended] == [True, True, True, False]
            assert isinstance(ended[-1].failure, TransferAbortedError) and not missed
            again, same, _ = await verbs.completions(cursor, 0)
            assert again == [] and same == cursor
            _, _, missed = await verbs.completions(cursor + 5, 0)
            assert missed  # a cursor from another daemon's lifetime
    run(body)


def test_a_completions_call_waits_for_the_next_ending_and_no_longer(tmp_path: Path) -> None:
    async def body() -> None:
        async with side(tmp_path, "decode", FakeNetwork()) as receiver:
            verbs = receiver.transfers
            start = time.monotonic()
            ended, cursor, _ = await verbs.completions(0, 0.3)
            assert ended == [] and 0.25 < time.monotonic() - start < 2
            verbs.expect("soon", "kv", RUNS, 10)
            asyncio.get_running_loop().call_later(0.1, verbs.abort, "soon", "done with it")
            start = time.monotonic()
            ended, cursor, _ = await verbs.completions(cursor, 5)
            assert [i.transfer_id for i in ended] == ["soon"] and time.monotonic() - start < 2
            with pytest.raises(InvalidArgumentError, match="timeout_s=61"):
                await verbs.completions(cursor, 61)
    run(body)


def test_a_cursor_older_than_what_is_kept_says_so(tmp_path: Path) -> None:
    async def body() -> None:
        async with side(tmp_path, "decode", FakeNetwork(), retain_transfers=2) as receiver:
            verbs = receiver.transfers
            for i in range(5):
                verbs.expect(f"t{i}", "kv", RUNS, 10)
                verbs.abort(f"t{i}", "")
            ended, cursor, missed = await verbs.completions(1, 0)
            assert [i.transfer_id for i in ended] == ["t3", "t4"] and cursor == 5 and missed
    run(body)


def test_only_the_oldest_finished_transfers_are_forgotten(tmp_path: Path) -> None:
    async def body() -> None:
        async with side(tmp_path, "decode", FakeNetwork(), retain_transfers=2) as receiver:
            verbs, registry = receiver.transfers, receiver.transfers.registry
            for i, name in enumerate(["a", "b", "c"]):
                verbs.expect(name, "kv", PageRuns.of([(i, 1)]), 10)
                verbs.abort(name, "")
            assert [t.id for t in registry.all()] == ["b", "c"]
            verbs.expect("running", "kv", PageRuns.of([(10, 1)]), 10)
            assert [t.id for t in registry.all()] == ["c", "running"]
            for i, name in enumerate(["running2", "running3"]):
                verbs.expect(name, "kv", PageRuns.of([(11 + i, 1)]), 10)
            # Unfinished transfers are never forgotten, even beyond retain_transfers.
            assert [t.id for t in registry.all()] == ["running", "running2", "running3"]
            assert sorted(t.id for t in registry.unfinished()) == ["running", "running2", "running3"]
    run(body)
