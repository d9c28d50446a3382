"""The prompt digest: what a request's KV is computed from, as 32 bytes.

The prefill engine's connector records it with the offer; the decode engine's
connector computes it over its own request and presents it with the pull; the
prefill daemon compares the two (``docs/trust.md``). Two requests share a digest
only if their KV is the same: the same prompt token ids, ``cache_salt``, LoRA
adapter, and multimodal inputs (vLLM's content hashes and where they sit), computed
by the same model into the same block layout (``engine``: each side's own, so params
that lie about the prefill engine's model or layout still fail at the prefill daemon).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

#: Distinguishes this digest's encoding from any other use of SHA-256 (bump to change it).
DOMAIN = b"kvxfer-prompt-digest-v2"


def engine_binding(layout: dict[str, Any], fingerprint: str) -> bytes:
    """What binds a digest to the engine that computes the KV: its block layout and its
    model's fingerprint, as canonical bytes."""
    return json.dumps({"layout": layout, "model": fingerprint}, sort_keys=True).encode()


def prompt_digest(request: Any, engine: bytes = b"") -> bytes | None:
    """SHA-256 of what ``request``'s KV is computed from, by the engine ``engine_binding``
    names; None when the connector cannot bind KV to it (a prompt given as embeddings)."""
    if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
        return None
    digest = hashlib.sha256(DOMAIN)
    _field(digest, engine)
    tokens = list(request.prompt_token_ids)
    _field(digest, struct.pack(f"<{len(tokens)}q", *tokens))
    _field(digest, (getattr(request, "cache_salt", None) or "").encode())
    lora = getattr(request, "lora_request", None)
    _field(digest, (lora.lora_name if lora is not None else "").encode())
    for feature in getattr(request, "mm_features", None) or ():
        position = getattr(feature, "mm_position", None)
        _field(digest, str(feature.identifier).encode())
        _field(digest, struct.pack("<q", getattr(position, "offset", -1)))
    return digest.digest()


def _field(digest: Any, data: bytes) -> None:
    """One length-prefixed field, so that no two different inputs encode alike."""
    digest.update(struct.pack("<Q", len(data)))
    digest.update(data)
