"""A decode request queued past its offer's deadline still loads its KV (its offers are kept
alive from the moment the engine sees it until its load is planned), and a request that
ends in the queue frees the prefill daemon's pages at once. The connector's halves without
vLLM (``test_vllm_connector``'s stand-ins), real daemons."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_vllm_connector import (
    LAYOUT,
    MODEL,
    Engines,
    Request,
    kv_caches,
    settings,
    wait_finished,
)

from kvxfer.client import KvxferClient
from kvxfer.client.integrations.vllm.offer_keeper import OfferKeeper
from kvxfer.client.integrations.vllm.scheduler import SchedulerSide
from kvxfer.client.integrations.vllm.settings import load_settings
from kvxfer.client.integrations.vllm.worker import WorkerSide
from kvxfer.errors import InvalidSpecError
from kvxfer.status import TransferState

#: The prefill engine's transfer deadline here: what its offers wait without keeping.
OFFER_S = 2.0
KEEP_EVERY_S = 0.5


def engines(pre: Any, dec: Any, client: KvxferClient, keeper: OfferKeeper | None) -> Engines:
    """Both engines' halves, the prefill one's offers waiting ``OFFER_S``."""
    short = {"timeout_s": OFFER_S, "keep_offers_every_s": KEEP_EVERY_S}
    parts = Engines(
        pre, dec,
        SchedulerSide(settings(pre.worker_address, **short), LAYOUT, MODEL, "P", producer=True,
                      consumer=False, client=client),
        SchedulerSide(settings(dec.worker_address, **short), LAYOUT, MODEL, "D", producer=False,
                      consumer=True, client=None, keeper=keeper),
        WorkerSide(settings(pre.worker_address, **short), LAYOUT, "P"),
        WorkerSide(settings(dec.worker_address, **short), LAYOUT, "D"),
        kv_caches(3), kv_caches(4))
    parts.work_p.register_kv_caches(parts.kv_p)
    parts.work_d.register_kv_caches(parts.kv_d)
    return parts


@pytest.fixture
def pair(spawn):
    from test_vllm_connector import POOL

    return spawn("prefill", [POOL]), spawn("decode", [POOL])


@pytest.fixture
def kept(pair) -> Iterator[tuple[KvxferClient, Engines, OfferKeeper]]:
    """A client of the prefill daemon, both engines' halves and the decode side's keeper;
    all closed at teardown, whatever the test did."""
    pre, dec = pair
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        keeper = OfferKeeper(d, every_s=KEEP_EVERY_S, keep_s=OFFER_S)
        h = engines(pre, dec, p, keeper)
        try:
            yield p, h, keeper
        finally:
            keeper.close()
            h.work_p.shutdown()
            h.work_d.shutdown()


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "negative-control"])
def test_a_request_queued_past_its_offers_deadline_still_loads_it(pair, kept: bool) -> None:
    """Queued for twice the offer's deadline: with the keeper its KV loads, byte for byte;
    without (the negative control), the offer has ended and the load fails."""
    pre, dec = pair
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        keeper = OfferKeeper(d, every_s=KEEP_EVERY_S, keep_s=OFFER_S) if kept else None
        h = engines(pre, dec, p, keeper)
        params = h.prefill("q-p", [2, 5, 6])
        dreq = Request("q-d", 96, params)
        h.sched_d.on_new_request(dreq)
        time.sleep(2 * OFFER_S)  # waiting in the decode engine's queue
        assert h.sched_d.get_num_new_matched_tokens(dreq, 0) == (96, True)
        h.sched_d.update_state_after_alloc(dreq, ([7, 8, 9],), 96)
        if keeper is not None:
            assert keeper.wanted() == 0  # the pull takes the offer from here
        h.work_d.bind(h.sched_d.build_plan({}, lambda _: []))
        h.work_d.start_load_kv()
        wait_finished(h.work_d, "q-d", timeout_s=30)
        failed = h.work_d.take_failed()
        equal = all(torch.equal(h.kv_d[k][[7, 8, 9]], h.kv_p[k][[2, 5, 6]]) for k in h.kv_p)
        if kept:
            assert failed == set() and equal
            assert keeper is not None and keeper.kept_offers >= 3, keeper.kept_offers
            keeper.close()
        else:
            assert failed == {"q-d"} and not equal
        h.work_p.shutdown()
        h.work_d.shutdown()


def test_a_request_that_ends_in_the_queue_frees_the_prefill_pages_at_once(kept) -> None:
    p, h, keeper = kept
    params = h.prefill("gone-p", [1, 2])
    assert p.leased_pages() == {"kv": 2}
    dreq = Request("gone-d", 64, params, status=SimpleNamespace(name="FINISHED_ABORTED"))
    h.sched_d.on_new_request(dreq)
    assert keeper.wanted() == 1
    h.sched_d.request_finished(dreq)  # its client went away while it was queued
    deadline = time.monotonic() + OFFER_S / 2  # well before the offer's own deadline
    while p.leased_pages() != {"kv": 0}:
        assert time.monotonic() < deadline, p.transfers()
        time.sleep(0.05)
    [offer] = [i for i in p.transfers() if i.transfer_id == "P/gone-p"]
    assert offer.state == TransferState.ABORTED, offer
    assert "decode request gone-d: it ended before its KV was loaded" in offer.error
    assert keeper.dropped_offers == 1 and keeper.wanted() == 0


def test_params_the_decode_engine_refuses_are_not_kept(kept) -> None:
    _, h, keeper = kept
    params = h.prefill("other-p", [1])
    params["kvxfer"]["model"]["fingerprint"] = "f" * 32  # another model's KV
    h.sched_d.on_new_request(Request("other-d", 32, params))
    assert keeper.wanted() == 0


def test_a_keep_interval_not_below_the_deadline_is_refused_and_the_default_follows_it() -> None:
    with pytest.raises(InvalidSpecError, match=r"extra_config: Value error, keep_offers_every_s"
                                               r"=30.0 must be below timeout_s=30.0"):
        load_settings({"timeout_s": 30, "keep_offers_every_s": 30})
    assert load_settings({"timeout_s": 3}).keep_every_s == 1.0
    assert load_settings({"keep_offers_every_s": 0}).keep_every_s == 0
