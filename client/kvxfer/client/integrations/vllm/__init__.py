"""kvxfer as vLLM's KV transport: a connector, a disaggregating proxy, a local deployment.

- ``connector``: ``KvxferConnector``, what vLLM loads (imports vLLM; operators name it as
  ``kvxfer.integrations.vllm``);
- ``scheduler``, ``worker``: its two halves (no vLLM import: unit-tested without vLLM);
- ``protocol``: ``kv_transfer_params`` between engines, and the plan from scheduler to worker;
- ``layout``: the block layout both engines must share, and the daemon pool that holds it;
- ``settings``: the connector's ``kv_connector_extra_config``;
- ``endings``: lease releases and transfer aborts that never raise into vLLM;
- ``stats``: what the connector measures: each interval's figures, and the per-transfer
  records of ``stats_file`` (a debugging aid);
- ``metrics``: those figures in vLLM's own metrics (its log line and ``/metrics``; imports vLLM);
- ``proxy``: an OpenAI-compatible proxy that sends prefill, then decode;
- ``deploy``: ``kvxfer vllm``, daemons, engines and the proxy on one machine;
- ``tiny_model``: a small random Llama to test with, when no model can be downloaded.
"""
