"""The daemon's memory of aborts that came before their transfer (``early_aborts``)."""

from __future__ import annotations

import time

from kvxfer.server.transfers.early_aborts import EarlyAborts


def test_an_abort_is_told_once_to_the_transfer_registered_after_it() -> None:
    aborts = EarlyAborts()
    aborts.remember("r1/tp0", "rank 1 failed")
    assert aborts.take("r2/tp0") is None
    assert aborts.take("r1/tp0") == "rank 1 failed"
    assert aborts.take("r1/tp0") is None  # a later registration of the id runs


def test_an_abort_is_forgotten_after_its_time() -> None:
    aborts = EarlyAborts(keep_s=0.05)
    aborts.remember("old", "")
    time.sleep(0.1)
    aborts.remember("new", "why")
    assert aborts.take("old") is None and aborts.take("new") == "why"


def test_at_most_capacity_aborts_are_remembered_the_oldest_forgotten_first() -> None:
    aborts = EarlyAborts(capacity=3)
    for i in range(5):
        aborts.remember(f"t{i}", str(i))
    assert [aborts.take(f"t{i}") for i in range(5)] == [None, None, "2", "3", "4"]
