"""The vLLM plugin that keeps capabilities out of vLLM's logs (``kvxfer.integrations.
vllm_redaction``): what it rewrites, what it leaves, and that it is registered. test_vllm.py
checks it in real engines' logs under ``--enable-log-requests``."""

from __future__ import annotations

import json
import logging
import secrets
import tomllib
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvxfer.integrations import vllm_redaction
from kvxfer.integrations.vllm_redaction import REDACTED, CapabilityRedactor, redact

ROOT = Path(__file__).resolve().parent.parent
CAPABILITY = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
#: Text a capabilities value may hold beside the capabilities: quotes, brackets, escapes.
NOISE = st.text(alphabet="ab]['\"\\{}(),: ", max_size=12)


def params(capabilities: Any, transfer_id: str = "prefill-0/cmpl-1") -> dict[str, Any]:
    return {"do_remote_prefill": True,
            "kvxfer": {"version": 4, "transfer_id": transfer_id, "peer": "127.0.0.1:5701",
                       "capabilities": capabilities, "layout": {"page_size": 32}}}


def sampling_params_line(kv: dict[str, Any]) -> str:
    """What vLLM 0.32's request logger writes at INFO (``SamplingParams``' repr holds the
    params as a Python dict)."""
    return (f"Received request cmpl-4f1c-0: params: SamplingParams(n=1, temperature=0.0, "
            f"max_tokens=12, extra_args={{'kv_transfer_params': {kv!r}}}), lora_request: None.")


@given(caps=st.lists(CAPABILITY, min_size=1, max_size=4), noise=st.lists(NOISE, max_size=3),
       nested=st.booleans())
def test_no_capability_survives_in_a_repr_or_a_json_body(caps: list[str], noise: list[str],
                                                         nested: bool) -> None:
    value: Any = [*noise, *caps] if not nested else [[*noise, caps], {"k": caps}]
    kv = params(value)
    for line in (sampling_params_line(kv), json.dumps({"prompt": "x", "kv_transfer_params": kv})):
        redacted = redact(line)
        assert not any(cap in redacted for cap in caps), redacted
        assert REDACTED in redacted and "prefill-0/cmpl-1" in redacted


@given(cap=CAPABILITY)
def test_a_capability_given_as_one_string_is_redacted_too(cap: str) -> None:
    assert cap not in redact(sampling_params_line(params(cap)))
    assert cap not in redact(json.dumps(params(cap)))


def test_only_the_capabilities_value_changes() -> None:
    kv = params(["0123456789abcdef0123456789abcdef"])
    line = sampling_params_line(kv)
    want = line.replace("['0123456789abcdef0123456789abcdef']", REDACTED)
    assert redact(line) == want
    assert redact("Received request cmpl-1: no params") == "Received request cmpl-1: no params"


def test_negative_control_without_the_filter_the_log_holds_the_capability(caplog: Any) -> None:
    cap = secrets.token_hex(16)
    logger = logging.getLogger("kvxfer-test.request_logger")
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("Received request %s: params: %s", "cmpl-1", params([cap]))
        logger.addFilter(CapabilityRedactor())
        try:
            logger.info("Received request %s: params: %s", "cmpl-2", params([cap]))
        finally:
            logger.filters.clear()
    unfiltered, filtered = (record.getMessage() for record in caplog.records)
    assert cap in unfiltered and cap not in filtered and "cmpl-2" in filtered


def test_install_filters_vllms_handlers_and_its_request_logger() -> None:
    vllm_logger = logging.getLogger("vllm")
    handler = logging.StreamHandler()
    vllm_logger.addHandler(handler)
    try:
        vllm_redaction.install()
        vllm_redaction.install()
        assert handler.filters.count(vllm_redaction._REDACTOR) == 1
        request_logger = logging.getLogger(vllm_redaction._REQUEST_LOGGER)
        assert request_logger.filters.count(vllm_redaction._REDACTOR) == 1
    finally:
        vllm_logger.removeHandler(handler)
        logging.getLogger(vllm_redaction._REQUEST_LOGGER).removeFilter(vllm_redaction._REDACTOR)


def test_it_is_registered_as_a_vllm_general_plugin() -> None:
    project = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"kvxfer_redaction": "kvxfer.integrations.vllm_redaction:install"}
