"""CompletionFeed against a real daemon: endings arrive without the caller asking, a
restarted daemon's new epoch is told even with no ending, errors are told, close is prompt."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvxfer.client.completion_feed import CompletionFeed
from kvxfer.client.library import KvxferClient
from kvxfer.errors import PeerUnavailableError
from kvxfer.pages import PageRuns
from kvxfer.status import Completions

POOL = "name=kv,kind=mha,layer_num=2,head_num=2,head_dim=8,v_head_dim=8,page_size=4,num_pages=16,dtype=float16"


def gathered(feed: CompletionFeed, until: Callable[[list[Completions]], bool],
             timeout_s: float = 5.0) -> list[Completions]:
    """What ``feed`` gathered, taken until ``until`` holds for it (or ``timeout_s``)."""
    got: list[Completions] = []
    deadline = time.monotonic() + timeout_s
    while not until(got) and time.monotonic() < deadline:
        feed.wait(0.1)
        got += feed.take()[0]
    return got


def ended_ids(batches: list[Completions]) -> list[str]:
    return [info.transfer_id for batch in batches for info in batch.transfers]


def test_endings_arrive_in_order_without_a_call_from_the_caller(spawn) -> None:
    daemon = spawn("decode", [POOL])
    with KvxferClient(daemon.worker_address) as client:
        start = client.completions()
        feed = CompletionFeed(client, start.cursor)
        try:
            for name in ("a", "b", "c"):
                client.expect(name, "kv", PageRuns.of([(0, 1)]), 30)
                client.abort(name, "the test ends it")
            got = gathered(feed, lambda got: len(ended_ids(got)) >= 3)
            assert ended_ids(got) == ["a", "b", "c"]
            assert all(not info.ok for batch in got for info in batch.transfers)
            assert {batch.epoch for batch in got} == {start.epoch}
        finally:
            feed.close()


def test_a_restarted_daemon_is_told_by_its_new_epoch_with_no_ending(spawn) -> None:
    daemon = spawn("decode", [POOL])
    with KvxferClient(daemon.worker_address) as client:
        before = client.completions()
        feed = CompletionFeed(client, before.cursor)
        try:
            daemon.restart()
            got = gathered(feed, lambda got: any(b.epoch not in ("", before.epoch) for b in got))
            assert any(b.epoch not in ("", before.epoch) for b in got), got
            assert ended_ids(got) == []
        finally:
            feed.close()


def test_a_daemon_that_is_gone_is_told_as_an_error_and_close_is_prompt(spawn) -> None:
    daemon = spawn("decode", [POOL])
    with KvxferClient(daemon.worker_address, timeout_s=2.0) as client:
        feed = CompletionFeed(client, client.completions().cursor)
        daemon.kill()
        error = None
        deadline = time.monotonic() + 5.0
        while error is None and time.monotonic() < deadline:
            time.sleep(0.05)
            error = feed.take()[1]
        assert isinstance(error, PeerUnavailableError)
        feed.close()
        assert not feed.running
