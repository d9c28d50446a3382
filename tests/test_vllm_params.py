"""``kv_transfer_params`` v4 against an oracle: 10,000 generated params, valid and malformed,
through both connector halves' entry points (the scheduler half of a decode engine and of a
prefill engine), each predicted to load or be refused for a stated reason.

The generator builds each case from a valid v4 params object and one labelled mutation, so
the oracle is the label, not a second parser. Per case the decode half must load exactly
the valid ones (the engine's own prompt length, never a number from params) and refuse the
rest with the predicted reason; over the run its ``refusals`` counters must equal the
oracle's counts. No case may raise. Compatibility is by bytes and model: a layout field or
the model's fingerprint that differs is refused, a model name or vLLM version that differs
loads.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_vllm_connector import LAYOUT, MODEL, Request

from kvxfer.client.engine_core.head_split import HeadSplit
from kvxfer.client.integrations.vllm.digest import engine_binding, prompt_digest
from kvxfer.client.integrations.vllm.protocol import (
    PARAMS_VERSION,
    RemotePrefill,
    parse_remote_prefill,
)
from kvxfer.client.integrations.vllm.scheduler import SchedulerSide, transfer_name
from kvxfer.client.integrations.vllm.settings import load_settings
from kvxfer.errors import InvalidSpecError

#: How many generated params the run drives (the issue's floor).
CASES = 10_000
#: The reasons the decode half refuses params for (``protocol.RefusalReason``).
REFUSALS = ("malformed", "version", "layout", "model", "unsupported")

LAYOUT_INTS = ("page_size", "num_layers", "page_heads", "model_kv_heads", "head_size", "tp_size")
LAYOUT_TEXTS = ("dtype", "block_format")
MODEL_KEYS = ("fingerprint", "name", "vllm_version")
TOP_KEYS = ("version", "transfer_id", "peer", "capabilities", "layout", "model")
fingerprints = st.text("0123456789abcdef", min_size=32, max_size=32)

transfer_ids = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#"),
                       min_size=1, max_size=64)
peers = st.one_of(
    st.tuples(st.from_regex(r"[a-z0-9][a-z0-9.-]{0,20}", fullmatch=True), st.integers(0, 65535))
    .map(lambda hp: f"{hp[0]}:{hp[1]}"),
    st.ip_addresses(v=4).map(lambda ip: f"{ip}:7500"),
    st.ip_addresses(v=6).map(lambda ip: f"[{ip}]:7500"))
not_text = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                     st.lists(st.integers(), max_size=2),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
not_int = st.one_of(st.text(max_size=5), st.floats(allow_nan=False), st.booleans(), st.none(),
                    st.lists(st.integers(), max_size=2))
bad_transfer_ids = st.one_of(st.just(""), st.text(min_size=1, max_size=8).map(lambda t: t + " x"),
                             st.text(st.characters(min_codepoint=0x80), min_size=1, max_size=8),
                             st.just("a" * 241), st.just("P/r#0"))
bad_peers = st.one_of(st.just(""), st.just("host"), st.just("host:"), st.just(":80"),
                      st.just("a b:80"), st.just("host:123456"), st.text(max_size=8).map(lambda t: t + "/x:1"))


capabilities = st.text("0123456789abcdef", min_size=32, max_size=32)
bad_capabilities = st.one_of(st.text("0123456789abcdef", max_size=31),
                             st.text("0123456789abcdef", min_size=33, max_size=40),
                             st.text("0123456789ABCDEFG", min_size=32, max_size=32).filter(
                                 lambda c: c != c.lower() or "g" in c.lower()),
                             not_text.filter(lambda v: not isinstance(v, str)))


def valid_params(transfer_id: str, peer: str, capability: str) -> dict[str, Any]:
    return RemotePrefill(transfer_id, peer, (capability,), LAYOUT.page, MODEL).to_params()


@st.composite
def cases(draw: st.DrawFn) -> tuple[Any, str]:
    """(params, what the oracle predicts: none, load, malformed, version, layout or model)."""
    params = valid_params(draw(transfer_ids), draw(peers), draw(capabilities))
    ours = params["kvxfer"]
    kind = draw(st.sampled_from([
        "valid", "absent", "not_asked", "asked_not_bool", "kvxfer_not_object", "kvxfer_missing",
        "version_other", "version_missing", "extra_key", "missing_key", "field_type",
        "bad_transfer_id", "bad_peer", "bad_capability", "capabilities_count", "layout_missing",
        "layout_extra", "layout_type", "layout_out_of_range", "layout_differs", "embeds",
        "both_flags", "model_missing_key", "model_type", "model_bad_fingerprint", "model_differs",
        "model_named_otherwise"]))
    if kind == "valid":
        return params, "load"
    if kind == "embeds":
        return params, "unsupported"
    if kind == "both_flags":
        params["do_remote_decode"] = True
        return params, "malformed"
    if kind == "bad_capability":
        ours["capabilities"] = [draw(bad_capabilities)]
        return params, "malformed"
    if kind == "capabilities_count":
        ours["capabilities"] = draw(st.lists(capabilities, max_size=3).filter(lambda c: len(c) != 1))
        return params, "malformed"
    if kind == "absent":
        return draw(st.sampled_from([None, {}, {"do_remote_decode": False}])), "none"
    if kind == "not_asked":
        params["do_remote_prefill"] = draw(st.sampled_from([False, None]))
        return params, "none"
    if kind == "asked_not_bool":
        params["do_remote_prefill"] = draw(st.one_of(st.integers(1), st.text(min_size=1, max_size=4),
                                                     st.just([1]), st.just(0), st.just(0.0), st.just("")))
        return params, "malformed"
    if kind == "kvxfer_not_object":
        params["kvxfer"] = draw(not_text.filter(lambda v: not isinstance(v, dict)))
        return params, "malformed"
    if kind == "kvxfer_missing":
        del params["kvxfer"]
        return params, "malformed"
    if kind == "version_other":
        ours["version"] = draw(st.one_of(
            st.integers().filter(lambda v: v != PARAMS_VERSION), st.just(True),
            st.just(float(PARAMS_VERSION)), st.just(str(PARAMS_VERSION)), st.none()))
        return params, "version"
    if kind == "version_missing":
        del ours["version"]
        return params, "version"
    if kind == "extra_key":
        ours[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in TOP_KEYS))] = draw(st.integers())
        return params, "malformed"
    if kind == "missing_key":
        del ours[draw(st.sampled_from(TOP_KEYS[1:]))]
        return params, "malformed"
    if kind == "field_type":
        ours[draw(st.sampled_from(TOP_KEYS[1:]))] = draw(not_text)
        return params, "malformed"
    if kind == "bad_transfer_id":
        ours["transfer_id"] = draw(bad_transfer_ids)
        return params, "malformed"
    if kind == "bad_peer":
        ours["peer"] = draw(bad_peers)
        return params, "malformed"
    model = ours["model"]
    if kind == "model_missing_key":
        del model[draw(st.sampled_from(MODEL_KEYS))]
        return params, "malformed"
    if kind == "model_type":
        model[draw(st.sampled_from(MODEL_KEYS))] = draw(not_text)
        return params, "malformed"
    if kind == "model_bad_fingerprint":
        model["fingerprint"] = draw(st.text(max_size=40).filter(
            lambda f: len(f) != 32 or not set(f) <= set("0123456789abcdef")))
        return params, "malformed"
    if kind == "model_differs":
        model["fingerprint"] = draw(fingerprints.filter(lambda f: f != MODEL.fingerprint))
        return params, "model"
    if kind == "model_named_otherwise":  # another path or vLLM release, the same model: loads
        model["name"] = draw(st.text(max_size=30))
        model["vllm_version"] = draw(st.text(max_size=12))
        return params, "load"
    layout = ours["layout"]
    if kind == "layout_missing":
        del layout[draw(st.sampled_from(sorted(layout)))]
        return params, "malformed"
    if kind == "layout_extra":
        layout[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in layout))] = 1
        return params, "malformed"
    if kind == "layout_type":
        name = draw(st.sampled_from(LAYOUT_INTS + LAYOUT_TEXTS))
        layout[name] = draw(not_int if name in LAYOUT_INTS else not_text)
        return params, "malformed"
    if kind == "layout_out_of_range":
        layout[draw(st.sampled_from(LAYOUT_INTS))] = draw(st.one_of(st.integers(max_value=0),
                                                                    st.integers(min_value=1 << 20 + 1)))
        return params, "malformed"
    name = draw(st.sampled_from(LAYOUT_INTS + LAYOUT_TEXTS))
    if name in LAYOUT_INTS:
        layout[name] = draw(st.integers(1, 1 << 16).filter(lambda v: v != layout[name]))
        if name == "tp_size":  # beyond 1 << 10, or one capability for several ranks
            return params, "malformed"
        try:
            HeadSplit(layout["model_kv_heads"], layout["tp_size"], layout["page_heads"])
        except InvalidSpecError:
            return params, "malformed"
    else:
        layout[name] = draw(st.text(max_size=12).filter(lambda v: v != layout[name]))
    return params, "layout"


@pytest.mark.slow
def test_generated_params_load_or_are_refused_exactly_as_the_oracle_says() -> None:
    decode = SchedulerSide(load_settings({}), LAYOUT, MODEL, "D", producer=False, consumer=True,
                           client=None)
    prefill = SchedulerSide(load_settings({}), LAYOUT, MODEL, "P", producer=True, consumer=False,
                            client=None)
    predicted: Counter[str] = Counter()
    seen = 0

    @settings(max_examples=CASES, database=None)
    @given(case=cases(), tokens=st.integers(1, 4096), computed=st.integers(0, 64),
           do_remote_decode=st.one_of(st.just(True), not_text))
    def one(case: tuple[Any, str], tokens: int, computed: int, do_remote_decode: Any) -> None:
        nonlocal seen
        params, outcome = case
        seen += 1
        predicted[outcome] += 1
        request = Request(f"r{seen}", tokens, copy.deepcopy(params),
                          prompt_embeds=object() if outcome == "unsupported" else None)
        computed = min(computed, tokens)
        before = Counter(decode.refusals)
        got = decode.get_num_new_matched_tokens(request, computed)
        refused = {outcome: 1} if outcome in REFUSALS else {}
        assert decode.refusals - before == refused, (params, outcome, decode.refusals - before)
        if outcome == "load" and tokens > computed:
            assert got == (tokens - computed, True), (params, got)
            blocks = list(range(math.ceil(tokens / LAYOUT.block_size)))
            decode.update_state_after_alloc(request, (blocks,), tokens - computed)
            [load] = decode.build_plan({}, lambda _: []).loads
            assert load.num_pages == len(blocks) and load.transfer_id == params["kvxfer"]["transfer_id"]
            assert load.capabilities == tuple(params["kvxfer"]["capabilities"])
            assert load.prompt_digest == prompt_digest(request, engine_binding(
                LAYOUT.page.bytes_dict(), MODEL.fingerprint))
            assert decode.request_finished(request) is None
        else:
            assert got == (0, False), (params, outcome, got)
        assert decode.refusals == {k: v for k, v in predicted.items() if k in REFUSALS}

        # The prefill half gets the same generated params, asking for a hand-off or not.
        asks = ({**copy.deepcopy(params), "do_remote_decode": do_remote_decode}
                if isinstance(params, dict) else params)
        producer_request = Request(f"p{seen}", tokens, asks)
        prefill.update_state_after_alloc(producer_request, ([0],), 0)
        hands_off = isinstance(asks, dict) and asks.get("do_remote_decode") is True
        assert (f"p{seen}" in prefill._to_save) is hands_off, asks
        prefill.request_finished(producer_request)

    one()
    assert seen == CASES
    assert set(predicted) == {"load", "none", *REFUSALS}
    assert decode.refusals == {k: predicted[k] for k in REFUSALS}


@given(params=cases())
def test_every_refusal_names_what_was_wrong(params: tuple[Any, str]) -> None:
    value, outcome = params
    parsed = parse_remote_prefill(copy.deepcopy(value), LAYOUT, MODEL)
    if outcome in ("malformed", "version", "layout", "model"):  # "unsupported" needs the request
        assert parsed is not None and not isinstance(parsed, RemotePrefill)
        assert parsed.reason == outcome and len(parsed.detail) > 10


@given(tokens=st.lists(st.integers(0, 1 << 40), max_size=50), salt=st.none() | st.text(max_size=8),
       other=st.sampled_from(["token", "salt", "lora", "mm", "engine"]))
def test_the_prompt_digest_changes_with_everything_the_kv_depends_on(tokens: list[int], salt: str | None,
                                                                    other: str) -> None:
    from types import SimpleNamespace

    def request(**changes: Any) -> SimpleNamespace:
        base = {"prompt_token_ids": tokens, "cache_salt": salt, "lora_request": None, "mm_features": []}
        return SimpleNamespace(**{**base, **changes})

    lora = SimpleNamespace(lora_name="adapter")
    image = SimpleNamespace(identifier="img-hash", mm_position=SimpleNamespace(offset=3))
    changed = {"token": {"prompt_token_ids": [*tokens, 7]}, "salt": {"cache_salt": (salt or "") + "x"},
               "lora": {"lora_request": lora}, "mm": {"mm_features": [image]}, "engine": {}}[other]
    engine = engine_binding(LAYOUT.page.bytes_dict(), MODEL.fingerprint)
    assert prompt_digest(request(), engine) == prompt_digest(request(), engine)
    if other == "engine":  # another model computing the same prompt
        assert prompt_digest(request(), engine) != prompt_digest(request(), engine_binding(
            LAYOUT.page.bytes_dict(), "f" * 32))
    else:
        assert prompt_digest(request(), engine) != prompt_digest(request(**changed), engine)
    assert prompt_digest(request(prompt_embeds=object())) is None


def test_negative_control_a_lenient_reading_lets_one_request_raise_into_the_scheduler(
        monkeypatch: Any) -> None:
    """The strict parser switched off (the connector's reading before params v1: fields
    taken as they come): a malformed request raises out of the entry point vLLM's
    scheduler calls (which, unguarded, killed the engine core)."""
    def lenient(params: Any, ours: Any, our_model: Any) -> Any:
        if not params or not params.get("do_remote_prefill"):
            return None
        raw = params["kvxfer"]
        return SimpleNamespace(transfer_id=str(raw["transfer_id"]), peer=str(raw["peer"]),
                               num_tokens=int(raw["num_tokens"]), capabilities=())

    monkeypatch.setattr("kvxfer.client.integrations.vllm.scheduler.parse_remote_prefill", lenient)
    decode = SchedulerSide(load_settings({}), LAYOUT, MODEL, "D", producer=False, consumer=True,
                           client=None)
    with pytest.raises(TypeError):
        decode.get_num_new_matched_tokens(Request("x", 10, {"do_remote_prefill": True, "kvxfer": "x" * 8}), 0)


def test_request_ids_become_transfer_names_that_stay_distinct_and_short() -> None:
    """``#`` is the daemons' (parts of offers); ``%`` escapes; a long id is hashed."""
    assert transfer_name("cmpl-1") == "cmpl-1"
    assert transfer_name("a#0") == "a%230" != transfer_name("a%230") == "a%25230"
    assert "#" not in transfer_name("#" * 50)
    long = transfer_name("x" * 300)
    assert long.startswith("sha256-") and len(long) == 71 and long != transfer_name("x" * 301)
    assert len(transfer_name("#" * 99)) == 71  # escaping past the limit hashes too
