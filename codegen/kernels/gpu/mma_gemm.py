"""Tensor-core linears on CUDA: y = x @ W.T (+ bias) (+ residual) for bf16 and fp16 activations,
with weights in their dtype or quantised (q8, fp8, q4: a mixed-input GEMM), by step shape.

One PrimFunc per linear shape. Its host side picks a tile by the step's row count (the tuning
table's rows for the shape, selection/tiles.py) and launches the tile's kernel; each kernel is
CUDA source (codegen/kernels/gpu/mma_source.py) that TIR calls, so TVM builds it into the artifact with the
rest, it runs on TVM's stream and the decode CUDA graphs capture it like any other kernel. Where a
step has few rows the caller may put another kernel first (`below`): the GPU decode GEMV.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from kiln.ir.quant import SCHEMES
from kiln.selection.shapes import NIBBLE_FORMATS, stored_dtype
from kiln.selection.tiles import HopperTile, TileConfig

from .hopper_gemm import BIAS, RESIDUAL, HopperGemm
from .mma_source import CTYPES, experts_kernel_source, kernel_source


def launch_lines(name: str, blocks: int, rows_per_block: int, threads: int, shared_bytes: int,
                 pointers: list[str], indent: str) -> list[str]:
    """TVMScript lines launching device function `name`(pointers..., m, shared): `blocks` x (m rows
    in blocks of `rows_per_block`, 0: one) thread blocks of `threads`, with `shared_bytes` of
    dynamic shared memory."""
    lines = [f"{indent}bx = T.launch_thread(\"blockIdx.x\", {blocks})"]
    if rows_per_block:
        lines.append(f"{indent}by = T.launch_thread(\"blockIdx.y\", "
                     f"T.Cast(\"int32\", (m + {rows_per_block - 1}) // {rows_per_block}))")
    return lines + [f"{indent}tx = T.launch_thread(\"threadIdx.x\", {threads})",
                    f"{indent}shared = T.alloc_buffer(({shared_bytes},), \"uint8\", scope=\"shared.dyn\")",
                    f"{indent}T.evaluate(T.cuda.func_call(\"{name}\", {', '.join(pointers)}, T.Cast(\"int32\", m), "
                    f"shared.data, source_code=SOURCES[\"{name}\"]))"]


def _launch(name: str, tile: TileConfig, n_out: int, pointers: list[str], indent: str, weight: str) -> list[str]:
    return launch_lines(name, n_out // tile.bn, tile.bm, tile.threads, tile.shared_bytes(weight), pointers, indent)


def form_suffix(weight: str, group_size: int) -> str:
    """The weight format's part of a kernel name: '', '_q8', '_fp8', '_q4g32', '_q4kg32'."""
    return "" if weight == "float" else f"_{weight}" + (f"g{group_size}" if weight in NIBBLE_FORMATS else "")


def weight_params(weight: str, dtype: str, n_out: int, n_in: int, group_size: int, experts: int = 0) -> list[str]:
    """The stored weight's parameter and its scales' (q8/fp8 per output; q4, q4a, q4k their group
    tables, ir/quant.py), with a leading experts axis where `experts`."""
    lead = f"{experts}, " if experts else ""
    stored_in = n_in // 2 if weight in NIBBLE_FORMATS else n_in
    params = [f"w: T.Buffer(({lead}{n_out}, {stored_in}), \"{stored_dtype(weight, dtype)}\")"]
    if weight in ("q8", "fp8"):
        params.append(f"scale: T.Buffer(({lead}{n_out},), \"float32\")")
    elif weight in NIBBLE_FORMATS:
        scheme = SCHEMES[weight]
        params.append(f"scale: T.Buffer(({lead}{scheme.table_rows(n_in, group_size)}, {n_out}), "
                      f"\"{scheme.scale_dtype}\")")
    return params


def prim_func(params: list[str], buffers: list[str], pointers: list[str], tiles, names: list[str], sources: dict,
              launch) -> tirx.PrimFunc:
    """The PrimFunc of `params`, its rows m bound by `buffers`' match_buffer lines, launching the
    tiles' kernels (names[i] runs tiles[i]; a tile may serve several rows buckets, its source once in
    `sources`) on `pointers` with `launch`(name, tile, pointers, indent) -> lines."""
    lines = [f"def main({', '.join(params)}):", "    T.func_attr({\"tirx.noalias\": True})", "    m = T.int64()"]
    lines += [f"    {line}" for line in buffers] + _dispatch(tiles, names, pointers, launch)
    return tvm.script.from_source("@T.prim_func\n" + "\n".join(lines) + "\n", extra_vars={"T": T, "SOURCES": sources})


def mma_linear_kernel(n_out: int, n_in: int, dtype: str, bias: bool, residual: bool,
                      tiles: list[tuple[int, TileConfig]], weight: str = "float",
                      group_size: int = 0, activation: str | None = None) -> tuple[tirx.PrimFunc, list[str]]:
    """The PrimFunc (x, w, [scale], [bias], [residual], y) and its kernels' names. `tiles`: (up to
    rows, tile) in ascending rows, the last one for every larger step (its rows are ignored);
    `weight`: the stored format (float, q8, fp8, q4 with `group_size`); `activation` (silu,
    gelu_tanh): a gated MLP's gate/up linear, weights stored 'gated', y [rows, n_out / 2]."""
    names, sources = linear_sources("mma", dtype, n_out, n_in, bias, residual, weight, group_size, activation, tiles,
                                    lambda name, tile: kernel_source(name, dtype, tile, n_out, n_in, bias, residual,
                                                                     weight, group_size, activation))
    launch = lambda name, tile, ptrs, indent: _launch(name, tile, n_out, ptrs, indent, weight)      # noqa: E731
    return prim_func(*linear_signature(n_out, n_in, dtype, bias, residual, weight, group_size, activation),
                     tiles, names, sources, launch), list(sources)


def wgmma_linear_kernel(n_out: int, n_in: int, dtype: str, bias: bool, residual: bool,
                        tiles: list[tuple[int, TileConfig | HopperTile]], weight: str = "float",
                        group_size: int = 0) -> tuple[tirx.PrimFunc, list[HopperGemm]]:
    """The PrimFunc (x, w, [scale, zeros], [bias], [residual], y) of a bf16/fp16 linear on Hopper,
    weights in their dtype or q4 (zeros: its scales times -8, selection/layouts.py Q4_ZEROS), and the
    Hopper GEMMs it calls. `tiles` (selection/tiles.py hopper_tiles): steps within an mma tile's rows
    launch that tile's kernel; larger ones call a Hopper GEMM variant (codegen/kernels/gpu/hopper_gemm.py)
    through call_packed, on TVM's stream, with absent operands passed as y (its epilogue code says
    which are real)."""
    small = [(rows, t) for rows, t in tiles if isinstance(t, TileConfig)]
    names, sources = linear_sources("mma", dtype, n_out, n_in, bias, residual, weight, group_size, None, small,
                                    lambda name, tile: kernel_source(name, dtype, tile, n_out, n_in, bias, residual,
                                                                     weight, group_size, None))
    variants = [HopperGemm(dtype, t, weight) for _, t in tiles if isinstance(t, HopperTile)]
    names += [v.name for v in variants]
    quantised = "scale, zeros, " if weight == "q4" else ""
    operands = f"x, w, {quantised}y, {'bias' if bias else 'y'}, {'residual' if residual else 'y'}, " \
               f"{(BIAS if bias else 0) | (RESIDUAL if residual else 0)}"

    def launch(name, tile, pointers, indent):
        if isinstance(tile, HopperTile):
            return [f"{indent}T.evaluate(T.call_packed(\"{name}\", {operands}))"]
        return _launch(name, tile, n_out, pointers, indent, weight)
    params, buffers, pointers = linear_signature(n_out, n_in, dtype, bias, residual, weight, group_size, None)
    if weight == "q4":          # CUTLASS's zeros after the scales; mma's kernels read only the scales
        params.insert(3, f"zeros: T.Buffer(({n_in // group_size}, {n_out}), \"float16\")")
    return prim_func(params, buffers, pointers, tiles, names, sources, launch), variants


def linear_sources(family: str, dtype: str, n_out: int, n_in: int, bias: bool, residual: bool, weight: str,
                   group_size: int, activation: str | None, configs, source) -> tuple[list[str], dict]:
    """Each config's kernel name (kiln_`family`_dtype_form_NxK_config_epilogue) in order, and each
    name's CUDA source, `source`(name, config); a config serving several rows buckets is built once."""
    suffix = ("_bias" if bias else "") + ("_residual" if residual else "") + (f"_{activation}" if activation else "")
    names, sources = [], {}
    for _, config in configs:
        names.append(f"kiln_{family}_{CTYPES[dtype][1]}{form_suffix(weight, group_size)}_{n_out}x{n_in}_"
                     f"{config.name}{suffix}")
        sources[names[-1]] = source(names[-1], config)
    return names, sources


def linear_signature(n_out: int, n_in: int, dtype: str, bias: bool, residual: bool, weight: str, group_size: int,
                     activation: str | None) -> tuple[list[str], list[str], list[str]]:
    """A linear PrimFunc's parameters (x, w, [scale], [bias], [residual], y), the match_buffer lines
    that bind its rows m, and the data pointers its kernels take."""
    params = ["var_x: T.handle", *weight_params(weight, dtype, n_out, n_in, group_size)]
    params += ([f"bias: T.Buffer(({n_out},), \"{dtype}\")"] if bias else []) \
        + (["var_residual: T.handle"] if residual else []) + ["var_y: T.handle"]
    buffers = [f"x = T.match_buffer(var_x, (m, {n_in}), \"{dtype}\")",
               f"y = T.match_buffer(var_y, (m, {n_out // 2 if activation else n_out}), \"{dtype}\")"]
    buffers += [f"residual = T.match_buffer(var_residual, (m, {n_out}), \"{dtype}\")"] if residual else []
    pointers = ["x.data", "w.data"] + (["scale.data"] if weight != "float" else []) \
        + (["bias.data"] if bias else []) + (["residual.data"] if residual else []) + ["y.data"]
    return params, buffers, pointers


def mma_experts_kernel(experts: int, n_out: int, n_in: int, dtype: str, tiles: list[tuple[int, TileConfig]],
                       weight: str, group_size: int, gather: bool, weighted: bool) -> tirx.PrimFunc:
    """A mixture of experts' grouped GEMM on tensor cores (codegen/lowering/moe.py: the rows sorted by expert):
    (x, [row_token], row_expert, w, [scale], [row_weight], y), y [rows, n_out]."""
    suffix = ("_gather" if gather else "") + ("_weighted" if weighted else "")
    sources, names = {}, []
    for _, tile in tiles:
        names.append(f"kiln_mma_experts_{CTYPES[dtype][1]}{form_suffix(weight, group_size)}_e{experts}_{n_out}x{n_in}_"
                     f"{tile.name}{suffix}")
        sources[names[-1]] = experts_kernel_source(names[-1], dtype, tile, n_out, n_in, weight, group_size, gather,
                                                   weighted)
    params = ["var_x: T.handle"] + (["var_row_token: T.handle"] if gather else []) + ["var_row_expert: T.handle"]
    params += weight_params(weight, dtype, n_out, n_in, group_size, experts)
    params += (["var_row_weight: T.handle"] if weighted else []) + ["var_y: T.handle"]
    buffers = [f"x = T.match_buffer(var_x, ({'T.int64()' if gather else 'm'}, {n_in}), \"{dtype}\")",
               "row_expert = T.match_buffer(var_row_expert, (m,), \"int32\")",
               f"y = T.match_buffer(var_y, (m, {n_out}), \"{dtype}\")"]
    buffers += ["row_token = T.match_buffer(var_row_token, (m,), \"int32\")"] if gather else []
    buffers += ["row_weight = T.match_buffer(var_row_weight, (m,), \"float32\")"] if weighted else []
    pointers = ["x.data"] + (["row_token.data"] if gather else []) + ["row_expert.data", "w.data"] \
        + (["scale.data"] if weight != "float" else []) + (["row_weight.data"] if weighted else []) + ["y.data"]
    launch = lambda name, tile, ptrs, indent: _launch(name, tile, n_out, ptrs, indent, weight)      # noqa: E731
    return prim_func(params, buffers, pointers, tiles, names, sources, launch)


def _dispatch(tiles, names, pointers: list[str], launch) -> list[str]:
    """The host side: nothing for no rows (a grid of no blocks is a launch error), else the first
    tile whose rows bound covers the step's rows m, the last for the rest."""
    lines = ["    if m > 0:"]
    for index, ((rows, tile), name) in enumerate(zip(tiles, names)):
        last = index == len(tiles) - 1
        keyword = "else:" if last else f"{'elif' if index else 'if'} m <= {rows}:"
        branch = [] if last and index == 0 else [f"        {keyword}"]
        lines += branch + launch(name, tile, pointers, "            " if branch else "        ")
    return lines
