"""Cases of kiln's GPU paged attention (codegen/kernels/gpu/attention_source.py) and their reference, for the
emulated test (tests/test_gpu_attention_emulated.py) and the GPU's (tests/gpu/test_gpu_attention.py):
ragged steps (a decode beside prefill chunks, cached context, shuffled pages), sliding windows
shorter and longer than the prompt, soft-capped scores, int8 and e4m3 pages, head ratios from MHA
to a group of 4, a head_dim that is not a multiple of 32, and a long context whose keys a decode
step splits over blocks."""
from __future__ import annotations

import numpy as np

PAGE = 16
SCALE = 0.125
# (dtype, kv dtype, q heads, kv heads, head_dim, window, softcap, splits)
CASES = [("bfloat16", "bfloat16", 4, 2, 64, 0, 0.0, 1), ("float16", "int8", 4, 1, 64, 0, 0.0, 1),
         ("bfloat16", "float8_e4m3fn", 2, 2, 64, 8, 0.0, 1), ("float32", "float32", 2, 1, 32, 40, 0.0, 1),
         ("bfloat16", "bfloat16", 4, 2, 80, 0, 30.0, 1), ("float16", "float16", 8, 2, 64, 64, 50.0, 1),
         ("bfloat16", "bfloat16", 4, 2, 64, 0, 0.0, 4), ("float16", "int8", 2, 1, 64, 300, 0.0, 4),
         ("bfloat16", "float8_e4m3fn", 4, 2, 64, 0, 20.0, 4)]
# (new tokens, tokens already cached) per sequence; a long one where the blocks split its keys
STEP = [(1, 40), (5, 0), (3, 17), (1, 0)]
LONG_STEP = [(1, 700), (2, 30)]
TOLERANCE = {"bfloat16": 1.6e-2, "float16": 2e-3, "float32": 1e-5}


def case_id(case) -> str:
    dtype, kv, hq, hkv, d, window, cap, splits = case
    return f"{dtype}-{kv}-{hq}x{hkv}x{d}" + (f"-w{window}" if window else "") + (f"-cap{cap:g}" if cap else "") \
        + (f"-split{splits}" if splits > 1 else "")


def shape_of(case):
    from kiln.codegen.kernels.gpu.attention_source import AttentionShape
    dtype, kv, hq, hkv, d = case[:5]
    return AttentionShape(hq, hkv, d, PAGE, dtype, kv)


def numpy_dtype(dtype: str):
    from kiln.ir.types import numpy_dtype as of
    return of(dtype)


def random_step(seed: int, case):
    """(step inputs, pages whose cached rows hold random (quantised) values, their scales or None,
    q, k, v), the pages shuffled."""
    from kiln.ir.quant import kv_scheme_for
    from paging import make_step_inputs
    rng = np.random.default_rng(seed)
    dtype, kv, hq, hkv, d = case[:5]
    step = LONG_STEP if case[7] > 1 else STEP
    need = [-(-(new + start) // PAGE) for new, start in step]
    order = rng.permutation(sum(need) + 3).tolist()
    seqs, at = [], 0
    for (new, start), n in zip(step, need):
        seqs.append(([1] * new, start, order[at:at + n]))
        at += n
    inputs = make_step_inputs(seqs, PAGE)
    rows = rng.standard_normal((len(order), 2, hkv, PAGE, d)).astype(np.float32)
    scheme = kv_scheme_for(kv)
    pages, scales = (rows.astype(numpy_dtype(kv)), None) if scheme is None else scheme.quantize_rows(rows)
    tokens = len(inputs["slot_mapping"])
    q, k, v = (rng.standard_normal((tokens, h, d)).astype(numpy_dtype(dtype)) for h in (hq, hkv, hkv))
    return inputs, pages, scales, q, k, v


def reference(case, inputs, pages, scales, q, k, v):
    """The paged_attention op's reference (ir/kv_ops.py): (output, pages and scales after its append)."""
    from kiln.ir.ops import OPS
    from kiln.ir.types import TensorType
    pages, scales = pages.copy(), None if scales is None else scales.copy()
    arrays = [q, k, v, pages, inputs["slot_mapping"], inputs["q_indptr"], inputs["page_indptr"],
              inputs["page_values"], inputs["last_page_len"]] + ([scales] if scales is not None else [])
    attrs = dict(scale=SCALE, window=case[5], softcap=case[6])
    return OPS["paged_attention"].reference(arrays, attrs, TensorType(q.shape, case[0]), {}), pages, scales


def check(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    got, want = got.astype(np.float32), want.astype(np.float32)
    assert np.isfinite(got).all(), "outputs left unwritten"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOLERANCE[dtype], f"max error {err:.2e} of the largest output"
