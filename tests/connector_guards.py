"""Every entry point vLLM calls on ``KvxferConnector``, with the half behind it raising:
what each answers, and whether the exception reached the caller. Run by
``test_connector_guards.py`` with ``.venv-vllm/bin/python`` (the connector imports vLLM).

    .venv-vllm/bin/python tests/connector_guards.py [--unguarded]

The halves are the real ``SchedulerSide`` and ``WorkerSide`` (no daemon is needed before a
call reaches one); the one method each entry point calls is replaced by one that raises.
With ``--unguarded`` (the negative control) ``_guarded`` calls straight through. Prints one
JSON object: entry point -> {"raised": bool, "answer": repr, "failures": count}.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from types import SimpleNamespace
from typing import Any

from kvxfer.client.integrations.vllm import connector as connector_module
from kvxfer.client.integrations.vllm.connector import KvxferConnector, KvxferMetadata
from kvxfer.client.integrations.vllm.layout import BlockLayout
from kvxfer.client.integrations.vllm.model_identity import ModelIdentity
from kvxfer.client.integrations.vllm.protocol import StepPlan
from kvxfer.client.integrations.vllm.scheduler import SchedulerSide
from kvxfer.client.integrations.vllm.settings import load_settings
from kvxfer.client.integrations.vllm.stats import IntervalStats
from kvxfer.client.integrations.vllm.worker import WorkerSide

LAYOUT = BlockLayout(dtype="bfloat16", block_size=32, num_layers=2, num_kv_heads=2,
                     head_size=64, tp_size=1, block_format="mha_head_major")
MODEL = ModelIdentity(fingerprint="0123456789abcdef" * 2, name="tiny", vllm_version="0.32.0")
SETTINGS = load_settings({"daemon": "unix:///nonexistent/kvxfer.sock", "pool": "kv"})


def broken(name: str) -> Any:
    def raises(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} broke on purpose")
    return raises


def connector(unguarded: bool) -> KvxferConnector:
    """A connector with both halves (vLLM gives each role one; both here to call every entry)."""
    shell: Any = object.__new__(KvxferConnector)
    shell._scheduler = SchedulerSide(SETTINGS, LAYOUT, MODEL, "D", producer=False, consumer=True, client=None)
    shell._worker = WorkerSide(SETTINGS, LAYOUT, "D")
    shell._manager = SimpleNamespace(get_block_ids=lambda req_id: ([1, 2],))
    shell.failures = Counter()
    shell._interval = IntervalStats()
    shell._kv_cache_config = None
    if unguarded:
        shell._guarded = lambda what, call, fallback: call()
    return shell


def main() -> None:
    unguarded = "--unguarded" in sys.argv
    request = SimpleNamespace(request_id="r", num_prompt_tokens=64, prompt_token_ids=list(range(64)),
                              kv_transfer_params={"do_remote_prefill": True})
    output = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                             scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2],))
    calls: dict[str, tuple[str, str, Any]] = {
        # entry point: (half, the method it calls, how vLLM calls the entry point)
        "get_num_new_matched_tokens": ("scheduler", "get_num_new_matched_tokens",
                                       lambda c: c.get_num_new_matched_tokens(request, 0)),
        "update_state_after_alloc": ("scheduler", "update_state_after_alloc",
                                     lambda c: c.update_state_after_alloc(request, blocks, 64)),
        "build_connector_meta": ("scheduler", "build_plan", lambda c: c.build_connector_meta(output)),
        "update_connector_output": ("scheduler", "finished_loading",
                                    lambda c: c.update_connector_output(SimpleNamespace(finished_recving={"r"}))),
        "request_finished": ("scheduler", "request_finished", lambda c: c.request_finished(request, [1, 2])),
        "request_finished_all_groups": ("scheduler", "request_finished",
                                        lambda c: c.request_finished_all_groups(request, ([1, 2],))),
        "get_loaded_kv_cache_group_ids": ("module", "transfer_groups",
                                          lambda c: c.get_loaded_kv_cache_group_ids(request)),
        "bind_connector_metadata": ("worker", "bind",
                                    lambda c: c.bind_connector_metadata(KvxferMetadata(StepPlan()))),
        "start_load_kv": ("worker", "start_load_kv", lambda c: c.start_load_kv(None)),
        "save_kv_layer": ("worker", "save_kv_layer", lambda c: c.save_kv_layer("layers.0.attn", None, None)),
        "wait_for_save": ("worker", "wait_for_save", lambda c: c.wait_for_save()),
        "get_transfer_results": ("worker", "get_finished", lambda c: c.get_transfer_results(set())),
        "get_kv_connector_stats": ("interval", "take", lambda c: c.get_kv_connector_stats()),
    }
    report = {}
    for entry, (half, method, call) in calls.items():
        shell = connector(unguarded)
        owner = {"scheduler": shell._scheduler, "worker": shell._worker,
                 "interval": shell._interval, "module": connector_module}
        kept = getattr(owner[half], method)
        setattr(owner[half], method, broken(method))
        try:
            answer, raised = call(shell), False
        except RuntimeError:
            answer, raised = None, True
        finally:
            if half == "module":
                setattr(owner[half], method, kept)
        report[entry] = {"raised": raised, "answer": repr(answer), "failures": shell.failures[entry]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
