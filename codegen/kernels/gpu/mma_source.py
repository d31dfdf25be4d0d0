"""CUDA source of kiln's tensor-core GEMM tile (sm_80 and newer), for codegen/kernels/gpu/mma_gemm.py.

One thread block computes a [BM, BN] tile of y = epilogue(x @ W.T): x [M, K] and W [N, K] are
row-major bf16 or fp16 (K contiguous, so W is already the `col` operand mma.sync wants), the
accumulators are float32. The block's warps form a WM x WN grid; each warp owns a
[BM / WM, BN / WN] piece of the tile and issues `mma.sync.m16n8k16` on fragments that `ldmatrix`
reads from shared memory. Tiles of BK inputs stream from global memory through STAGES shared-memory
buffers with `cp.async` (16 bytes a copy, rows past M zero-filled), so the copies of the next
tiles overlap the multiplies of this one. Shared rows are swizzled by 16-byte chunk (the chunk
index XOR the row's position in its 128-byte line group) so that neither the copies nor
`ldmatrix`'s eight row reads of a matrix hit one bank twice.

The epilogue is the one `codegen/kernels/weight_format.py: epilogue` states: float32 sum, + bias, round to the
activation dtype, + residual in float32, round again.

The helpers and the template are emitted once per CUDA module (a guard macro); each kernel adds a
small wrapper that fixes the template's parameters.
"""
from __future__ import annotations

from kiln.selection.tiles import ELEMENT_BYTES, TileConfig

MMA_K = 16                  # mma.sync.m16n8k16: k per instruction
CHUNK = 16 // ELEMENT_BYTES  # elements per 16-byte cp.async / ldmatrix row


CTYPES = {"bfloat16": ("__nv_bfloat16", "bf16"), "float16": ("__half", "f16")}
# the template's code for each weight format (selection/formats.py WeightFormat kinds)
WEIGHT_CODES = {"float": 0, "q8": 1, "fp8": 2, "q4": 3, "q4a": 4, "q4k": 5}

# the PTX the kernel issues: shared-memory addresses, asynchronous copies, ldmatrix, mma.sync
PTX_PRIMITIVES = r"""
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros and reads nothing
__device__ __forceinline__ void copy16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING> __device__ __forceinline__ void wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory");     // shared reads stay after it
}

__device__ __forceinline__ void ldmatrix4(unsigned* r, unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

template <typename T> __device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b);
template <> __device__ __forceinline__ void mma<__nv_bfloat16>(float* c, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma<__half>(float* c, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"""

# the kernel over those primitives and CUDA's half / bf16 intrinsics (tests/mma_emulator.h runs it
# on the CPU with the primitives emulated as PTX specifies them)
KERNEL_TEMPLATES = r"""
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// rows [row0, row0 + ROWS) of a matrix with `pitch` bytes a row, ROW_BYTES from byte `col0`, into
// shared rows STRIDE bytes apart (weights: every row exists)
template <int ROWS, int ROW_BYTES, int STRIDE, int THREADS>
__device__ __forceinline__ void load_bytes(unsigned char* tile, const unsigned char* src, int row0, size_t pitch,
                                           size_t col0) {
  constexpr int CHUNKS = ROW_BYTES / 16;
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
    int row = i / CHUNKS, chunk = i % CHUNKS;
    copy16(shared_address(tile + row * STRIDE + chunk * 16), src + (row0 + row) * pitch + col0 + chunk * 16, 16);
  }
}

// two stored weights (inputs k, k + 1 of one output) as the activations' type, packed for mma.sync;
// every conversion is exact: levels are small integers, e4m3 values have 4 significant bits within
// both types' range
template <typename T> __device__ __forceinline__ unsigned pack(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
// e4m3 pair (bits 0-7, 8-15): each byte's exponent and mantissa moved under T's (exponent bias 15 for
// half, 127 for bf16, against e4m3's 7), then one packed multiply by 2^8 or 2^120 restores the value,
// subnormals included
template <typename T> __device__ __forceinline__ unsigned fp8_pair(unsigned u);
template <> __device__ __forceinline__ unsigned fp8_pair<__half>(unsigned u) {
  unsigned r = ((u & 0x7Fu) << 7) | ((u & 0x80u) << 8) | ((u & 0x7F00u) << 15) | ((u & 0x8000u) << 16);
  __half2 v = __hmul2(*reinterpret_cast<__half2*>(&r), __half2half2(__float2half_rn(256.f)));
  return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned fp8_pair<__nv_bfloat16>(unsigned u) {
  unsigned r = ((u & 0x7Fu) << 4) | ((u & 0x80u) << 8) | ((u & 0x7F00u) << 12) | ((u & 0x8000u) << 16);
  __nv_bfloat162 v = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&r), __bfloat162bfloat162(__float2bfloat16_rn(0x1p120f)));
  return *reinterpret_cast<unsigned*>(&v);
}
// small integers u0, u1 < 128 (bits 0-7 and 16-23 of u) minus `bias`, packed as T: OR-ing them into the
// mantissa of 1024 (half) or 128 (bf16) makes 1024 + u exactly, and one packed subtraction the rest
template <typename T> __device__ __forceinline__ unsigned minus(unsigned u, int bias);
template <> __device__ __forceinline__ unsigned minus<__half>(unsigned u, int bias) {
  unsigned r = u | 0x64006400u;
  __half2 v = __hsub2(*reinterpret_cast<__half2*>(&r), __half2half2(__int2half_rn(1024 + bias)));
  return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned minus<__nv_bfloat16>(unsigned u, int bias) {
  unsigned r = u | 0x43004300u;
  __nv_bfloat162 v = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&r), __bfloat162bfloat162(__int2bfloat16_rn(128 + bias)));
  return *reinterpret_cast<unsigned*>(&v);
}
// q8 as half: the byte + 128 (its sign bit flipped) is below 256, exact beside 1024; bf16 has 8 bits
template <typename T> __device__ __forceinline__ unsigned q8_pair(unsigned short v);
template <> __device__ __forceinline__ unsigned q8_pair<__half>(unsigned short v) {
  unsigned u = v ^ 0x8080u;
  return minus<__half>((u & 0xFFu) | ((u & 0xFF00u) << 8), 128);
}
template <> __device__ __forceinline__ unsigned q8_pair<__nv_bfloat16>(unsigned short v) {
  return pack<__nv_bfloat16>(float(static_cast<signed char>(v & 0xFF)), float(static_cast<signed char>(v >> 8)));
}
// q4, q4a, q4k: the byte of inputs k (low nibble) and k + 1, q4's levels the nibbles less 8, the others'
// the nibbles; q8 and fp8: the two bytes of k and k + 1
template <typename T, int WFMT> __device__ __forceinline__ unsigned weight_pair(const unsigned char* p) {
  if constexpr (WFMT >= 3) {
    unsigned b = p[0];
    return minus<T>((b & 0xFu) | ((b & 0xF0u) << 12), WFMT == 3 ? 8 : 0);
  } else if constexpr (WFMT == 1) {
    return q8_pair<T>(*reinterpret_cast<const unsigned short*>(p));
  } else {
    return fp8_pair<T>(*reinterpret_cast<const unsigned short*>(p));
  }
}

// group g's scale (x) and minimum (y) at output n of an [rows, N] table (ir/quant.py): q4a's half rows 2g
// and 2g + 1; q4k's 6-bit scale and depth (bytes in rows 20 (g / 8) + 2 (g % 8) and the next) times
// its super-block's half factors d and -dmin (their bytes, low first, in rows 20 (g / 8) + 16 .. 19)
template <int WFMT> __device__ __forceinline__ float2 group_scale_minimum(const void* table, size_t g, int N, int n) {
  if constexpr (WFMT == 4) {
    const __half* t = static_cast<const __half*>(table);
    return make_float2(__half2float(t[2 * g * N + n]), __half2float(t[(2 * g + 1) * N + n]));
  } else {
    const unsigned char* t = static_cast<const unsigned char*>(table);
    const size_t base = g / 8 * 20, row = base + 2 * (g % 8);
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(
        t[(base + 16) * N + n] | (t[(base + 17) * N + n] << 8))));
    const float negative_dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(
        t[(base + 18) * N + n] | (t[(base + 19) * N + n] << 8))));
    return make_float2(d * float(t[row * N + n]), negative_dmin * float(t[(row + 1) * N + n]));
  }
}

// element offset of (row, 16-byte chunk) in a [rows, BK] tile, chunks swizzled within 128-byte lines
template <int BK> __device__ __forceinline__ int swizzled(int row, int chunk) {
  constexpr int CHUNKS = BK / 8;               // 16-byte chunks per row
  constexpr int ROWS_PER_LINE = 8 / CHUNKS;    // rows sharing one 128-byte line of banks
  return row * BK + ((chunk ^ ((row / ROWS_PER_LINE) % CHUNKS)) * 8);
}

// rows [row0, row0 + ROWS) x inputs [k0, k0 + BK) of a row-major [*, K] matrix into a swizzled tile;
// rows at or past `rows` are zero-filled, and with `row_expert` the rows of other experts than
// `expert`; with `row_token` row r reads source row row_token[r]
template <int ROWS, int BK, int THREADS, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int row0, int rows, int K, int k0,
                                          const int* row_token = nullptr, const int* row_expert = nullptr,
                                          int expert = 0) {
  constexpr int CHUNKS = BK / 8;
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
    int row = i / CHUNKS, chunk = i % CHUNKS;
    bool inside = row0 + row < rows && (row_expert == nullptr || row_expert[row0 + row] == expert);
    int source = !inside ? 0 : row_token ? row_token[row0 + row] : row0 + row;
    const T* from = src + (size_t)source * K + k0 + chunk * 8;
    copy16(shared_address(tile + swizzled<BK>(row, chunk)), from, inside ? 16 : 0);
  }
}

// WFMT 0: w is T [N, K]; 1: int8 levels [N, K] and 2: e4m3 [N, K], each times scale[n] (float32) in the
// epilogue; 3: q4 nibbles [N, K / 2] (input k in byte k / 2, high nibble when k is odd, level = nibble
// - 8), each group of G inputs summed apart and then times scale[k / G, n] (half); 4 (q4a) and 5 (q4k):
// nibbles that are the levels, each group's sums times its scale plus x's sum over the group (an mma
// against ones) times its minimum (group_scale_minimum).
// EXPERTS (a mixture of experts' grouped GEMM, rows sorted by expert): row r multiplies expert
// row_expert[r]'s weights ([E, N, K'] and scales [E, ...]); a block whose rows span several experts
// runs one pass per expert with the other rows zeroed, each pass's sums scaled by its expert's
// scales. With row_token row r reads x[row_token[r]]; with row_weight its output, rounded, is
// multiplied by row_weight[r] and rounded again.
// ACT 1 (silu) or 2 (gelu_tanh): the weights' rows are a gated MLP's gate and up interleaved
// (selection/layouts.py 'gated'), and output column c / 2 is act(gate) * up of columns c and c + 1, each
// step rounded as the swiglu / geglu op rounds it; y is [M, N / 2].
template <typename T, int WFMT, int G, int BM, int BN, int BK, int WM, int WN, int STAGES, bool BIAS, bool RESIDUAL,
          bool EXPERTS = false, int ACT = 0>
__device__ __forceinline__ void gemm(const T* __restrict__ x, const void* __restrict__ w_any,
                                     const void* __restrict__ scale_any, const T* __restrict__ bias,
                                     const T* __restrict__ residual, T* __restrict__ y, int M, int N, int K,
                                     unsigned char* shared, const int* __restrict__ row_token = nullptr,
                                     const int* __restrict__ row_expert = nullptr,
                                     const float* __restrict__ row_weight = nullptr) {
  constexpr int THREADS = 32 * WM * WN;
  constexpr int MT = BM / WM / 16;             // 16-row fragments per warp
  constexpr int NT = BN / WN / 8;              // 8-column fragments per warp
  constexpr int W_BITS = WFMT == 0 ? 16 : WFMT >= 3 ? 4 : 8;
  constexpr bool MINIMUMS = WFMT >= 4;         // q4a, q4k (never an expert's: passes/quantize.py)
  static_assert(!(EXPERTS && MINIMUMS), "experts are q4, not q4a or q4k");
  constexpr int W_ROW = BK * W_BITS / 8;                      // bytes of a weight row in one tile
  constexpr int W_STRIDE = WFMT == 0 ? W_ROW : W_ROW + 16;    // quantised rows padded against bank conflicts
  T* a_tiles = reinterpret_cast<T*>(shared);
  unsigned char* b_tiles = shared + STAGES * BM * BK * sizeof(T);
  const size_t w_pitch = (size_t)K * W_BITS / 8;
  // a pass's sums are scaled apart: nibbles by group, an expert's q8 / fp8 by expert
  constexpr bool GROUPED = WFMT >= 3 || (EXPERTS && WFMT != 0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = (warp / WN) * (BM / WM), warp_col = (warp % WN) * (BN / WN);
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int tiles = K / BK;

  float acc[MT][NT][4], group[MT][NT][4];     // group: the sums within the current group
  float x_sum[MT][4];                          // q4a, q4k: each row's sum of x over the current group
  const unsigned one = pack<T>(1.f, 1.f);
  const unsigned ones[2] = {one, one};
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x_sum[i][e] = 0.f;
#pragma unroll
      for (int j = 0; j < NT; ++j) acc[i][j][e] = group[i][j][e] = 0.f;
    }

  int expert = EXPERTS ? row_expert[m0] : 0;
  const int last_row = min(m0 + BM, M) - 1;
  for (;;) {                                   // one pass per expert among the block's rows
  const unsigned char* w_bytes = static_cast<const unsigned char*>(w_any) + (size_t)expert * N * w_pitch;
  const T* w = reinterpret_cast<const T*>(w_bytes);
  const void* scale_of = static_cast<const unsigned char*>(scale_any) +
      (WFMT == 3 ? (size_t)expert * (K / G) * N * 2 : (size_t)expert * N * 4);
// a pipeline stage: tile `tile` of x's rows and of the weights into slot `slot`
#define KILN_MMA_LOAD(slot, tile)                                                                              \
  do {                                                                                                         \
    load_tile<BM, BK, THREADS>(a_tiles + (slot) * BM * BK, x, m0, M, K, (tile) * BK, row_token,                \
                               EXPERTS ? row_expert : nullptr, expert);                                        \
    if constexpr (WFMT == 0)                                                                                   \
      load_tile<BN, BK, THREADS>(reinterpret_cast<T*>(b_tiles) + (slot) * BN * BK, w, n0, N, K, (tile) * BK);   \
    else                                                                                                       \
      load_bytes<BN, W_ROW, W_STRIDE, THREADS>(b_tiles + (slot) * BN * W_STRIDE, w_bytes, n0, w_pitch,         \
                                               (size_t)(tile) * W_ROW);                                        \
  } while (0)
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < tiles) KILN_MMA_LOAD(s, s);
    commit();                                  // one group per stage, empty or not: wait counts groups
  }

  for (int t = 0; t < tiles; ++t) {
    wait<STAGES - 2>();                        // tile t has landed
    __syncthreads();                           // ... for every thread, and tile t - 1 is consumed
    const int next = t + STAGES - 1;
    if (next < tiles) KILN_MMA_LOAD(next % STAGES, next);
    commit();
    const T* a_tile = a_tiles + (t % STAGES) * BM * BK;
    const unsigned char* b_tile = b_tiles + (t % STAGES) * BN * W_STRIDE;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned a[MT][4], b[NT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i)             // x4: rows 0-7 / 8-15 at k 0-7, then at k 8-15
        ldmatrix4(a[i], shared_address(a_tile + swizzled<BK>(warp_row + i * 16 + lane % 16, kk * 2 + lane / 16)));
      if constexpr (WFMT == 0) {
#pragma unroll
        for (int j = 0; j < NT; j += 2) {      // x4: columns 0-7 at k 0-7 / 8-15, then columns 8-15
          unsigned r[4];
          ldmatrix4(r, shared_address(reinterpret_cast<const T*>(b_tile) +
                                      swizzled<BK>(warp_col + j * 8 + (lane / 16) * 8 + lane % 8,
                                                   kk * 2 + (lane / 8) % 2)));
          b[j][0] = r[0]; b[j][1] = r[1]; b[j + 1][0] = r[2]; b[j + 1][1] = r[3];
        }
      } else {
#pragma unroll
        for (int j = 0; j < NT; ++j)           // the fragment's column lane / 4, inputs 2 (lane % 4) (+ 8) and + 1
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int k = kk * 16 + h * 8 + (lane % 4) * 2;
            b[j][h] = weight_pair<T, WFMT>(b_tile + (warp_col + j * 8 + lane / 4) * W_STRIDE + k * W_BITS / 8);
          }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) mma<T>(GROUPED ? group[i][j] : acc[i][j], a[i], b[j]);
      if constexpr (MINIMUMS) {
#pragma unroll
        for (int i = 0; i < MT; ++i) mma<T>(x_sum[i], a[i], ones);
        const int k_end = t * BK + (kk + 1) * 16;
        if (k_end % G == 0) {                  // the group ends: its sums times its scales, x's times its minimums
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const int col = n0 + warp_col + j * 8 + (lane % 4) * 2;
            const float2 p0 = group_scale_minimum<WFMT>(scale_of, k_end / G - 1, N, col);
            const float2 p1 = group_scale_minimum<WFMT>(scale_of, k_end / G - 1, N, col + 1);
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float2 p = e % 2 ? p1 : p0;
                acc[i][j][e] += group[i][j][e] * p.x + x_sum[i][e] * p.y;
                group[i][j][e] = 0.f;
              }
          }
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) x_sum[i][e] = 0.f;
        }
      }
      if constexpr (WFMT == 3) {
        const int k_end = t * BK + (kk + 1) * 16;
        if (k_end % G == 0) {                  // the group ends: its sums times its scales
          const __half* scale = static_cast<const __half*>(scale_of) + (size_t)(k_end / G - 1) * N;
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const int col = n0 + warp_col + j * 8 + (lane % 4) * 2;
            const float s0 = __half2float(scale[col]), s1 = __half2float(scale[col + 1]);
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                acc[i][j][e] += group[i][j][e] * (e % 2 ? s1 : s0);
                group[i][j][e] = 0.f;
              }
          }
        }
      }
    }
  }
  wait<0>();
  if constexpr (EXPERTS && (WFMT == 1 || WFMT == 2)) {     // the expert's sums times its scales
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int col = n0 + warp_col + j * 8 + (lane % 4) * 2;
      const float s0 = static_cast<const float*>(scale_of)[col], s1 = static_cast<const float*>(scale_of)[col + 1];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[i][j][e] += group[i][j][e] * (e % 2 ? s1 : s0);
          group[i][j][e] = 0.f;
        }
    }
  }
  if constexpr (!EXPERTS) break;
  int next = 0x7fffffff;                       // the next expert among the block's rows (sorted)
  for (int r = m0; r <= last_row; ++r)
    if (row_expert[r] > expert && row_expert[r] < next) next = row_expert[r];
  if (next == 0x7fffffff) break;
  expert = next;
  __syncthreads();                             // every warp is done with the slots the next pass fills
  }

  // fragment element e of (i, j): row + 8 * (e / 2), column + e % 2
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m0 + warp_row + i * 16 + lane / 4 + half * 8;
        const int col = n0 + warp_col + j * 8 + (lane % 4) * 2;
        if (row < M && ACT != 0) {
          T pair[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = acc[i][j][half * 2 + e];
            if constexpr (!EXPERTS && (WFMT == 1 || WFMT == 2)) v *= static_cast<const float*>(scale_any)[col + e];
            pair[e] = from_float<T>(v);
          }
          const float gate = to_float(pair[0]);
          const float act = ACT == 1 ? gate / (1.f + expf(-gate))
                                     : 0.5f * gate * (1.f + tanhf(0.7978845608028654f * (gate + 0.044715f * gate * gate * gate)));
          y[(size_t)row * (N / 2) + col / 2] = from_float<T>(to_float(from_float<T>(act)) * to_float(pair[1]));
        } else if (row < M) {
          T out[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = acc[i][j][half * 2 + e];
            if constexpr (!EXPERTS && (WFMT == 1 || WFMT == 2)) v *= static_cast<const float*>(scale_any)[col + e];
            if (BIAS) v += to_float(bias[col + e]);
            out[e] = from_float<T>(v);
            if (row_weight) out[e] = from_float<T>(to_float(out[e]) * row_weight[row]);
            if (RESIDUAL) out[e] = from_float<T>(to_float(out[e]) + to_float(residual[(size_t)row * N + col + e]));
          }
          *reinterpret_cast<unsigned*>(y + (size_t)row * N + col) = pack<T>(to_float(out[0]), to_float(out[1]));
        }
      }
}
"""

HELPERS = ("\n#ifndef KILN_MMA_GEMM\n#define KILN_MMA_GEMM\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n\n"
           "namespace kiln_mma {\n\n" + PTX_PRIMITIVES + "\n" + KERNEL_TEMPLATES + "\n\n}  // namespace kiln_mma\n#endif\n")


ACTIVATION_CODES = {None: 0, "silu": 1, "gelu_tanh": 2}


def kernel_source(name: str, dtype: str, tile: TileConfig, n_out: int, n_in: int, bias: bool,
                  residual: bool, weight: str = "float", group_size: int = 0, activation: str | None = None) -> str:
    """The device function `name`(x, w, [scale], [bias], [residual], y, M, shared) for one linear's
    shape; `weight` a WeightFormat kind (codegen/kernels/weight_format.py), `group_size` q4's; `activation`: the
    gated MLP's (its weights stored 'gated', no bias or residual, y half as wide)."""
    tile.check()
    if activation and (bias or residual):
        raise ValueError("a gated linear's kernel takes no bias or residual")
    ctype = CTYPES[dtype][0]
    params, args = linear_call(ctype, weight, bias, residual, n_out, n_in, "unsigned char")
    template = (f"kiln_mma::gemm<{ctype}, {WEIGHT_CODES[weight]}, {group_size or 1}, {tile.bm}, {tile.bn}, "
                f"{tile.bk}, {tile.wm}, {tile.wn}, {tile.stages}, {str(bias).lower()}, {str(residual).lower()}, false, "
                f"{ACTIVATION_CODES[activation]}>")
    return HELPERS + wrapper(name, params, template, args)


def linear_call(ctype: str, weight: str, bias: bool, residual: bool, n_out: int, n_in: int,
                shared: str) -> tuple[list[str], list[str]]:
    """A linear's device function parameters (x, w, [scale], [bias], [residual], y, M, shared) and
    the template arguments they become (absent ones nullptr; the shape; shared memory as `shared`*)."""
    scaled = weight != "float"
    params = ["const void* x", "const void* w"] + (["const void* scale"] if scaled else []) \
        + (["const void* bias"] if bias else []) + (["const void* residual"] if residual else []) \
        + ["void* y", "int M", "void* shared"]
    cast = lambda p: f"static_cast<const {ctype}*>({p})"      # noqa: E731
    args = [cast("x"), "w", "scale" if scaled else "nullptr", cast("bias") if bias else "nullptr",
            cast("residual") if residual else "nullptr", f"static_cast<{ctype}*>(y)", "M", str(n_out), str(n_in),
            f"static_cast<{shared}*>(shared)"]
    return params, args


def wrapper(name: str, params: list[str], template: str, args: list[str]) -> str:
    """The kernel's own device function: the template's instance with this linear's parameters."""
    return (f"\n__device__ __forceinline__ void {name}({', '.join(params)}) {{\n"
            f"  {template}({', '.join(args)});\n}}\n")


def experts_kernel_source(name: str, dtype: str, tile: TileConfig, n_out: int, n_in: int, weight: str,
                          group_size: int, gather: bool, weighted: bool) -> str:
    """The device function `name`(x, [row_token], row_expert, w, [scale], [row_weight], y, M, shared)
    of a mixture of experts' grouped GEMM (codegen/lowering/moe.py): rows sorted by expert."""
    tile.check()
    ctype = CTYPES[dtype][0]
    scaled = weight != "float"
    params = ["const void* x"] + (["const void* row_token"] if gather else []) + ["const void* row_expert", "const void* w"] \
        + (["const void* scale"] if scaled else []) + (["const void* row_weight"] if weighted else []) \
        + ["void* y", "int M", "void* shared"]
    args = [f"static_cast<const {ctype}*>(x)", "w", "scale" if scaled else "nullptr", "nullptr", "nullptr",
            f"static_cast<{ctype}*>(y)", "M", str(n_out), str(n_in), "static_cast<unsigned char*>(shared)",
            "static_cast<const int*>(row_token)" if gather else "nullptr", "static_cast<const int*>(row_expert)",
            "static_cast<const float*>(row_weight)" if weighted else "nullptr"]
    template = (f"kiln_mma::gemm<{ctype}, {WEIGHT_CODES[weight]}, {group_size or 1}, {tile.bm}, {tile.bn}, "
                f"{tile.bk}, {tile.wm}, {tile.wn}, {tile.stages}, false, false, true>")
    return HELPERS + wrapper(name, params, template, args)
