"""The CUDA decode GEMV: kiln's own streaming kernel for linears in decode steps of few rows.

One PrimFunc per linear shape, as codegen/kernels/gpu/mma_gemm.py builds them: its host side picks a kernel
by the step's rows (batch 1, up to 4, more: MB = 1, 4, 8 rows of x a pass: gemv_tuning.BATCH_BUCKETS)
and launches it over N / R thread blocks; each kernel is CUDA source (gemv_source.py) that TIR calls, so it
runs on TVM's stream and the decode CUDA graphs capture it.

Rows a block and threads a block by shape: codegen/kernels/gpu/gemv_tuning.py.
"""
from __future__ import annotations

from tvm import tirx

from .gemv_source import GemvConfig, gemv_source
from .gemv_tuning import default_configs
from .mma_gemm import launch_lines, linear_signature, linear_sources, prim_func

def gemv_kernel(n_out: int, n_in: int, dtype: str, bias: bool, residual: bool, weight: str = "float",
                group_size: int = 0, activation: str | None = None,
                configs: list[tuple[int, GemvConfig]] | None = None,
                arch: str | None = None) -> tuple[tirx.PrimFunc, list[str]]:
    """The PrimFunc (x, w, [scale], [bias], [residual], y) and its kernels' names; arguments as
    codegen/kernels/gpu/mma_gemm.py's mma_linear_kernel, `configs` (up to rows, config) ascending (default:
    `default_configs` for `arch`)."""
    configs = configs or default_configs(n_out, n_in, weight, bool(activation), arch, group_size)
    names, sources = linear_sources("gemv", dtype, n_out, n_in, bias, residual, weight, group_size, activation, configs,
                                    lambda name, config: gemv_source(name, dtype, config, n_out, n_in, bias, residual,
                                                                     weight, group_size, activation))

    def launch(name, config, ptrs, indent):
        return launch_lines(name, n_out // config.rows, 0, config.threads, config.shared_bytes(), ptrs, indent)
    return prim_func(*linear_signature(n_out, n_in, dtype, bias, residual, weight, group_size, activation),
                     configs, names, sources, launch), list(sources)
