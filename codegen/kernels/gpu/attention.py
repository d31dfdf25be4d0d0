"""kiln's paged attention on CUDA: the kernel records `kiln_gpu` and `kiln_gpu_decode` (selection/attention.py).

PrimFuncs whose kernels are CUDA source (codegen/kernels/gpu/attention_source.py) that TIR calls, as
codegen/kernels/gpu/mma_gemm.py's are, so they run on TVM's stream and the decode CUDA graphs capture them:
- `attention_kernel`: (q, pages, [scales], q_indptr, page_indptr, page_values, last_page_len)
  -> out [tokens, q_heads, head_dim], and with splits > 1 the shares' outputs and log-sum-exps,
  which its second kernel merges into out;
- `append_kernel`: a step's K/V rows quantised into int8 or e4m3 pages and their scales, in place
  (float pages take TVM's append, codegen/kernels/tvm_kernels.py).
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from kiln.interface import KVSpec

from .attention_source import WARPS, AttentionShape, append_source, attention_source

# shares of a decode step's keys (a share holds at least MIN_SPLIT_KEYS): at batch 1 an 8B shape's 8 KV
# heads make 256 blocks, two per SM of an H100 (not yet measured)
DECODE_SPLITS = 32


def _func(lines: list[str], sources: dict) -> tirx.PrimFunc:
    return tvm.script.from_source("@T.prim_func\n" + "\n".join(lines) + "\n", extra_vars={"T": T, "SOURCES": sources})


def _pages(shape: AttentionShape) -> list[str]:
    """match_buffer lines of the pages and, when quantised, their row scales, shaped as the layer's
    KVSpec lays them out."""
    spec = KVSpec("full", shape.kv_heads, shape.head_dim, shape.head_dim, shape.kv_dtype, shape.page_size,
                  scales="row" if shape.kv_code else "none")
    pages = spec.page_shape("num_pages")
    lines = [f"pages = T.match_buffer(var_pages, ({', '.join(map(str, pages))}), \"{shape.kv_dtype}\")"]
    if shape.kv_code:
        lines.append(f"scales = T.match_buffer(var_scales, ({', '.join(map(str, pages[:-1]))}), \"float32\")")
    return lines


def _launch(name: str, grid: list, threads: int, shared_bytes: int, args: list[str], indent: str) -> list[str]:
    """A `with` scope per thread axis, then the device function's call."""
    lines, axes = [], ["blockIdx.x", "blockIdx.y", "blockIdx.z"]
    for depth, extent in enumerate(grid):
        lines.append(f"{indent}{'    ' * depth}with T.launch_thread(\"{axes[depth]}\", {extent}):")
    inner = indent + "    " * len(grid)
    lines += [f"{inner}with T.launch_thread(\"threadIdx.x\", {threads}):",
              f"{inner}    shared = T.alloc_buffer(({max(shared_bytes, 16)},), \"uint8\", scope=\"shared.dyn\")",
              f"{inner}    T.evaluate(T.cuda.func_call(\"{name}\", {', '.join(args)}, "
              f"source_code=SOURCES[\"{name}\"]))"]
    return lines


def kernel_name(shape: AttentionShape, splits: int, softcap: float, window: int) -> str:
    kv = "" if shape.kv_code == 0 else "_int8" if shape.kv_dtype == "int8" else "_fp8"
    return (f"kiln_attention_{shape.dtype}{kv}_{shape.q_heads}x{shape.kv_heads}x{shape.head_dim}p{shape.page_size}"
            + (f"_split{splits}" if splits > 1 else "") + (f"_window{window}" if window else "")
            + ("_softcap" if softcap else ""))


def attention_kernel(shape: AttentionShape, splits: int, scale: float, softcap: float, window: int) -> tirx.PrimFunc:
    """The PrimFunc (q, pages, [scales], q_indptr, page_indptr, page_values, last_page_len, out,
    [partial, lse]): out [tokens, q_heads, head_dim]; `splits` shares of each token's keys."""
    problem = shape.problem()
    if problem:
        raise ValueError(f"kiln's GPU attention does not take {problem}")
    name = kernel_name(shape, splits, softcap, window)
    sources = {name: attention_source(name, shape, splits, scale, softcap, window)}
    hq, d, quantized = shape.q_heads, shape.head_dim, bool(shape.kv_code)
    handles = ["var_q", "var_pages"] + (["var_scales"] if quantized else []) + [
        "var_q_indptr", "var_page_indptr", "var_page_values", "var_last_page_len", "var_out"]
    handles += ["var_partial", "var_lse"] if splits > 1 else []
    lines = [f"def main({', '.join(f'{h}: T.handle' for h in handles)}):", "    T.func_attr({\"tirx.noalias\": True})",
             "    m = T.int64()", "    num_pages = T.int64()", "    seqs = T.int64()", "    page_count = T.int64()"]
    body = [f"q = T.match_buffer(var_q, (m, {hq}, {d}), \"{shape.dtype}\")", *_pages(shape),
            "q_indptr = T.match_buffer(var_q_indptr, (seqs + 1,), \"int32\")",
            "page_indptr = T.match_buffer(var_page_indptr, (seqs + 1,), \"int32\")",
            "page_values = T.match_buffer(var_page_values, (page_count,), \"int32\")",
            "last_page_len = T.match_buffer(var_last_page_len, (seqs,), \"int32\")",
            f"out = T.match_buffer(var_out, (m, {hq}, {d}), \"{shape.dtype}\")"]
    if splits > 1:
        body += [f"partial = T.match_buffer(var_partial, (m, {hq}, {splits}, {d}), \"float32\")",
                 f"lse = T.match_buffer(var_lse, (m, {hq}, {splits}), \"float32\")"]
    lines += [f"    {line}" for line in body] + ["    if m > 0:"]
    pointers = ["q.data", "pages.data"] + (["scales.data"] if quantized else []) + [
        "q_indptr.data", "page_indptr.data", "page_values.data", "last_page_len.data", "out.data"]
    pointers += ["partial.data", "lse.data"] if splits > 1 else []
    tokens = "T.Cast(\"int32\", m)"
    lines += _launch(name, [tokens, shape.kv_heads, splits], 32 * WARPS, shape.shared_bytes(),
                     pointers + ["T.Cast(\"int32\", seqs)", "shared.data"], "        ")
    if splits > 1:
        sources[f"{name}_merge"] = sources[name]
        lines += _launch(f"{name}_merge", [tokens, hq], 32, 0, ["partial.data", "lse.data", "out.data"], "        ")
    return _func(lines, sources)


def append_kernel(shape: AttentionShape) -> tirx.PrimFunc:
    """The PrimFunc (pages, scales, k, v, slots), pages and scales written in place: each new row
    quantised with its largest magnitude as ir/quant.py's KVScheme."""
    name = kernel_name(shape, 1, 0.0, 0).replace("kiln_attention", "kiln_kv_append")
    sources = {name: append_source(name, shape)}
    hkv, d = shape.kv_heads, shape.head_dim
    lines = ["def main(var_pages: T.handle, var_scales: T.handle, var_k: T.handle, var_v: T.handle, "
             "var_slots: T.handle):", "    T.func_attr({\"tirx.noalias\": True})",
             "    m = T.int64()", "    num_pages = T.int64()"]
    lines += [f"    {line}" for line in _pages(shape)] + [
        f"    k = T.match_buffer(var_k, (m, {hkv}, {d}), \"{shape.dtype}\")",
        f"    v = T.match_buffer(var_v, (m, {hkv}, {d}), \"{shape.dtype}\")",
        "    slots = T.match_buffer(var_slots, (m,), \"int32\")", "    if m > 0:"]
    lines += _launch(name, ["T.Cast(\"int32\", m)", hkv, 2], 32, 0,
                     ["pages.data", "scales.data", "k.data", "v.data", "slots.data"], "        ")
    return _func(lines, sources)
