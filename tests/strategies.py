"""Hypothesis strategies for pool specs and page runs."""

from __future__ import annotations

from hypothesis import strategies as st

from kvxfer.layout import MambaSpec, MhaSpec, MlaSpec

DTYPES = st.sampled_from(["bfloat16", "float16", "float32", "int8", "float8_e4m3fn"])
small = st.integers(min_value=1, max_value=6)


@st.composite
def mha_specs(draw: st.DrawFn) -> MhaSpec:
    return MhaSpec(
        layer_num=draw(small),
        head_num=draw(small),
        head_dim=draw(st.integers(1, 16)),
        v_head_dim=draw(st.integers(1, 16)),
        dtype=draw(DTYPES),
        page_size=draw(st.integers(1, 8)),
        num_pages=draw(st.integers(1, 12)),
    )


@st.composite
def mla_specs(draw: st.DrawFn) -> MlaSpec:
    return MlaSpec(
        layer_num=draw(small),
        kv_lora_rank=draw(st.integers(1, 32)),
        qk_rope_head_dim=draw(st.integers(0, 8)),
        dtype=draw(DTYPES),
        page_size=draw(st.integers(1, 8)),
        num_pages=draw(st.integers(1, 12)),
    )


@st.composite
def mamba_specs(draw: st.DrawFn) -> MambaSpec:
    conv_dtype = draw(st.sampled_from(["bfloat16", "float32"]))
    temporal_dtype = draw(st.sampled_from(["bfloat16", "float32"]))
    shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)
    conv = tuple(draw(st.lists(shapes, min_size=1, max_size=2)))
    # Keep every region a multiple of 4 bytes so any dtype mix is aligned, as real models are.
    conv = tuple((*s[:-1], s[-1] * 2) for s in conv)
    temporal = draw(shapes)
    temporal = (*temporal[:-1], temporal[-1] * 2)
    return MambaSpec(
        layer_num=draw(small),
        conv_state_shapes=conv,
        conv_dtype=conv_dtype,
        temporal_state_shape=temporal,
        temporal_dtype=temporal_dtype,
        num_slots=draw(st.integers(1, 10)),
    )


any_spec = st.one_of(mha_specs(), mla_specs(), mamba_specs())


@st.composite
def page_runs_pairs(draw: st.DrawFn, num_pages: int, max_runs: int = 6) -> list[tuple[int, int]]:
    """Ordered (start, count) pairs within a pool of ``num_pages`` pages."""
    n = draw(st.integers(1, max_runs))
    pairs = []
    for _ in range(n):
        start = draw(st.integers(0, num_pages - 1))
        count = draw(st.integers(1, num_pages - start))
        pairs.append((start, count))
    return pairs


@st.composite
def disjoint_runs_pairs(draw: st.DrawFn, num_pages: int, total: int) -> list[tuple[int, int]]:
    """A shuffled, disjoint set of runs covering exactly ``total`` pages of ``num_pages``."""
    pages = draw(st.permutations(range(num_pages)))[:total]
    chosen = sorted(pages)
    runs: list[list[int]] = []
    for p in chosen:
        if runs and runs[-1][0] + runs[-1][1] == p and draw(st.booleans()):
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    order = draw(st.permutations(range(len(runs))))
    return [(runs[i][0], runs[i][1]) for i in order]
