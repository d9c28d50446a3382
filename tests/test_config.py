"""Daemon configuration: files, --pool flags, presets, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvxfer.errors import InvalidSpecError
from kvxfer.layout import MambaSpec, MhaSpec
from kvxfer.server.config import load_config, parse_pool_flag

REPO = Path(__file__).resolve().parent.parent


def test_the_shipped_sidecar_config_loads() -> None:
    config = load_config(str(REPO / "docker/kvxfer.yaml"))
    assert config.pool_names == ["kv"]
    assert config.arenas[0].pools[0].spec.page_bytes == 2 * 2**20
    assert config.ucx_error_handling is True
    assert config.peer_tls_cert and config.peer_tls_key and config.peer_tls_ca  # TLS by default


def test_pool_flags_take_presets_and_overrides() -> None:
    config = load_config(pool_flags=["name=kv,preset=llama8b,num_pages=8", "s=mamba-small"])
    kv, s = (a.pools[0].spec for a in config.arenas)
    assert isinstance(kv, MhaSpec) and kv.num_pages == 8 and kv.layer_num == 32
    assert isinstance(s, MambaSpec)


def test_explicit_pool_flag() -> None:
    entry = parse_pool_flag("name=x,kind=mla,layer_num=2,kv_lora_rank=16,qk_rope_head_dim=0,"
                            "dtype=float16,page_size=1,num_pages=4")
    assert entry["kind"] == "mla" and entry["kv_lora_rank"] == 16


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["name=kv,preset=nope"], "preset='nope' is unknown"),
        (["name=kv,kind=gqa"], "kind='gqa' is unknown"),
        (["name=kv,preset=tiny,heads=3"], r"unknown fields \['heads'\]"),
        (["name=kv,preset=tiny", "name=kv,preset=tiny"], r"repeated: \['kv'\]"),
        ([], "no pools configured"),
    ],
)
def test_bad_pool_flags_are_refused_clearly(flags: list[str], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        load_config(pool_flags=flags)


def test_unknown_config_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("pools: [{name: kv, preset: tiny}]\nworker_adress: unix:///x\n")
    with pytest.raises(InvalidSpecError, match=r"unknown config keys \['worker_adress'\]"):
        load_config(str(path))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"chunk_bytes": 0}, r"chunk_bytes=0; expected at least 4096"),
        ({"window_bytes": -1}, r"window_bytes=-1; expected a number above 0"),
        ({"ucx_lanes": 0}, r"ucx_lanes=0; expected a number above 0"),
        ({"heartbeat_s": "often"}, r"heartbeat_s='often'; expected a number above 0"),
        ({"grace_s": -1}, r"grace_s=-1; expected 0 or more seconds"),
        ({"ucx_port": 70000}, r"ucx_port=70000; expected a port from 0 to 65535"),
        ({"metrics_port": "9400x"}, r"metrics_port='9400x'; expected a port"),
        # A bare host:port would make the OTLP exporter try TLS against a plaintext collector.
        ({"otlp_endpoint": "127.0.0.1:4317"},
         r"otlp_endpoint='127.0.0.1:4317'; expected empty, http://HOST:PORT or https://HOST:PORT"),
    ],
)
def test_bad_transfer_settings_are_refused_clearly(overrides: dict, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        load_config(overrides=overrides, pool_flags=["kv=tiny"])
