"""Value types of the IR: a tensor's shape (ints or symbolic names) and dtype."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.dtypes import numpy_dtype  # noqa: F401  (the IR's dtypes are these names)

Dim = int | str  # a static size, or a symbolic one such as "tokens"

DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "float8_e4m3fn")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# how the IR's text form writes each dtype (ir/printer.py, ir/parser.py)
SHORT_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32", "int64": "i64", "int8": "i8",
                "uint8": "u8", "float8_e4m3fn": "f8e4m3"}


class IRError(ValueError):
    """A malformed graph: the message names the node and the rule it broke."""


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise IRError(f"unknown dtype {self.dtype!r} (known: {', '.join(DTYPES)})")
        for d in self.shape:
            if not (isinstance(d, str) and d) and not (isinstance(d, int) and d >= 0):
                raise IRError(f"bad dimension {d!r} in shape {self.shape}")
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{SHORT_DTYPES[self.dtype]}[{', '.join(str(d) for d in self.shape)}]"

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_json(d: dict) -> "TensorType":
        return TensorType(tuple(d["shape"]), d["dtype"])


def ir_dtype(np_dtype) -> str:
    """The IR dtype of a NumPy dtype."""
    name = np.dtype(np_dtype).name
    if name not in DTYPES:
        raise IRError(f"unsupported array dtype {name}")
    return name
