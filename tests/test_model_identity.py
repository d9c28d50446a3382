"""The model fingerprint (``model_identity``): what it depends on, and what it ignores."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm_env import vllm_python

from kvxfer.client.integrations.vllm.model_identity import (
    HEAD_BYTES,
    SAMPLE_BYTES,
    UNSHAPING_CONFIG_KEYS,
    checkpoint_config,
    fingerprint,
    model_directory,
    weights_digest,
    weights_of,
)

REPO = Path(__file__).resolve().parent.parent
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
          "rope_theta": 10000.0, "_name_or_path": "/models/tiny", "transformers_version": "4.57.0"}
#: A weight file past its head: its sampled slices are spread over the rest.
BIG = HEAD_BYTES + 40 * SAMPLE_BYTES


def weights(directory: Path, size: int = BIG, name: str = "model.safetensors") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(bytes(i % 251 for i in range(size)))
    (directory / "config.json").write_text("{}")  # not a weight file
    return directory


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_same_weights_anywhere_have_one_digest_and_other_weights_another(tmp_path: Path) -> None:
    here = weights(tmp_path / "a")
    copy = shutil.copytree(here, tmp_path / "elsewhere" / "b")
    assert weights_digest(here) == weights_digest(copy) != ""
    flip(copy / "model.safetensors", 100)  # in the head: a tensor's name, shape or bytes
    assert weights_digest(copy) != weights_digest(here)
    shutil.rmtree(copy)
    shutil.copytree(here, copy)
    flip(copy / "model.safetensors", BIG - 1)  # in the last sampled slice
    assert weights_digest(copy) != weights_digest(here)
    (copy / "model.safetensors").rename(copy / "other.safetensors")
    assert weights_digest(copy) != weights_digest(here)
    assert weights_digest(tmp_path / "elsewhere") == ""  # no weight file directly in it


def test_a_small_weight_file_is_read_whole(tmp_path: Path) -> None:
    small = weights(tmp_path / "small", size=HEAD_BYTES + SAMPLE_BYTES // 2)
    before = weights_digest(small)
    flip(small / "model.safetensors", HEAD_BYTES + 10)
    assert weights_digest(small) != before


def test_only_the_files_vllm_loads_count(tmp_path: Path) -> None:
    """safetensors over other formats; with an index, only the shards it names."""
    model = weights(tmp_path / "m")
    alone = weights_digest(model)
    (model / "training_args.bin").write_bytes(b"output_dir=/home/someone")
    assert weights_digest(model) == alone  # safetensors present: .bin files are not loaded
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}}))
    (model / "consolidated.safetensors").write_bytes(b"another copy of the weights")
    assert weights_digest(model) == alone


def test_cached_hub_files_count_by_their_content_address(tmp_path: Path) -> None:
    """A hub model in the local cache (as vLLM leaves it: snapshot links to blobs named by
    their SHA-256) is found by id and revision; its digest is the blobs' names, and its
    config the checkpoint's file. Not cached: the id and the resolved revision."""
    cache, commit = tmp_path / "hub", "a" * 40
    repo = cache / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, blob in (("model.safetensors", "1" * 64), ("config.json", "2" * 64)):
        (repo / "blobs" / blob).write_bytes(b"{}" if name == "config.json" else b"weights")
        (snapshot / name).symlink_to(repo / "blobs" / blob)
    revision = SimpleNamespace(resolved=commit)  # vLLM's ResolvedRevision
    assert model_directory("org/tiny", revision, str(cache)) == snapshot
    assert model_directory("org/tiny", "main", str(cache)) == snapshot
    assert checkpoint_config(snapshot) == {}
    cached = weights_of("org/tiny", revision, str(cache))
    (repo / "blobs" / ("1" * 64)).write_bytes(b"not read: the name is the digest")
    assert weights_of("org/tiny", revision, str(cache)) == cached
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(repo / "blobs" / ("2" * 64))
    assert weights_of("org/tiny", revision, str(cache)) != cached
    assert weights_of("org/absent", revision, str(cache)) == f"hub:org/absent@{commit}"


@given(key=st.sampled_from(sorted(UNSHAPING_CONFIG_KEYS)), value=st.text(max_size=20))
def test_where_a_model_was_saved_is_not_part_of_its_fingerprint(key: str, value: str) -> None:
    assert fingerprint({**CONFIG, key: value}, "w", None, None) == fingerprint(CONFIG, "w", None, None)


@given(change=st.sampled_from(["config", "new_key", "weights", "quantization", "speculative"]),
       value=st.integers(1, 1 << 20))
def test_everything_that_shapes_the_kv_is_part_of_the_fingerprint(change: str, value: int) -> None:
    base: dict[str, Any] = {"config": CONFIG, "weights": "w", "quantization": None, "speculative": None}
    changed = dict(base)
    if change == "config":
        changed["config"] = {**CONFIG, "rope_theta": CONFIG["rope_theta"] + value}
    elif change == "new_key":
        changed["config"] = {**CONFIG, "sliding_window": value}
    elif change == "weights":
        changed["weights"] = f"w{value}"
    elif change == "quantization":
        changed["quantization"] = f"fp8-{value}"
    else:
        changed["speculative"] = {"method": "eagle", "num_speculative_tokens": value}
    assert fingerprint(**changed) != fingerprint(**base)


@pytest.mark.slow
def test_real_engine_configs_fingerprint_the_model_not_its_path(tmp_path: Path) -> None:
    """vLLM's own config of the tiny model, of a copy at another path, and of a model of the
    same shapes with other weights (another seed): the first two share a fingerprint, the
    third does not."""
    out = subprocess.run([str(vllm_python()), str(REPO / "tests" / "vllm_model_identity.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("seed", "copy")))
    assert lines["seed0"] == lines["copy0"] != lines["seed1"], lines
