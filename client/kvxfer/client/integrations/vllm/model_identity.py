"""Which model a KV cache was computed with: a fingerprint of the model, not of its name.

Two engines' KV blocks are interchangeable when their bytes are laid out alike
(``layout.BlockLayout``) and the same model computed them. ``fingerprint`` hashes what
decides the second: the checkpoint's own ``config.json`` (every field that shapes the
forward pass: sizes, rope scaling, sliding windows, its quantization config; read from the
file, not from the transformers object, whose defaults change between releases) with
vLLM's ``hf_overrides``, the weights, an online quantization method (one the checkpoint
does not record) and a speculative draft model's weights. Where the model lives (its path,
the name an operator serves it under), the vLLM version and the attention backend's name
are not in it: the same model at another path, or under another vLLM release that lays
blocks out alike, is compatible.

Weights: the files vLLM loads (the safetensors index's files, else every ``*.safetensors``,
else the other weight formats), each by its name and content. A file in the Hugging Face
cache is a link to a blob named by its SHA-256: that name is the digest, exact and free.
Any other file is sampled, so that a start reads kilobytes, not gigabytes: its size, its
first MiB (a safetensors header lists every tensor's name, dtype, shape and offsets) and
``SAMPLES`` slices of 64 KiB spread evenly over it (xxh3-128). Another seed, a fine-tune or
another checkpoint changes them; a change confined to bytes no slice covers would pass. A
hub id whose files are not in the local cache is fingerprinted by its id and resolved
revision instead.

A request's LoRA adapter is bound per request, by name, in the prompt digest (``digest``).
"""

from __future__ import annotations

import hashlib
import json
import re
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


#: A Hugging Face cache blob's name: the SHA-256 of its content.
BLOB_NAME = re.compile(r"^[0-9a-f]{64}$")


def weight_files(directory: Path) -> list[Path]:
    """The weight files vLLM loads from ``directory``: those its safetensors index names,
    else every ``*.safetensors``, else the other weight formats."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return sorted(directory / name for name in names)
    present = [p for p in directory.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    preferred = [p for p in present if p.suffix == ".safetensors"] or present
    return sorted(preferred)


def weights_digest(directory: Path) -> str:
    """The digest of the weight files vLLM loads from ``directory`` ("" if none)."""
    files = weight_files(directory)
    if not files:
        return ""
    digest = xxhash.xxh3_128()
    for path in files:
        blob = path.resolve().name
        if path.is_symlink() and BLOB_NAME.match(blob):  # the cache's content address
            digest.update(f"{path.name}\0{blob}\0".encode())
            continue
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


def model_directory(model: str, revision: Any, cache_dir: str | None = None) -> Path | None:
    """The directory of vLLM's ``model``: itself, or for a hub id its snapshot in the local
    cache (``cache_dir``, vLLM's ``--download-dir``, else Hugging Face's) at ``revision``
    (vLLM's resolved revision, or a name); None if not cached."""
    directory = Path(model)
    if directory.is_dir():
        return directory
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json", cache_dir=cache_dir,
                                        revision=resolved(revision))
    except (ImportError, OSError, ValueError):  # not a hub id, or no cache
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def resolved(revision: Any) -> str | None:
    """A revision as a commit where vLLM resolved it (its ``ResolvedRevision``), else as given."""
    found = getattr(revision, "resolved", None) or revision
    return str(found) if found else None


def checkpoint_config(directory: Path | None) -> dict[str, Any] | None:
    """The checkpoint's own ``config.json`` in ``directory``, if there is one."""
    path = directory / "config.json" if directory is not None else None
    if path is None or not path.is_file():
        return None
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def weights_of(model: str, revision: Any, cache_dir: str | None = None) -> str:
    """The weights' digest for vLLM's ``model`` (a directory, or a hub id resolved in the
    local cache), else ``hub:ID@REVISION`` (the resolved commit where vLLM knows it)."""
    directory = model_directory(model, revision, cache_dir)
    found = weights_digest(directory) if directory is not None else ""
    return found or f"hub:{model}@{resolved(revision) or 'main'}"
