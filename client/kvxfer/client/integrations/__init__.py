"""kvxfer inside inference engines: ``vllm`` (a KV connector, a disaggregating proxy, and a
local deployment). Operators name them by their stable paths in ``kvxfer.integrations``."""
