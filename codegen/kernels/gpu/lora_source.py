"""CUDA source of kiln's LoRA kernel (ir/lora_ops.py), for codegen/kernels/gpu/lora.py: a thread block per
TILE rows of the step (blockIdx.y), in place on y.

The block takes its rows in runs that share a slot: a decode step's rows, each on its own adapter, are
runs of one (Punica's BGMV); a prompt's rows are runs of up to TILE (its SGMV: the run reads each of
the adapter's elements once). For a run on slot s (-1: skipped, the rows unchanged):
- the shrink h = a[s] · x[row] into shared memory: each warp takes rank rows in turn, its lanes walk the
  inputs 32 apart (a warp's loads of a row of a are contiguous), a sum per row of the run, met through
  shuffles;
- the expand y[row, n] += Σ_r h[j·R + r] · b[s, r, n] for the columns n of module j: a thread a column,
  THREADS apart (a warp's loads of a row of b contiguous), the rank the inner loop.
Both in float32 (a run's sums in registers: its loops unrolled to TILE); y is rounded once. The modules'
end columns are template constants (at most 3 modules: a fused qkv).
"""
from __future__ import annotations

from .mma_source import CTYPES

LORA_TEMPLATE = r"""
#ifndef KILN_LORA
#define KILN_LORA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
namespace kiln_lora {
// p over the run's rows, unrolled to TILE so that a run's sums stay in registers
#define EACH_ROW_OF_RUN(p) _Pragma("unroll") for (int p = 0; p < TILE; ++p) if (p < run)
__device__ __forceinline__ float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float as_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T rounded(float v);
template <> __device__ __forceinline__ __nv_bfloat16 rounded<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half rounded<__half>(float v) { return __float2half_rn(v); }

template <typename T, int IN, int OUT, int RANK, int MODULES, int END0, int END1, int THREADS, int TILE>
__device__ __forceinline__ void lora(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ a,
                                     const T* __restrict__ b, const int* __restrict__ slots, int M, float* h) {
  const int first = blockIdx.y * TILE;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int q = 0; q < TILE && first + q < M;) {
    const int slot = slots[first + q];
    int run = 1;                                         // the rows after q on the same slot join its run
    while (q + run < TILE && first + q + run < M && slots[first + q + run] == slot) ++run;
    if (slot >= 0) {
      const T* xr = x + static_cast<size_t>(first + q) * IN;
      const T* as = a + static_cast<size_t>(slot) * MODULES * RANK * IN;
      for (int r = warp; r < MODULES * RANK; r += THREADS / 32) {
        float sum[TILE] = {};
        for (int k = lane; k < IN; k += 32) {
          const float w = as_float(as[static_cast<size_t>(r) * IN + k]);
          EACH_ROW_OF_RUN(p) sum[p] += as_float(xr[static_cast<size_t>(p) * IN + k]) * w;
        }
        EACH_ROW_OF_RUN(p) {
          for (int offset = 16; offset > 0; offset >>= 1) sum[p] += __shfl_xor_sync(0xFFFFFFFFu, sum[p], offset);
          if (lane == 0) h[p * MODULES * RANK + r] = sum[p];
        }
      }
      __syncthreads();
      const T* bs = b + static_cast<size_t>(slot) * RANK * OUT;
      for (int n = threadIdx.x; n < OUT; n += THREADS) {
        const int module = (MODULES > 1 && n >= END0) + (MODULES > 2 && n >= END1);
        float acc[TILE];
        T* yr = y + static_cast<size_t>(first + q) * OUT + n;
        EACH_ROW_OF_RUN(p) acc[p] = as_float(yr[static_cast<size_t>(p) * OUT]);
        for (int r = 0; r < RANK; ++r) {
          const float w = as_float(bs[static_cast<size_t>(r) * OUT + n]);
          EACH_ROW_OF_RUN(p) acc[p] += h[(p * MODULES + module) * RANK + r] * w;
        }
        EACH_ROW_OF_RUN(p) yr[static_cast<size_t>(p) * OUT] = rounded<T>(acc[p]);
      }
      __syncthreads();                                   // h is the next run's
    }
    q += run;
  }
}
}  // namespace kiln_lora
#undef EACH_ROW_OF_RUN
#endif
"""

THREADS = 256
TILE = 4                # rows a block takes; a run of rows on one slot reads the adapter once


def lora_name(dtype: str, n_in: int, rows: tuple[int, ...], rank: int, slots: int) -> str:
    return f"kiln_lora_{CTYPES[dtype][1]}_{n_in}x{'_'.join(map(str, rows))}_r{rank}_s{slots}"


def shared_bytes(rows: tuple[int, ...], rank: int) -> int:
    """The shrink's rank rows of a run's rows, in float32."""
    return TILE * len(rows) * rank * 4


def lora_source(dtype: str, n_in: int, rows: tuple[int, ...], rank: int, slots: int) -> str:
    """The device function kiln_lora_…(y, x, a, b, slots, M, shared) of one projection's adapters."""
    if not 1 <= len(rows) <= 3:
        raise ValueError(f"the CUDA LoRA kernel takes 1 to 3 modules a projection, not {len(rows)}")
    ctype = CTYPES[dtype][0]
    ends = [sum(rows[:j + 1]) for j in range(len(rows))] + [sum(rows)] * 2
    template = (f"kiln_lora::lora<{ctype}, {n_in}, {sum(rows)}, {rank}, {len(rows)}, {ends[0]}, {ends[1]}, "
                f"{THREADS}, {TILE}>")
    name = lora_name(dtype, n_in, rows, rank, slots)
    return (LORA_TEMPLATE + f"\n__device__ __forceinline__ void {name}(void* y, const void* x, const void* a, "
            f"const void* b, const void* slots, int M, void* shared) {{\n"
            f"  {template}(static_cast<{ctype}*>(y), static_cast<const {ctype}*>(x), static_cast<const {ctype}*>(a), "
            f"static_cast<const {ctype}*>(b), static_cast<const int*>(slots), M, static_cast<float*>(shared));\n}}\n")
