"""The engine-neutral core of an engine's KV connector: what is not specific to vLLM.

An engine adapter (``kvxfer.client.integrations.vllm``) turns the engine's calls into
these, and keeps only what is the engine's own (its requests, blocks and metrics):

- ``page_segments``: where each layer of each state sits in a page, for every page-major
  kind (MHA, MLA, Mamba), from the pool's own view specs;
- ``head_split``: which KV heads each tensor-parallel rank holds, and which prefill ranks'
  pages a decode rank of another TP size pulls;
- ``block_tiling``: copies between engine blocks and pages of fewer slots or heads;
- ``paged_blocks``: a daemon pool mapped as rows of page bytes, the copies between an
  engine's block tensors and spans of pages, and re-mapping after a daemon restart;
- ``loads``: pulls in flight into leased pages, their endings (a feed, off the engine's
  step), expiry, and the pulls a daemon restart ended;
- ``pull_starts``: the calls that start those pulls, made from a thread, off the step;
- ``endings``: releases and aborts that never raise into the engine, off its step;
- ``reconnecting``: one bounded wait for a daemon that is restarting.

Nothing here imports an engine (``tests/test_layering.py``).
"""
