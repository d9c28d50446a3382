"""The block-size phase of ``vllm_scenario.py``: engines of other block sizes exchange KV.

An engine of 64-token blocks (``wide``, ``kv_both``) joins the pair of 32-token blocks; all
three daemons keep pages of 32 tokens, head-major (``mha_head_major``), so a 64-token block
is two pages. The wide engine loads what the pair's prefill engine computed (32 -> 64), and
the pair's decode engine loads what the wide engine computed (64 -> 32). Each answer is
recorded for test_vllm.py to compare with the plain engine's (block 32), with the tokens
each engine took from a transfer and the pages each transfer moved. ``B3`` asked plainly
of the wide engine shows what its block size alone does to an answer.
"""

from __future__ import annotations

from typing import Any

from vllm_client import counters
from vllm_trust_phase import Phase

from kvxfer.client import KvxferClient
from kvxfer.client.integrations.vllm.deploy import Disaggregation

#: The wide engine's block size, and the page size of every daemon of the phase.
WIDE_BLOCK, PAGE = 64, 32
#: vLLM's count of prompt tokens by where they came from.
SOURCE = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="%s",source="%s"}'


def run(d: Disaggregation, model: str) -> dict[str, Any]:
    """Every case, in order; what each answered and moved."""
    daemon, wide = d.add_engine("wide", block_size=WIDE_BLOCK, page_size=PAGE)
    phase = Phase(d, model)

    def taken(engine: Any) -> dict[str, float]:
        return {name: engine.metric(SOURCE % (model, name))
                for name in ("external_kv_transfer", "local_compute", "local_cache_hit")}

    out: dict[str, Any] = {"wide_before": taken(wide)}
    for name in ("B0", "B1"):  # 32 -> 64
        params = phase.prefilled(name, f"to-wide-{name}")
        out[f"to_wide_{name}"] = phase.direct(name, params, f"to-wide-{name}", engine=wide)
    out["wide_after"] = taken(wide)
    out["decode_before"] = counters(d, model)
    params = phase.prefilled("B2", "from-wide-B2", engine=wide)  # 64 -> 32
    out["from_wide_B2"] = phase.direct("B2", params, "from-wide-B2")
    out["decode_after"] = counters(d, model)
    out["wide_plain_B3"] = phase.direct("B3", None, "wide-plain-B3", engine=wide)
    with KvxferClient(daemon.worker_address) as client:
        out["wide_transfers"] = {i.transfer_id: [i.role.name, i.state.name, i.pages]
                                 for i in client.transfers()}
    wide.stop()  # the phases after it need the cores
    return out
