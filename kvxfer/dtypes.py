"""The dtypes a pool may store, by the names used in configs and descriptors."""

from __future__ import annotations

import torch

from kvxfer.errors import InvalidSpecError

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def torch_dtype(name: str, *, field: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name``; raises InvalidSpecError naming ``field`` if unknown."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise InvalidSpecError(
            f"{field}={name!r} is not a supported dtype; expected one of {sorted(DTYPES)}"
        ) from None


def itemsize(name: str, *, field: str = "dtype") -> int:
    """Bytes per element of the dtype called ``name``."""
    return torch_dtype(name, field=field).itemsize
