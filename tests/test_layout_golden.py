"""kvxfer's views equal the golden views recorded from SGLang's reference layout."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
import torch
from golden_layouts import CASES, GOLDEN, describe, record

from kvxfer.layout import MambaSpec, MhaSpec, MlaSpec, PoolLayout

GOLDEN_CASES = json.loads(GOLDEN.read_text())["cases"]


def our_views(case: dict[str, Any], raw: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """kvxfer's views of ``case`` over ``raw``, named as golden_layouts names the reference's."""
    fields = {k: v for k, v in case.items() if k not in ("kind", "anchor_bytes")}
    if case["kind"] == "mamba":
        fields["conv_state_shapes"] = tuple(tuple(s) for s in fields["conv_state_shapes"])
        fields["temporal_state_shape"] = tuple(fields["temporal_state_shape"])
    spec = {"mha": MhaSpec, "mla": MlaSpec, "mamba": MambaSpec}[case["kind"]](**fields)
    views = PoolLayout(spec, case["anchor_bytes"]).build_views(raw)
    named = [(f"k{i}", k) for i, k in enumerate(views.k)] + [(f"v{i}", v) for i, v in enumerate(views.v)]
    named += [(f"latent{i}", t) for i, t in enumerate(views.latent)]
    named += [(f"conv{i}", t) for i, t in enumerate(views.conv)]
    if views.temporal is not None:
        named.append(("temporal", views.temporal))
    return named


@pytest.mark.parametrize("golden", GOLDEN_CASES,
                         ids=[f"{i}-{g['case']['kind']}" for i, g in enumerate(GOLDEN_CASES)])
def test_views_match_the_recorded_reference(golden: dict[str, Any]) -> None:
    raw = torch.zeros(1 << 22, dtype=torch.uint8)
    ours = sorted(describe(our_views(golden["case"], raw)), key=lambda v: v["name"])
    want = sorted(golden["views"], key=lambda v: v["name"])
    assert ours == want


def test_the_recording_is_current(reference: ModuleType) -> None:
    """Fails when the golden file is stale (run ``python tests/golden_layouts.py``)."""
    assert [g["case"] for g in GOLDEN_CASES] == CASES
    assert record(reference) == json.loads(GOLDEN.read_text())
