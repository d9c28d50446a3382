"""Golden page-major views, recorded from SGLang's reference layout.

``tests/golden/page_major_views.json`` holds, for a few representative pools,
every view the reference (``shared/reference/page_major.py``) builds: dtype,
shape, element strides and storage offset. ``test_layout_golden.py`` checks
kvxfer's views against it on every run, so byte compatibility is tested even
where the reference file is not checked out (CI clones only this repository);
where it is, the same test fails if the recorded file no longer matches it.

Regenerate after adding a case:  python tests/golden_layouts.py [REFERENCE]
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

GOLDEN = Path(__file__).with_name("golden") / "page_major_views.json"

#: Pools worth pinning down: llama-like MHA, asymmetric K/V, page_size 1, fp8, MLA
#: (one latent head, no V), and Mamba with two conv states; anchors are not all 0.
CASES: list[dict[str, Any]] = [
    {"kind": "mha", "layer_num": 4, "head_num": 8, "head_dim": 128, "v_head_dim": 128,
     "dtype": "bfloat16", "page_size": 16, "num_pages": 3, "anchor_bytes": 0},
    {"kind": "mha", "layer_num": 3, "head_num": 2, "head_dim": 64, "v_head_dim": 32,
     "dtype": "float16", "page_size": 1, "num_pages": 5, "anchor_bytes": 4096},
    {"kind": "mha", "layer_num": 2, "head_num": 3, "head_dim": 16, "v_head_dim": 16,
     "dtype": "float8_e4m3fn", "page_size": 4, "num_pages": 2, "anchor_bytes": 7},
    {"kind": "mla", "layer_num": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
     "dtype": "bfloat16", "page_size": 16, "num_pages": 2, "anchor_bytes": 2048},
    {"kind": "mamba", "layer_num": 2, "conv_state_shapes": [[4, 6], [2, 6]], "conv_dtype": "bfloat16",
     "temporal_state_shape": [2, 4, 8], "temporal_dtype": "float32", "num_slots": 3,
     "anchor_bytes": 8192},
]


def describe(views: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """What must agree for two views to address the same bytes the same way."""
    return [{"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
             "stride": list(t.stride()), "storage_offset": t.storage_offset()} for name, t in views]


def reference_views(reference: ModuleType, case: dict[str, Any], raw: torch.Tensor
                    ) -> list[tuple[str, torch.Tensor]]:
    """The reference's views of ``case`` over ``raw``, named k0, v0, ..., latent0, conv0, temporal."""
    dtype = {k: getattr(torch, case[k]) for k in ("dtype", "conv_dtype", "temporal_dtype") if k in case}
    if case["kind"] == "mamba":
        conv, temporal = reference.build_page_major_mamba_views(
            raw, layer_num=case["layer_num"],
            conv_state_shapes=[tuple(s) for s in case["conv_state_shapes"]],
            conv_dtype=dtype["conv_dtype"], temporal_state_shape=tuple(case["temporal_state_shape"]),
            temporal_dtype=dtype["temporal_dtype"], max_slots=case["num_slots"],
            anchor_bytes=case["anchor_bytes"])
        return [(f"conv{i}", t) for i, t in enumerate(conv)] + [("temporal", temporal)]
    mla = case["kind"] == "mla"
    k, v = reference.build_page_major_mha_views(
        raw, layer_num=case["layer_num"], head_num=1 if mla else case["head_num"],
        head_dim=case["kv_lora_rank"] + case["qk_rope_head_dim"] if mla else case["head_dim"],
        v_head_dim=0 if mla else case["v_head_dim"], store_dtype=dtype["dtype"],
        page_size=case["page_size"], num_pages=case["num_pages"], anchor_bytes=case["anchor_bytes"])
    if mla:
        return [(f"latent{i}", t) for i, t in enumerate(k)]
    return [(f"{role}{i}", t) for i, (kt, vt) in enumerate(zip(k, v)) for role, t in (("k", kt), ("v", vt))]


def record(reference: ModuleType, raw_bytes: int = 1 << 22) -> dict[str, Any]:
    """Every case's reference views, as written to the golden file."""
    raw = torch.zeros(raw_bytes, dtype=torch.uint8)
    return {"source": "shared/reference/page_major.py",
            "cases": [{"case": c, "views": describe(reference_views(reference, c, raw))} for c in CASES]}


def load_reference(path: Path) -> ModuleType:
    """Import the reference layout module from a file path."""
    spec = importlib.util.spec_from_file_location("page_major_reference", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[2] / "shared/reference/page_major.py"
    ref = load_reference(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
    GOLDEN.write_text(json.dumps(record(ref), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
