"""Benchmark-only: NixlConnector's NIXL agent without its progress thread.

vLLM creates the agent with ``nixl_agent_config(num_threads=4)``, whose progress
thread busy-polls (``pthrDelay = 0``) and which vLLM pins, on CPU, to the last core
of each NUMA node: on a 2-core machine it starves the engines. A process started
with this directory on ``PYTHONPATH`` creates every agent with
``enable_prog_thread=False`` instead (vLLM's connector then progresses transfers
from its own calls), which ``benchmarks/vllm_vs_nixl.py`` measures beside the stock
setting.
"""

from typing import Any

import nixl._api as nixl_api

_stock_config = nixl_api.nixl_agent_config


def _without_progress_thread(*args: Any, **kwargs: Any) -> Any:
    kwargs["enable_prog_thread"] = False
    return _stock_config(*args, **kwargs)


nixl_api.nixl_agent_config = _without_progress_thread
