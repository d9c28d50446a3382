"""Which model a KV cache was computed with: a fingerprint of the model, not of its name.

Two engines' KV blocks are interchangeable when their bytes are laid out alike
(``layout.BlockLayout``) and the same model computed them. ``fingerprint`` hashes what
decides the second: the model's config as Hugging Face records it (every field that
shapes the forward pass: sizes, rope scaling, sliding windows, quantization config), its
weights, the quantization method the engine applies and its speculative-decoding set-up.
Where the model lives (its path, the name an operator serves it under), the vLLM version
and the attention backend's name are not in it: the same model at another path, or under
another vLLM release that lays blocks out alike, is compatible.

Weights are fingerprinted by sampling, so that a start reads kilobytes, not gigabytes:
each weight file's name and size, its first MiB (a safetensors header lists every tensor's
name, dtype, shape and offsets) and ``SAMPLES`` slices of 64 KiB spread evenly over it
(xxh3-128). Another seed, a fine-tune or another checkpoint changes them; two files equal
in every sampled byte but not elsewhere would pass. A model named by a hub id whose files
are not in the local cache is fingerprinted by that id and revision instead.

A request's LoRA adapter is bound per request, by the prompt digest (``digest``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

#: Config keys that name where or by what a model was saved, not what it computes.
UNSHAPING_CONFIG_KEYS = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
    "_attn_implementation_autoset", "_attn_implementation", "_attn_implementation_internal",
})
#: Files that hold weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Bytes read from the start of each weight file (its header and first tensors).
HEAD_BYTES = 1 << 20
#: Slices read from the rest of each weight file, and their size.
SAMPLES = 16
SAMPLE_BYTES = 64 << 10
#: Hex characters of a fingerprint (128 bits).
FINGERPRINT_CHARS = 32


@dataclass(frozen=True)
class ModelIdentity:
    """An engine's model: ``fingerprint`` decides compatibility; ``name`` and
    ``vllm_version`` only say, in logs and refusals, what the engine called it and ran."""

    fingerprint: str
    name: str
    vllm_version: str


def weights_digest(directory: Path) -> str:
    """The sampled digest of the weight files directly in ``directory`` ("" if none)."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return ""
    digest = xxhash.xxh3_128()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as weights:
            digest.update(weights.read(HEAD_BYTES))
            last = size - SAMPLE_BYTES  # where the last slice starts
            if last <= HEAD_BYTES:  # a small file: the rest is the sample
                digest.update(weights.read())
                continue
            for i in range(SAMPLES):
                weights.seek(HEAD_BYTES + (last - HEAD_BYTES) * i // (SAMPLES - 1))
                digest.update(weights.read(SAMPLE_BYTES))
    return digest.hexdigest()


def shaping_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the keys that only say where or by what it was saved."""
    return {key: value for key, value in config.items() if key not in UNSHAPING_CONFIG_KEYS}


def fingerprint(config: dict[str, Any], weights: str, quantization: str | None,
                speculative: dict[str, Any] | None) -> str:
    """The model's fingerprint: SHA-256 of its shaping config, weights digest (or hub id and
    revision), quantization method and speculative set-up, as canonical JSON."""
    canonical = json.dumps({"config": shaping_config(config), "weights": weights,
                            "quantization": quantization, "speculative": speculative},
                           sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_CHARS]


def weights_of(model: str, revision: str | None) -> str:
    """The weights' digest for vLLM's ``model`` (a directory, or a hub id resolved in the
    local cache), else ``hub:ID@REVISION``."""
    directory = Path(model)
    if not directory.is_dir():
        try:
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except (ImportError, OSError, ValueError):  # not cached, not a hub id: the id is all
            return f"hub:{model}@{revision or 'main'}"
    return weights_digest(directory) or f"hub:{model}@{revision or 'main'}"
