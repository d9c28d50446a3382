"""The model example's decode worker, overwriting the first page of one request's KV once
it arrived: the tests' fault double for ``test_model_e2e`` (the example has no such hook).

usage: python tests/corrupting_decode_worker.py REQUEST-ID decode-worker ARGS...
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvxfer.client.examples import disagg


def corrupting(request_id: str) -> None:
    """Make the decode worker's cache of request ``request_id`` start with random KV: the
    worker builds a request's views after its transfers completed, in request order, so the
    views built for the request's position are the ones to overwrite."""
    views = disagg._views
    built = [0]

    def overwritten(kv: Any, ssm: Any, table: list[int], slot: int, cfg: Any) -> Any:
        cache = views(kv, ssm, table, slot, cfg)
        if f"r{built[0]}" == request_id:
            gen = torch.Generator().manual_seed(99)
            for view in (*cache.kv.k, *cache.kv.latent):
                view[table[0]] = torch.randn(view[table[0]].shape, generator=gen).to(view.dtype)
        built[0] += 1
        return cache

    disagg._views = overwritten  # type: ignore[assignment]


if __name__ == "__main__":
    corrupting(sys.argv[1])
    sys.exit(disagg.main(sys.argv[2:]))
