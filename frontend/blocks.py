"""What kiln's quantisers are given: a float tensor as stored where widening it is exact (`quantiser_source`), and
a file's own quantised blocks (GGUF's, ONNX's MatMulNBits'), kept where kiln's format is theirs (their
`exact_parts`), else dequantised and requantised a few rows at a time (an 8B model's tables are 2 GiB in
float32), then the file's pages dropped (`block_quantizers`).

A blocks object gives: exact_parts(scheme, **options) -> parts or None, rows(start, stop), dequantize(then),
row_values, len() (rows) and release()."""
from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.ir.types import numpy_dtype

REQUANTIZE_ELEMENTS = 1 << 24        # float32 values a requantisation holds at once (64 MiB)


def quantiser_source(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A float tensor for a quantiser of `dtype` weights: as stored where that only widens it exactly (bfloat16
    or float16 to float32), which spares a float32 copy of every tensor."""
    exact = dtype == "float32" and arr.dtype.name in ("bfloat16", "float16")
    return arr if exact else arr.astype(numpy_dtype(dtype), copy=False)


def block_quantizers(base: dict, is_blocks: Callable[[object], bool]) -> dict:
    """`base` (scheme -> quantiser; the schemes' own where absent), each first given the file's blocks."""
    from kiln.ir.quant import SCHEMES

    def wrapped(scheme: str):
        run = base.get(scheme, SCHEMES[scheme].quantize)

        def quantize(w, **options):
            if not is_blocks(w):
                return run(w, **options)
            parts = w.exact_parts(scheme, **options)
            if parts is None:
                group = f" in groups of {options['group_size']}" if options.get("group_size") else ""
                step = max(1, REQUANTIZE_ELEMENTS // w.row_values)
                pieces = [run(w.rows(start, start + step).dequantize(f"requantised to {scheme}{group}"), **options)
                          for start in range(0, len(w), step)]
                parts = {part: np.concatenate([p[part] for p in pieces], axis=SCHEMES[scheme].output_axis(part))
                         for part in pieces[0]}
            w.release()
            return parts
        return quantize
    return {scheme: wrapped(scheme) for scheme in SCHEMES}
