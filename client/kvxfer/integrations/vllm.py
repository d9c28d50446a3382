"""vLLM's KV connector: ``--kv-transfer-config '{"kv_connector": "KvxferConnector",
"kv_connector_module_path": "kvxfer.integrations.vllm", ...}'`` (docs/how-to/vllm.md)."""

from kvxfer.client.integrations.vllm.connector import KvxferConnector

__all__ = ["KvxferConnector"]
