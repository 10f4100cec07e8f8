"""Explicit dtype <-> name table for every header that crosses a process boundary.

Names are torch's own (`"bfloat16"`, not safetensors' `"BF16"`) so a header is readable
by eye. The table is explicit rather than `getattr(torch, name)` so that a header from a
peer can never name an arbitrary torch attribute.
"""

from __future__ import annotations

import torch

_NAME_TO_DTYPE: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
# float8 types exist only in newer torch builds; absent ones are simply not transferable.
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _NAME_TO_DTYPE[_name] = getattr(torch, _name)

_DTYPE_TO_NAME: dict[torch.dtype, str] = {dtype: name for name, dtype in _NAME_TO_DTYPE.items()}

SUPPORTED_DTYPE_NAMES: tuple[str, ...] = tuple(_NAME_TO_DTYPE)


def dtype_to_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_TO_NAME[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be sent as weights; supported: {', '.join(SUPPORTED_DTYPE_NAMES)}"
        ) from None


def name_to_dtype(name: str) -> torch.dtype:
    try:
        return _NAME_TO_DTYPE[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown dtype name {name!r} in weight header; supported: {', '.join(SUPPORTED_DTYPE_NAMES)}"
        ) from None
