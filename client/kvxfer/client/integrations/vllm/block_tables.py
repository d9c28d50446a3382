"""vLLM's KV cache groups: which block table each layer's blocks follow.

With vLLM's hybrid KV cache manager (on for a connector that declares ``SupportsHMA``), a
model whose layers attend differently (full attention, a sliding window) has a KV cache
group per kind of layer, each with a block table of its own: block ``b`` of a
sliding-window layer holds other tokens than block ``b`` of a full-attention layer (their
tensors share memory), and a sliding-window group's blocks before its window are vLLM's
null block (``NULL_BLOCK``): KV nobody keeps, nor reads. So the connector copies each
layer through its own group's table. A page still holds every layer of its tokens; a
sliding-window layer's span of a page past its window holds the null block's bytes (never
read: the decode engine's table nulls at least those blocks), and nothing is ever loaded
into the null block.

An engine with a sliding-window group loads all but the prompt's last token (``windowed``):
vLLM recomputes the last token of a prompt loaded whole, and sizes the sliding-window table
for the token after it, so the oldest token of the last token's window would already sit in
a null block whenever the window's start falls on a block boundary (measured: logprobs 0.012
and 0.052 off the prefill engine's own at prompts of 143 and 175 tokens, window 48, blocks
32). Loading one token fewer, vLLM computes the last token itself, with its window whole.

Groups whose blocks are not attention KV of the engine's block size (Mamba state, MLA,
another block size) are refused at start, by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from kvxfer.errors import InvalidSpecError

#: The block id of vLLM's null block (its block pool's first): in a block table, a block
#: that holds nothing.
NULL_BLOCK: Final = 0
#: vLLM's KV cache specs (by class name, not subclasses: MLA and others keep other bytes)
#: whose blocks are attention KV in the engine's block layout.
PAGED_SPECS: Final = ("FullAttentionSpec", "SlidingWindowSpec")


def layer_tables(kv_cache_config: Any, layer_names: Sequence[str], block_size: int
                 ) -> tuple[int, ...]:
    """Per layer of ``layer_names``, the index of the block table (KV cache group) its blocks
    follow (all 0 with one group, or without ``kv_cache_config``); InvalidSpecError when
    groups are several and one is not full or sliding-window attention in blocks of
    ``block_size``, or a layer is in none."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1:
        return (0,) * len(layer_names)
    table_of: dict[str, int] = {}
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if type(spec).__name__ not in PAGED_SPECS or spec.block_size != block_size:
            raise InvalidSpecError(
                f"KV cache group {index} ({', '.join(group.layer_names[:3])}...) is "
                f"{type(spec).__name__} in blocks of {getattr(spec, 'block_size', '?')} tokens: "
                f"the kvxfer connector moves full and sliding-window attention KV in blocks of "
                f"{block_size} tokens only (not Mamba state, not MLA); a model whose layers "
                f"vLLM can keep in one group starts with --disable-hybrid-kv-cache-manager")
        table_of.update(dict.fromkeys(group.layer_names, index))
    missing = [name for name in layer_names if name not in table_of]
    if missing:
        raise InvalidSpecError(f"layers {missing} are in no KV cache group")
    return tuple(table_of[name] for name in layer_names)


def transfer_groups(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV cache groups vLLM lets take part in transfers (all the connector moves; none
    without ``kv_cache_config``)."""
    if kv_cache_config is None:
        return ()
    return tuple(kv_cache_config.transfer_group_ids)


def windowed(kv_cache_config: Any) -> bool:
    """Whether a KV cache group is a sliding window's (only with vLLM's hybrid manager on)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return any(type(g.kv_cache_spec).__name__ == "SlidingWindowSpec" for g in groups)
