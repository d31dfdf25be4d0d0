"""The weight quantisers compile runs: ir/quant.py's rules (the references), byte for byte, in
bounded memory and, for q4, fast.

- q4 is a TVM kernel for the host CPU. It computes the reference rule per group of `group_size`
  inputs: find the peak, fit a scale to each of the 19 candidates' levels and weigh its error, keep
  the first least, pack the nibbles. NumPy's version makes dozens of passes over memory per
  candidate; this one reads each group into registers twice per candidate, on every core.
- q8, fp8, q4a and q4k (whose rows are quantised each on its own) run the NumPy reference on a block
  of rows at a time, so its temporaries are a block's, not a 2 GB embedding table's several times over.
"""
from __future__ import annotations

import functools
import gc
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kiln.ir.quant import Q4_CANDIDATES, SCHEMES

CHUNK_ELEMENTS = 1 << 24            # float32 inputs per kernel call or NumPy block (64 MiB)


@functools.cache
def _kernel(group_size: int, k: int):
    """The kernel for rows of `k` inputs. Each row is first copied group-minor ([group_size,
    k / group_size]) into a buffer of its own: the groups lie side by side, so each step of the rule
    runs on a vector of groups. The importance comes group-minor too (the same for every row)."""
    import tvm
    from tvm.script import tirx as T

    from kiln.host_cpu import host_llvm_target

    from kiln.targets.exp_lowering import register_exp_lowering

    groups, half, candidates = k // group_size, group_size // 2, len(Q4_CANDIDATES)
    lanes = next(v for v in (8, 4, 2, 1) if groups % v == 0)

    MAGNITUDE, PEAK, INVERSE, SCALE, BEST = range(5)     # rows of the per-group state
    NUM, DEN, ERR, BEST_ERR = range(4)

    # Expressions built while the kernel is parsed. (A TVMScript `name = expr` inside a vectorized
    # loop becomes a Let, which TVM 0.27's vectorizer got wrong here: every lane took lane 0's value.)
    def clipped(v):
        return T.max(T.min(T.round(v), T.float32(7)), T.float32(-8))

    def level(x, scale):
        """clip(rint(x / scale), -8, 7) in float32; 0 where the scale is 0."""
        return T.Select(scale == T.float32(0), T.float32(0), clipped(x / scale))

    def larger(x, magnitude):
        return T.abs(x) > magnitude

    def wide(x):
        return T.Cast("float64", x)

    def squared_error(x, scale):
        """(q * scale - x)^2 in float64, exact but for the sum: the difference is exact in float32
        (x lies within a factor 2 of q * scale, or q is 0), and its square fits float64's mantissa."""
        d = wide(level(x, scale) * scale - x)
        return d * d

    def as_stored(num, den):
        """num / den rounded to float32 then float16 (0 where den is 0), back in float32."""
        return T.Cast("float32", T.Cast("float16", T.Cast(
            "float32", T.Select(den > T.float64(0), num / T.Select(den > T.float64(0), den, T.float64(1)),
                                T.float64(0)))))

    @T.prim_func(s_tir=True)
    def quantize_q4(w_handle: T.handle, u_handle: T.handle, c_handle: T.handle, q_handle: T.handle,
                    s_handle: T.handle):
        n = T.int64()
        w = T.match_buffer(w_handle, (n, k), "float32")
        ut = T.match_buffer(u_handle, (group_size, groups), "float32")
        cands = T.match_buffer(c_handle, (candidates,), "float32")
        q = T.match_buffer(q_handle, (n, k // 2), "uint8")
        scales = T.match_buffer(s_handle, (groups, n), "float16")
        for task in T.parallel(n):
            with T.sblock("row"):
                r = T.axis.spatial(n, task)
                T.reads(w[r, 0:k], ut[0:group_size, 0:groups], cands[0:candidates])
                T.writes(q[r, 0:k // 2], scales[0:groups, r])
                wt = T.sblock_alloc_buffer((group_size, groups), "float32")     # the row, group-minor
                st = T.sblock_alloc_buffer((5, groups), "float32")       # MAGNITUDE, PEAK, INVERSE, SCALE, BEST
                acc = T.sblock_alloc_buffer((4, groups), "float64")      # NUM, DEN, ERR, BEST_ERR
                for g, i in T.grid(groups, group_size):
                    wt[i, g] = w[r, g * group_size + i]
                for go, gi in T.grid(groups // lanes, lanes):
                    st[MAGNITUDE, go * lanes + gi] = T.float32(-1)
                    st[PEAK, go * lanes + gi] = T.float32(0)
                    acc[BEST_ERR, go * lanes + gi] = T.float64(np.inf)
                    st[BEST, go * lanes + gi] = T.float32(0)
                for i in range(group_size):                                # the first largest magnitude
                    for go in range(groups // lanes):
                        for gi in T.vectorized(lanes):
                            st[PEAK, go * lanes + gi] = T.Select(
                                larger(wt[i, go * lanes + gi], st[MAGNITUDE, go * lanes + gi]),
                                wt[i, go * lanes + gi], st[PEAK, go * lanes + gi])
                            st[MAGNITUDE, go * lanes + gi] = T.max(T.abs(wt[i, go * lanes + gi]),
                                                                   st[MAGNITUDE, go * lanes + gi])
                for go in range(groups // lanes):
                    for gi in T.vectorized(lanes):
                        st[PEAK, go * lanes + gi] = T.Select(st[PEAK, go * lanes + gi] == T.float32(0),
                                                             T.float32(1), st[PEAK, go * lanes + gi])
                for c in range(candidates):
                    for go in range(groups // lanes):
                        for gi in T.vectorized(lanes):
                            st[INVERSE, go * lanes + gi] = cands[c] / st[PEAK, go * lanes + gi]
                            acc[NUM, go * lanes + gi] = T.float64(0)
                            acc[DEN, go * lanes + gi] = T.float64(0)
                            acc[ERR, go * lanes + gi] = T.float64(0)
                    for i in range(group_size):                          # the levels' least-squares scale
                        for go in range(groups // lanes):
                            for gi in T.vectorized(lanes):
                                acc[NUM, go * lanes + gi] = acc[NUM, go * lanes + gi] + wide(
                                    ut[i, go * lanes + gi]) * wide(clipped(
                                        wt[i, go * lanes + gi] * st[INVERSE, go * lanes + gi])) * wide(
                                    wt[i, go * lanes + gi])
                                acc[DEN, go * lanes + gi] = acc[DEN, go * lanes + gi] + wide(
                                    ut[i, go * lanes + gi]) * wide(clipped(
                                        wt[i, go * lanes + gi] * st[INVERSE, go * lanes + gi])) * wide(clipped(
                                        wt[i, go * lanes + gi] * st[INVERSE, go * lanes + gi]))
                    for go in range(groups // lanes):
                        for gi in T.vectorized(lanes):
                            st[SCALE, go * lanes + gi] = as_stored(acc[NUM, go * lanes + gi],
                                                                   acc[DEN, go * lanes + gi])
                    for i in range(group_size):                          # its weighted error
                        for go in range(groups // lanes):
                            for gi in T.vectorized(lanes):
                                acc[ERR, go * lanes + gi] = acc[ERR, go * lanes + gi] + wide(
                                    ut[i, go * lanes + gi]) * squared_error(wt[i, go * lanes + gi],
                                                                            st[SCALE, go * lanes + gi])
                    for go in range(groups // lanes):
                        for gi in T.vectorized(lanes):
                            st[BEST, go * lanes + gi] = T.Select(
                                acc[ERR, go * lanes + gi] < acc[BEST_ERR, go * lanes + gi],
                                st[SCALE, go * lanes + gi], st[BEST, go * lanes + gi])
                            acc[BEST_ERR, go * lanes + gi] = T.min(acc[ERR, go * lanes + gi],
                                                                   acc[BEST_ERR, go * lanes + gi])
                for g in range(groups):
                    scales[g, r] = T.Cast("float16", st[BEST, g])
                for j in range(k // 2):
                    q[r, j] = T.Cast("uint8", level(w[r, 2 * j], st[BEST, j // half]) + T.float32(8)) | (
                        T.Cast("uint8", level(w[r, 2 * j + 1], st[BEST, j // half]) + T.float32(8)) << T.uint8(4))

    func = quantize_q4.with_attr("global_symbol", "quantize_q4")
    register_exp_lowering()          # as for every kernel built for this CPU (targets/cpu.py)
    return tvm.compile(tvm.IRModule({"quantize_q4": func}), target=host_llvm_target())["quantize_q4"]


def quantize_q4(w: np.ndarray, group_size: int = 32, importance: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """ir/quant.py's q4 quantiser, run by the TVM kernel: the same parts, byte for byte."""
    import tvm
    n, k = w.shape
    built = _kernel.cache_info().misses
    kernel = _kernel(group_size, k)
    if _kernel.cache_info().misses != built:
        # TVMScript's parser keeps the calling frames in a reference cycle, and this frame holds
        # `w` (2 GB for an 8B model's embedding): collect it now, not at some later collection.
        gc.collect()
    u = np.ones(k, np.float32) if importance is None else np.asarray(importance, np.float32)
    u = tvm.runtime.tensor(np.ascontiguousarray(u.reshape(k // group_size, group_size).T))
    candidates = tvm.runtime.tensor(Q4_CANDIDATES)
    packed = np.empty((n, k // 2), np.uint8)
    scales = np.empty((k // group_size, n), np.float16)
    rows = max(1, min(n, CHUNK_ELEMENTS // k))
    staging = aligned_empty((rows, k), np.float32)     # TVM takes it without a copy
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        np.copyto(staging[:stop - start], w[start:stop], casting="unsafe")     # bf16 is widened here
        q_out = tvm.runtime.empty((stop - start, k // 2), "uint8")
        s_out = tvm.runtime.empty((k // group_size, stop - start), "float16")
        kernel(tvm.runtime.from_dlpack(staging[:stop - start]), u, candidates, q_out, s_out)
        packed[start:stop] = q_out.numpy()
        scales[:, start:stop] = s_out.numpy()
    return {"q": packed, "scale": scales}


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary (TVM's DLPack
    import requires it; NumPy guarantees 16)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    offset = -raw.ctypes.data % 64
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def by_rows(quantize, output_axis=lambda part: 0):
    """A per-row scheme's reference run on blocks of rows, a block per core at a time (NumPy lets go
    of the GIL in its loops): the same parts, in the blocks' memory (a part whose `output_axis` is 1,
    a grouped scheme's scale table, is filled by columns)."""
    def run(w: np.ndarray, **options) -> dict[str, np.ndarray]:
        n, k = w.shape
        cores = len(os.sched_getaffinity(0))
        rows = max(1, CHUNK_ELEMENTS // cores // k)
        first = quantize(w[:rows], **options)
        parts = {name: np.empty(_with_axis(p.shape, output_axis(name), n), p.dtype) for name, p in first.items()}

        def place(start: int, block: dict[str, np.ndarray]) -> None:
            for name, p in block.items():
                if output_axis(name):
                    parts[name][:, start:start + rows] = p
                else:
                    parts[name][start:start + rows] = p
        place(0, first)
        starts = range(rows, n, rows)
        with ThreadPoolExecutor(cores) as pool:
            for start, block in zip(starts, pool.map(lambda start: quantize(w[start:start + rows], **options), starts)):
                place(start, block)
        return parts
    return run


def _with_axis(shape: tuple[int, ...], axis: int, size: int) -> tuple[int, ...]:
    return (*shape[:axis], size, *shape[axis + 1:])


def fast_quantizers() -> dict:
    """Scheme name -> the quantiser compile runs in place of ir/quant.py's reference. A TVM without
    its compiler (`kiln attach-weights` on a GPU machine) cannot build the q4 kernel: q4 runs the
    reference there, slower and in more memory, to the same bytes."""
    from kiln.host_cpu import has_llvm
    assert SCHEMES["q4"].grouped and not SCHEMES["q8"].grouped and not SCHEMES["fp8"].grouped
    return {"q4": quantize_q4 if has_llvm() else SCHEMES["q4"].quantize, "q8": by_rows(SCHEMES["q8"].quantize),
            "fp8": by_rows(SCHEMES["fp8"].quantize), "q8g": SCHEMES["q8g"].quantize,
            **{name: by_rows(SCHEMES[name].quantize, SCHEMES[name].output_axis) for name in ("q4a", "q4k")}}
