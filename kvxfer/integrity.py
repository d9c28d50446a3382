"""Per-chunk checksums (xxh3-64): computed by the sender, verified by the receiver."""

from __future__ import annotations

from typing import Any

import xxhash


def checksum(buffer: Any) -> int:
    """The xxh3-64 digest of a host buffer (numpy array) or a CUDA tensor (copied to host)."""
    if hasattr(buffer, "device") and getattr(buffer.device, "type", "cpu") != "cpu":
        buffer = buffer.cpu().numpy()
    return xxhash.xxh3_64_intdigest(memoryview(buffer))
