"""CUDA source of kiln's decode GEMV (a step of few rows), for codegen/kernels/gpu/gemv.py.

y = epilogue(x @ W.T) for x [M, K] (M small: a decode step's sequences) and W [N, K] row-major,
stored as bf16/fp16, int8 levels or e4m3 codes with a scale per output (q8, fp8), or q4 nibbles
(inputs k, k + 1 in one byte, the even one low) with fp16 scales [K / G, N] per group of G inputs
(q4a, q4k: with minimums, their tables as ir/quant.py stores them).
A decode step reads every weight once, so the kernel is built to stream them:
- every weight load is 16 bytes (`ld.global.nc.L1::no_allocate`: read once, past L1), and a warp's
  32 loads cover 512 contiguous bytes of one row;
- a thread block owns R neighbouring output rows and splits the reduction K over all its THREADS
  threads (split-K within the block: a narrow output of 512 rows still fills every SM with warps),
  each thread walking its 16-byte chunks of the R rows, so R x (K / chunk / THREADS) loads are in
  flight per thread; partial sums meet through warp shuffles and shared memory;
- stored codes are turned into floats in registers: bf16 by a shift, q8 by OR-ing the level into a
  float's mantissa (no integer conversion), fp8 through fp16 pairs, q4 two nibbles at a time as the
  bf16 pair 128 + nibble (one mask-and-OR, then a shift or a mask each); a q4 chunk (32 inputs) lies
  in one group, so its scale is read once per chunk and multiplies the chunk's sum, less 136 times
  the activations' sum (float32 keeps that difference to about 2^-17 of the sum, far below the
  output's rounding); q4a's and q4k's nibbles are the levels (128 times the sum away), and the chunk
  adds the activations' sum times its group's minimum;
- the M rows of x go MB at a time (MB 1 for batch 1), so each weight chunk is read once per MB rows.
The epilogue is codegen/kernels/weight_format.py's: float32 sum (times the q8/fp8 scale), + bias, round, + residual,
round; with ACT (a gated MLP's gate/up, rows interleaved gate 0, up 0, ...: selection/layouts.py
'gated') the output is act(gate) * up, as codegen/kernels/gpu/mma_source.py computes it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .mma_source import ACTIVATION_CODES, CTYPES, HELPERS, WEIGHT_CODES, linear_call, wrapper


@dataclass(frozen=True)
class GemvConfig:
    """R output rows a block, THREADS threads a block, MB rows of x a pass."""
    rows: int
    threads: int
    batch: int

    @property
    def name(self) -> str:
        return f"r{self.rows}t{self.threads}b{self.batch}"

    def shared_bytes(self) -> int:
        """The partial sums of each warp: [warps][MB x R] floats."""
        return self.threads // 32 * self.batch * self.rows * 4

    def check(self) -> None:
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"GEMV {self.name}: threads must be whole warps, 32 to 1024")
        if self.batch * self.rows > self.threads:
            raise ValueError(f"GEMV {self.name}: each of the MB x R sums needs a thread to write it")


# the one PTX instruction the GEMV issues itself (tests/mma_emulator.h emulates it)
GEMV_PTX = r"""
// 16 weight bytes, read once: not kept in L1, where the activations stay
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
"""

# the kernel, in namespace kiln_gemv over GEMV_PTX and codegen/kernels/gpu/mma_source.py's conversions
GEMV_TEMPLATE = r"""
using kiln_mma::to_float;
using kiln_mma::from_float;
using kiln_mma::group_scale_minimum;

__device__ __forceinline__ uint4 load_cached(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// the two 16-bit values of a word as floats
template <typename T> __device__ __forceinline__ float low(unsigned u);
template <typename T> __device__ __forceinline__ float high(unsigned u);
template <> __device__ __forceinline__ float low<__nv_bfloat16>(unsigned u) { return __uint_as_float(u << 16); }
template <> __device__ __forceinline__ float high<__nv_bfloat16>(unsigned u) { return __uint_as_float(u & 0xFFFF0000u); }
template <> __device__ __forceinline__ float low<__half>(unsigned u) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xFFFFu)));
}
template <> __device__ __forceinline__ float high<__half>(unsigned u) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(u >> 16)));
}

// 8 activations (16 bytes) as floats
template <typename T> __device__ __forceinline__ void activations(float* out, uint4 v) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) { out[2 * i] = low<T>(words[i]); out[2 * i + 1] = high<T>(words[i]); }
}

// a byte (0..255) as a float: the byte ORed under 2^23's mantissa, 2^23 taken away (exact)
__device__ __forceinline__ float byte_value(unsigned b) { return __uint_as_float(0x4B000000u | b) - 8388608.f; }

// the 8 weights of inputs k0 + 8 p .. k0 + 8 p + 7 of a stored 16-byte chunk, as floats: the
// integer level for q8, the value for float and fp8, and for q4, q4a and q4k the nibble + 128 (q4's
// level + 136, the others' + 128: the chunk's sums take that many times the activations' sum away, gemv below)
template <typename T, int WFMT> __device__ __forceinline__ void weights(float* out, uint4 chunk, int p) {
  const unsigned words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  if constexpr (WFMT == 0) {                    // 2 a word: 4 words a piece, one piece a chunk
#pragma unroll
    for (int i = 0; i < 4; ++i) { out[2 * i] = low<T>(words[i]); out[2 * i + 1] = high<T>(words[i]); }
  } else if constexpr (WFMT == 1) {             // int8: 4 a word, 2 words a piece
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const unsigned u = words[2 * p + i] ^ 0x80808080u;       // + 128: 0..255
#pragma unroll
      for (int b = 0; b < 4; ++b) out[4 * i + b] = byte_value((u >> (8 * b)) & 0xFFu) - 128.f;
    }
  } else if constexpr (WFMT == 2) {             // e4m3: 4 a word, as fp16 pairs (exact)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const unsigned u = words[2 * p + i];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned pair = kiln_mma::fp8_pair<__half>(u >> (16 * h));
        out[4 * i + 2 * h] = low<__half>(pair);
        out[4 * i + 2 * h + 1] = high<__half>(pair);
      }
    }
  } else {                                      // nibbles: 8 a word, one word a piece, as 128 + the nibble
    const unsigned u = words[p];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      // inputs s and s + 4 (bytes 0 and 2, or 1 and 3, of the word) as the bf16 pair 128 + nibble:
      // each nibble ORed under the mantissa of 128, a mask and an OR in one instruction
      const unsigned pair = ((u >> (4 * s)) & 0x000F000Fu) | 0x43004300u;
      out[s] = __uint_as_float(pair << 16);
      out[s + 4] = __uint_as_float(pair & 0xFFFF0000u);
    }
  }
}

// the sum of v over a warp's 32 lanes, in every lane
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, mask);
  return v;
}

// ACT: 0 none, 1 silu, 2 gelu_tanh (then R is even: rows 2i, 2i + 1 are gate and up of output i)
template <typename T, int WFMT, int G, int R, int MB, int THREADS, bool BIAS, bool RESIDUAL, int ACT>
__device__ __forceinline__ void gemv(const T* __restrict__ x, const void* __restrict__ w_any,
                                     const void* __restrict__ scale_any, const T* __restrict__ bias,
                                     const T* __restrict__ residual, T* __restrict__ y, int M, int N, int K,
                                     float* partial) {
  constexpr int BITS = WFMT == 0 ? 16 : WFMT >= 3 ? 4 : 8;
  constexpr int PER_CHUNK = 128 / BITS;          // inputs a 16-byte load covers
  constexpr int PIECES = PER_CHUNK / 8;          // 8-input pieces a chunk
  constexpr int WARPS = THREADS / 32;
  const unsigned char* w = static_cast<const unsigned char*>(w_any);
  const size_t row_bytes = (size_t)K * BITS / 8;
  const int chunks = K / PER_CHUNK;
  const int j0 = blockIdx.x * R;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  for (int m0 = 0; m0 < M; m0 += MB) {
    float acc[MB][R];
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[b][r] = 0.f;

#pragma unroll 2
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
      uint4 chunk[R];
#pragma unroll
      for (int r = 0; r < R; ++r) chunk[r] = load_stream(w + (size_t)(j0 + r) * row_bytes + (size_t)c * 16);
      const int k0 = c * PER_CHUNK;
      float group[MB][R], xsum[MB];               // nibbles: the chunk's sums before its group scale, x's sum
#pragma unroll
      for (int b = 0; b < MB; ++b) {
        xsum[b] = 0.f;
#pragma unroll
        for (int r = 0; r < R; ++r) group[b][r] = 0.f;
      }
#pragma unroll
      for (int p = 0; p < PIECES; ++p) {
        float wv[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) weights<T, WFMT>(wv[r], chunk[r], p);
#pragma unroll
        for (int b = 0; b < MB; ++b) {
          if (MB > 1 && m0 + b >= M) break;
          float xv[8];
          activations<T>(xv, load_cached(x + (size_t)(m0 + b) * K + k0 + 8 * p));
          if constexpr (WFMT >= 3) {
#pragma unroll
            for (int e = 0; e < 8; ++e) xsum[b] += xv[e];
          }
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              if constexpr (WFMT >= 3) group[b][r] = fmaf(xv[e], wv[r][e], group[b][r]);
              else acc[b][r] = fmaf(xv[e], wv[r][e], acc[b][r]);
            }
        }
      }
      if constexpr (WFMT == 3) {
        const __half* scale = static_cast<const __half*>(scale_any) + (size_t)(k0 / G) * N + j0;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float s = __half2float(scale[r]);
#pragma unroll
          for (int b = 0; b < MB; ++b) acc[b][r] = fmaf(fmaf(-136.f, xsum[b], group[b][r]), s, acc[b][r]);
        }
      } else if constexpr (WFMT >= 4) {           // q4a, q4k: + x's sum times the group's minimum
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float2 p = group_scale_minimum<WFMT>(scale_any, k0 / G, N, j0 + r);
#pragma unroll
          for (int b = 0; b < MB; ++b)
            acc[b][r] = fmaf(xsum[b], p.y, fmaf(fmaf(-128.f, xsum[b], group[b][r]), p.x, acc[b][r]));
        }
      }
    }

    // the block's sums: each warp's through shuffles, then the warps' through shared memory
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[b][r]);
        if (lane == 0) partial[warp * MB * R + b * R + r] = v;
      }
    __syncthreads();
    const int t = threadIdx.x;
    const int b = t / R, r = t % R, row = m0 + b;
    float v = 0.f;
    if (t < MB * R) {
#pragma unroll
      for (int i = 0; i < WARPS; ++i) v += partial[i * MB * R + t];
      if constexpr (WFMT == 1 || WFMT == 2) v *= static_cast<const float*>(scale_any)[j0 + r];
    }
    if constexpr (ACT != 0) {
      // gate (even r) and up (r + 1) sit in neighbouring threads
      const T rounded = from_float<T>(v);
      const float up = to_float(from_float<T>(__shfl_down_sync(0xFFFFFFFFu, v, 1)));
      if (t < MB * R && r % 2 == 0 && row < M) {
        const float gate = to_float(rounded);
        const float act = ACT == 1 ? gate / (1.f + expf(-gate))
                                   : 0.5f * gate * (1.f + tanhf(0.7978845608028654f * (gate + 0.044715f * gate * gate * gate)));
        y[(size_t)row * (N / 2) + (j0 + r) / 2] = from_float<T>(to_float(from_float<T>(act)) * up);
      }
    } else if (t < MB * R && row < M) {
      const int col = j0 + r;
      if (BIAS) v += to_float(bias[col]);
      T out = from_float<T>(v);
      if (RESIDUAL) out = from_float<T>(to_float(out) + to_float(residual[(size_t)row * N + col]));
      y[(size_t)row * N + col] = out;
    }
    __syncthreads();                              // the next pass writes `partial` again
  }
}
"""

GEMV_HELPERS = (HELPERS + "\n#ifndef KILN_GEMV\n#define KILN_GEMV\nnamespace kiln_gemv {\n" + GEMV_PTX + GEMV_TEMPLATE
                + "\n}  // namespace kiln_gemv\n#endif\n")


def gemv_source(name: str, dtype: str, config: GemvConfig, n_out: int, n_in: int, bias: bool, residual: bool,
                weight: str = "float", group_size: int = 0, activation: str | None = None) -> str:
    """The device function `name`(x, w, [scale], [bias], [residual], y, M, shared) of one linear's
    decode GEMV; arguments as codegen/kernels/gpu/mma_source.py's kernel_source."""
    config.check()
    if activation and (bias or residual or config.rows % 2):
        raise ValueError("a gated GEMV takes no bias or residual, and an even number of rows a block")
    ctype = CTYPES[dtype][0]
    params, args = linear_call(ctype, weight, bias, residual, n_out, n_in, "float")
    template = (f"kiln_gemv::gemv<{ctype}, {WEIGHT_CODES[weight]}, {group_size or 1}, {config.rows}, "
                f"{config.batch}, {config.threads}, {str(bias).lower()}, {str(residual).lower()}, "
                f"{ACTIVATION_CODES[activation]}>")
    return GEMV_HELPERS + wrapper(name, params, template, args)
