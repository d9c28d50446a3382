"""The connector's settings: the ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
      "kv_connector_module_path": "kvxfer.integrations.vllm", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"daemon": "unix:///run/kvxfer/kvxfer.sock", "pool": "kv"}}'

Unknown keys are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvxfer.errors import InvalidSpecError


class ConnectorSettings(BaseModel):
    """Every key of ``kv_connector_extra_config`` the connector reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    daemon: str = Field("unix:///run/kvxfer/kvxfer.sock",
                        description="the local kvxfer daemon's worker address")
    pool: str = Field("kv", description="the daemon pool this engine's KV blocks go through")
    page_size: int | None = Field(
        None, gt=0, description="tokens per page of the pool (default: the engine's block "
                                "size); engines of different block sizes exchange KV when "
                                "both use the same page_size, one that divides both block "
                                "sizes (only with the in-block format mha_head_major)")
    page_heads: int | None = Field(
        None, gt=0, description="KV heads per page of the pool (default: all of a rank's); "
                                "engines of different tensor-parallel sizes exchange KV when "
                                "both use the same page_heads, one that divides both sides' "
                                "KV heads per rank, 1 always does (only with the in-block "
                                "format mha_head_major)")
    timeout_s: float = Field(30.0, gt=0, description="deadline of one request's transfer")
    lease_s: float = Field(60.0, gt=0, description="how long the daemon holds a request's "
                                                   "pages if nobody releases them")
    verify: bool = Field(False, description="checksum every transfer (a request can ask for "
                                            "it with kv_transfer_params {\"verify\": true})")
    stats_file: str = Field("", description="a debugging aid: append one JSON line per transfer "
                                            "(a load's timeline, times, bytes)")
    # Stepping at once instead spins the cores the daemons need: with 0.002, two TP 2 engines
    # on 2 cores ran at a load average of 40-60 while a load was pending, and some load
    # stalled until its deadline in each of 5 runs; with 0.02, 10-16, and none of 42 did.
    idle_wait_s: float = Field(0.02, ge=0, le=1.0,
                               description="how long a decode step that computes nothing waits "
                                           "for its loads' endings (it returns as soon as one "
                                           "arrives; a request arriving meanwhile waits at most "
                                           "this long)")
    keep_offers_every_s: float | None = Field(
        None, ge=0, description="decode: how often the offers of requests still queued here "
                                "are kept alive at their prefill daemons, each for timeout_s "
                                "more (default: a third of timeout_s; 0: never, and an offer "
                                "then ends at its deadline)")

    @model_validator(mode="after")
    def _keeps_before_deadlines(self) -> ConnectorSettings:
        if self.keep_offers_every_s is not None and self.keep_offers_every_s >= self.timeout_s:
            raise ValueError(f"keep_offers_every_s={self.keep_offers_every_s} must be below "
                             f"timeout_s={self.timeout_s}, or an offer ends between two keeps")
        return self

    @property
    def keep_every_s(self) -> float:
        """Seconds between two keeps of the queued requests' offers (0: never)."""
        if self.keep_offers_every_s is None:
            return self.timeout_s / 3
        return self.keep_offers_every_s


def load_settings(extra: dict[str, Any]) -> ConnectorSettings:
    """The settings from ``kv_connector_extra_config``; InvalidSpecError names a bad key."""
    try:
        return ConnectorSettings.model_validate(extra)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        what = f"{key}={error.get('input')!r}: " if key else ""
        raise InvalidSpecError(
            f"kv_connector_extra_config: {what}{error['msg']}; keys: "
            f"{sorted(ConnectorSettings.model_fields)}") from None
