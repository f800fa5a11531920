"""Wire codes for torch dtypes. The C++ core only carries the code; the meaning lives here.

Codes are part of the wire format: never renumber or reuse one.
"""

import torch

_CODE_BY_NAME = {
    "bool": 1,
    "uint8": 2,
    "int8": 3,
    "int16": 4,
    "int32": 5,
    "int64": 6,
    "float16": 7,
    "bfloat16": 8,
    "float32": 9,
    "float64": 10,
    "complex64": 11,
    "complex128": 12,
    "complex32": 13,
    "uint16": 14,
    "uint32": 15,
    "uint64": 16,
    "float8_e4m3fn": 17,
    "float8_e5m2": 18,
}

# Only dtypes this torch build has.
DTYPE_TO_CODE = {
    getattr(torch, name): code for name, code in _CODE_BY_NAME.items() if hasattr(torch, name)
}
CODE_TO_DTYPE = {code: dtype for dtype, code in DTYPE_TO_CODE.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of `dtype`; ValueError for dtypes the transport cannot carry."""
    try:
        return DTYPE_TO_CODE[dtype]
    except KeyError:
        raise ValueError(f"the transport cannot send tensors of dtype {dtype}") from None


def dtype_from_code(code: int) -> torch.dtype:
    try:
        return CODE_TO_DTYPE[code]
    except KeyError:
        raise ValueError(f"received a message with unknown dtype code {code}") from None
