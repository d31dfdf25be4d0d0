"""CUDA source of kiln's paged attention for GPUs (codegen/kernels/gpu/attention.py calls it from TIR).

One kernel serves every KV spec of full or sliding layers: pages of the activations' dtype, or
int8 / e4m3 rows with a float32 scale each (ir/quant.py KV_SCHEMES), sliding windows, soft-capped
scores, any head ratio, ragged steps (prefill chunks beside decodes). Page layout: kiln's
[pages, 2 (k, v), kv_heads, page_size, head_dim]; the semantics are ir/kv_ops.py's paged_attention.

A thread block serves one query token and one KV head, with all the query heads that read it (the
GQA group reads each K/V row once), over one share of the token's visible keys (`SPLITS`; decode
steps split a long context over many blocks, flash-decoding): its warps take the keys 32 at a
time, each lane one key's scores for the group, online softmax per warp; then every lane adds the
32 keys' values into its own head_dim elements. The warps' states meet in shared memory. With one
split the block writes the output; with several it writes its normalised share and the share's
log-sum-exp, and a second kernel (`merge`) weighs the shares. Keys outside the window or past the
query are never read: their pages may be gone.

The quantising append (`append`) writes a step's new K/V rows into quantised pages, each row
scaled by its largest magnitude, as ir/quant.py's KVScheme.quantize_rows does.
"""
from __future__ import annotations

from dataclasses import dataclass

CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
KV_CODES = {"float": 0, "int8": 1, "float8_e4m3fn": 2}       # how a page stores a row
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
WARPS = 4
MIN_SPLIT_KEYS = 256     # a share of fewer keys costs more in the merge than it saves


@dataclass(frozen=True)
class AttentionShape:
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str            # activations' (q, k, v, out)
    kv_dtype: str         # the pages' (dtype itself, int8 or float8_e4m3fn)

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def kv_code(self) -> int:
        return KV_CODES["float" if self.kv_dtype == self.dtype else self.kv_dtype]

    def shared_bytes(self) -> int:
        """The group's queries, and each warp's softmax state and partial output."""
        return (self.group * self.head_dim + WARPS * self.group * (self.head_dim + 2)) * 4

    def problem(self) -> str | None:
        """Why the kernel cannot take this shape, or None."""
        if self.dtype not in CTYPES:
            return f"activations of {self.dtype}"
        if self.kv_dtype != self.dtype and self.kv_dtype not in QMAX:
            return f"pages of {self.kv_dtype}"
        code_bytes = 4 if self.kv_code == 0 and self.dtype == "float32" else 2 if self.kv_code == 0 else 1
        if self.head_dim * code_bytes % 16 or self.q_heads % self.kv_heads:
            return f"head_dim {self.head_dim} (rows read 16 bytes at a time) or heads {self.q_heads}/{self.kv_heads}"
        if self.shared_bytes() > 48 * 1024:
            return f"a group of {self.group} heads of {self.head_dim} (shared memory)"
        return None


ATTENTION_TEMPLATE = r"""
constexpr float NEG_INF = -__builtin_huge_valf();

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// a 16-bit value's bits as a float
template <typename T> __device__ __forceinline__ float half_value(unsigned bits);
template <> __device__ __forceinline__ float half_value<__nv_bfloat16>(unsigned bits) { return __uint_as_float(bits << 16); }
template <> __device__ __forceinline__ float half_value<__half>(unsigned bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// an e4m3 code's value (exact)
__device__ __forceinline__ float e4m3_value(unsigned c) {
  const unsigned e = (c >> 3) & 15u, m = c & 7u;
  const float magnitude = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : float(m) * 0.001953125f;
  return (c & 0x80u) ? -magnitude : magnitude;
}

// the e4m3 code nearest v (ties to even), for |v| <= 448: the quantised rows are scaled to that
__device__ __forceinline__ unsigned char e4m3_code(float v) {
  const unsigned sign = (__float_as_uint(v) >> 24) & 0x80u;
  const float a = fabsf(v);
  unsigned code;
  if (a < 0.015625f) {                           // below the smallest normal: multiples of 2^-9
    code = unsigned(rintf(a * 512.f));           // 8 is the smallest normal's code
  } else {
    const unsigned bits = __float_as_uint(a), rest = bits & 0xFFFFFu;
    unsigned e = ((bits >> 23) & 0xFFu) - 120u, m = (bits >> 20) & 7u;
    if (rest > 0x80000u || (rest == 0x80000u && (m & 1u))) {
      if (++m == 8u) { m = 0u; ++e; }
    }
    code = min((e << 3) | m, 0x7Eu);             // 448 at most: 0x7F is NaN
  }
  return static_cast<unsigned char>(sign | code);
}

// element i of a stored row as a float (before its row's scale): KV 0 the dtype T, 1 int8, 2 e4m3
template <typename T, int KV> __device__ __forceinline__ float code_value(const void* row, int i) {
  if constexpr (KV == 0) return to_f(static_cast<const T*>(row)[i]);
  else if constexpr (KV == 1) return float(static_cast<const signed char*>(row)[i]);
  else return e4m3_value(static_cast<const unsigned char*>(row)[i]);
}

// the 16 bytes at p as floats: 4 (float), 8 (half, bf16) or 16 (int8, e4m3) of them
template <typename T, int KV> __device__ __forceinline__ void chunk_values(float* out, const void* p) {
  const uint4 v = *static_cast<const uint4*>(p);
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if constexpr (KV == 0 && sizeof(T) == 4) {
      out[w] = __uint_as_float(words[w]);
    } else if constexpr (KV == 0) {
      out[2 * w] = half_value<T>(words[w] & 0xFFFFu);
      out[2 * w + 1] = half_value<T>(words[w] >> 16);
    } else {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const unsigned byte = (words[w] >> (8 * b)) & 0xFFu;
        out[4 * w + b] = KV == 1 ? float(static_cast<signed char>(byte)) : e4m3_value(byte);
      }
    }
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, mask));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, mask);
  return v;
}

// the sequence of query token t: the last s with q_indptr[s] <= t
__device__ __forceinline__ int sequence_of(const int* q_indptr, int seqs, int t) {
  int lo = 0, hi = seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (q_indptr[mid] <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// the index of a sequence's key's stored row (k 0, v 1) of KV head kvh, its pages from first_page on
template <int HKV, int PAGE>
__device__ __forceinline__ size_t stored_row(const int* page_values, int first_page, int key, int kind, int kvh) {
  return ((size_t)(page_values[first_page + key / PAGE] * 2 + kind) * HKV + kvh) * PAGE + key % PAGE;
}

// blockIdx.x: the query token; .y: the KV head; .z: the share of its keys (of SPLITS)
template <typename T, int KV, int HQ, int HKV, int D, int PAGE, int SPLITS, bool CAPPED>
__device__ __forceinline__ void attend(const T* __restrict__ q, const void* __restrict__ pages,
                                       const float* __restrict__ scales, const int* __restrict__ q_indptr,
                                       const int* __restrict__ page_indptr, const int* __restrict__ page_values,
                                       const int* __restrict__ last_page_len, T* __restrict__ out,
                                       float* __restrict__ partial, float* __restrict__ lse, int seqs,
                                       float scale, float softcap, int window, float* shared) {
  constexpr int G = HQ / HKV, THREADS = 32 * WARPS, SLICE = (D + 31) / 32;
  constexpr int CODE_BYTES = KV == 0 ? int(sizeof(T)) : 1, PER_CHUNK = 16 / CODE_BYTES;
  const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* qs = shared;                              // [G][D]
  float* warp_m = qs + G * D;                      // [WARPS][G]
  float* warp_l = warp_m + WARPS * G;              // [WARPS][G]
  float* warp_acc = warp_l + WARPS * G;            // [WARPS][G][D]

  const int s = sequence_of(q_indptr, seqs, t);
  const int n = q_indptr[s + 1] - q_indptr[s];
  const int first_page = page_indptr[s], pages_of_s = page_indptr[s + 1] - first_page;
  const int kv_len = pages_of_s > 0 ? (pages_of_s - 1) * PAGE + last_page_len[s] : 0;
  const int pos = kv_len - n + (t - q_indptr[s]);
  const int lo = window > 0 ? max(0, pos - window + 1) : 0, hi = pos + 1;
  const int share = SPLITS == 1 ? hi - lo : max(MIN_SPLIT, ((hi - lo + SPLITS - 1) / SPLITS + 31) / 32 * 32);
  const int begin = lo + split * share, end = min(hi, begin + share);

  for (int i = threadIdx.x; i < G * D; i += THREADS)
    qs[i] = to_f(q[((size_t)t * HQ + kvh * G) * D + i]);
  __syncthreads();

  float m[G], l[G], acc[G][SLICE];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = NEG_INF;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < SLICE; ++i) acc[h][i] = 0.f;
  }
  const unsigned char* base = static_cast<const unsigned char*>(pages);

  for (int tile = begin + warp * 32; tile < end; tile += WARPS * 32) {
    const int key = tile + lane;
    const bool valid = key < end;
    float score[G];
#pragma unroll
    for (int h = 0; h < G; ++h) score[h] = 0.f;
    if (valid) {
      const size_t row = stored_row<HKV, PAGE>(page_values, first_page, key, 0, kvh);
      const float k_scale = KV == 0 ? 1.f : scales[row];
      const unsigned char* k_row = base + row * D * CODE_BYTES;
      for (int c = 0; c < D; c += PER_CHUNK) {
        float kv[PER_CHUNK];
        chunk_values<T, KV>(kv, k_row + c * CODE_BYTES);
#pragma unroll
        for (int h = 0; h < G; ++h)
#pragma unroll
          for (int e = 0; e < PER_CHUNK; ++e) score[h] = fmaf(qs[h * D + c + e], kv[e], score[h]);
      }
#pragma unroll
      for (int h = 0; h < G; ++h) {
        score[h] *= k_scale * scale;
        if (CAPPED) score[h] = softcap * tanhf(score[h] / softcap);
      }
    }
    float p[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float top = fmaxf(m[h], warp_max(valid ? score[h] : NEG_INF));
      p[h] = valid ? expf(score[h] - top) : 0.f;
      const float keep = expf(m[h] - top);
      l[h] = l[h] * keep + warp_sum(p[h]);
      m[h] = top;
#pragma unroll
      for (int i = 0; i < SLICE; ++i) acc[h][i] *= keep;
    }
    const int keys = min(32, end - tile);
#pragma unroll 4
    for (int k = 0; k < keys; ++k) {
      const size_t row = stored_row<HKV, PAGE>(page_values, first_page, tile + k, 1, kvh);
      const float v_scale = KV == 0 ? 1.f : scales[row];
      const unsigned char* v_row = base + row * D * CODE_BYTES;
      float weight[G];
#pragma unroll
      for (int h = 0; h < G; ++h) weight[h] = __shfl_sync(0xFFFFFFFFu, p[h], k) * v_scale;
#pragma unroll
      for (int i = 0; i < SLICE; ++i) {
        const int d = lane + 32 * i;
        if (d < D) {
          const float v = code_value<T, KV>(v_row, d);
#pragma unroll
          for (int h = 0; h < G; ++h) acc[h][i] = fmaf(weight[h], v, acc[h][i]);
        }
      }
    }
  }

  // the warps' states meet: each warp's maximum, sum and output in shared memory, then combined
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (lane == 0) { warp_m[warp * G + h] = m[h]; warp_l[warp * G + h] = l[h]; }
#pragma unroll
    for (int i = 0; i < SLICE; ++i)
      if (lane + 32 * i < D) warp_acc[(warp * G + h) * D + lane + 32 * i] = acc[h][i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += THREADS) {
    const int h = i / D, d = i % D, qh = kvh * G + h;
    float top = NEG_INF;
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w * G + h]);
    float sum = 0.f, value = 0.f;
    if (top != NEG_INF)
      for (int w = 0; w < WARPS; ++w) {
        if (warp_m[w * G + h] == NEG_INF) continue;
        const float weight = expf(warp_m[w * G + h] - top);
        sum += warp_l[w * G + h] * weight;
        value += warp_acc[(w * G + h) * D + d] * weight;
      }
    if (SPLITS == 1) {
      out[((size_t)t * HQ + qh) * D + d] = from_f<T>(value / sum);
    } else {
      const size_t share_at = ((size_t)t * HQ + qh) * SPLITS + split;
      partial[share_at * D + d] = sum > 0.f ? value / sum : 0.f;
      if (d == 0) lse[share_at] = sum > 0.f ? top + logf(sum) : NEG_INF;
    }
  }
}

// blockIdx.x: the query token, .y: the query head; 32 threads weigh its SPLITS shares
template <typename T, int HQ, int D, int SPLITS>
__device__ __forceinline__ void merge(const float* __restrict__ partial, const float* __restrict__ lse,
                                      T* __restrict__ out) {
  const size_t at = (size_t)blockIdx.x * HQ + blockIdx.y;
  float top = NEG_INF;
  for (int z = 0; z < SPLITS; ++z) top = fmaxf(top, lse[at * SPLITS + z]);
  for (int d = threadIdx.x; d < D; d += 32) {
    float sum = 0.f, value = 0.f;
    for (int z = 0; z < SPLITS; ++z) {
      const float share_lse = lse[at * SPLITS + z];
      if (share_lse == NEG_INF) continue;
      const float weight = expf(share_lse - top);
      sum += weight;
      value += weight * partial[(at * SPLITS + z) * D + d];
    }
    out[at * D + d] = from_f<T>(value / sum);
  }
}

// blockIdx.x: the new token, .y: the KV head, .z: k (0) or v (1); one warp quantises the row
template <typename T, int KV, int HKV, int D, int PAGE>
__device__ __forceinline__ void append(void* __restrict__ pages, float* __restrict__ scales,
                                       const T* __restrict__ k, const T* __restrict__ v,
                                       const int* __restrict__ slots, float qmax) {
  const int t = blockIdx.x, kvh = blockIdx.y, kind = blockIdx.z, lane = threadIdx.x;
  const int slot = slots[t];
  if (slot < 0) return;
  const T* x = (kind == 0 ? k : v) + ((size_t)t * HKV + kvh) * D;
  float amax = 0.f;
  for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(to_f(x[d])));
  amax = warp_max(amax);
  const float row_scale = amax > 0.f ? amax / qmax : 1.f;
  const size_t row = ((size_t)((slot / PAGE) * 2 + kind) * HKV + kvh) * PAGE + slot % PAGE;
  for (int d = lane; d < D; d += 32) {
    const float level = to_f(x[d]) / row_scale;
    if constexpr (KV == 1)
      static_cast<signed char*>(pages)[row * D + d] = static_cast<signed char>(fminf(fmaxf(rintf(level), -qmax), qmax));
    else
      static_cast<unsigned char*>(pages)[row * D + d] = e4m3_code(level);
  }
  if (lane == 0) scales[row] = row_scale;
}
"""

PREAMBLE = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"


NAMESPACE = (f"namespace kiln_attn {{\nconstexpr int WARPS = {WARPS}, MIN_SPLIT = {MIN_SPLIT_KEYS};\n"
             f"{ATTENTION_TEMPLATE}\n}}  // namespace kiln_attn\n")


def _namespace() -> str:
    return f"\n#ifndef KILN_GPU_ATTENTION\n#define KILN_GPU_ATTENTION\n{PREAMBLE}{NAMESPACE}#endif\n"


def attention_source(name: str, shape: AttentionShape, splits: int, scale: float, softcap: float,
                     window: int) -> str:
    """Device functions `name`(q, pages, [scales], q_indptr, page_indptr, page_values,
    last_page_len, out, [partial, lse], seqs, shared) and, with splits > 1, `name`_merge(partial,
    lse, out)."""
    ctype, quantized = CTYPES[shape.dtype], shape.kv_code != 0
    params = ["const void* q", "const void* pages"] + (["const void* scales"] if quantized else []) + [
        "const void* q_indptr", "const void* page_indptr", "const void* page_values", "const void* last_page_len",
        "void* out"] + (["void* partial", "void* lse"] if splits > 1 else []) + ["int seqs", "void* shared"]
    template = (f"kiln_attn::attend<{ctype}, {shape.kv_code}, {shape.q_heads}, {shape.kv_heads}, {shape.head_dim}, "
                f"{shape.page_size}, {splits}, {str(softcap > 0).lower()}>")
    ints = "static_cast<const int*>"
    args = [f"static_cast<const {ctype}*>(q)", "pages", "static_cast<const float*>(scales)" if quantized else "nullptr",
            f"{ints}(q_indptr)", f"{ints}(page_indptr)", f"{ints}(page_values)", f"{ints}(last_page_len)",
            f"static_cast<{ctype}*>(out)", "static_cast<float*>(partial)" if splits > 1 else "nullptr",
            "static_cast<float*>(lse)" if splits > 1 else "nullptr", "seqs", f"{float(scale)!r}f",
            f"{float(softcap or 1.0)!r}f", str(int(window)), "static_cast<float*>(shared)"]
    source = _namespace() + (f"\n#ifndef {name.upper()}\n#define {name.upper()}\n"
                             f"__device__ __forceinline__ void {name}({', '.join(params)}) {{\n"
                             f"  {template}({', '.join(args)});\n}}\n")
    if splits > 1:
        source += (f"__device__ __forceinline__ void {name}_merge(const void* partial, const void* lse, void* out) {{\n"
                   f"  kiln_attn::merge<{ctype}, {shape.q_heads}, {shape.head_dim}, {splits}>("
                   f"static_cast<const float*>(partial), static_cast<const float*>(lse), static_cast<{ctype}*>(out));\n}}\n")
    return source + "#endif\n"


def append_source(name: str, shape: AttentionShape) -> str:
    """Device function `name`(pages, scales, k, v, slots): a step's K/V rows into quantised pages."""
    ctype = CTYPES[shape.dtype]
    return _namespace() + (
        f"\n#ifndef {name.upper()}\n#define {name.upper()}\n"
        f"__device__ __forceinline__ void {name}(void* pages, void* scales, const void* k, const void* v, "
        f"const void* slots) {{\n"
        f"  kiln_attn::append<{ctype}, {shape.kv_code}, {shape.kv_heads}, {shape.head_dim}, {shape.page_size}>("
        f"pages, static_cast<float*>(scales), static_cast<const {ctype}*>(k), static_cast<const {ctype}*>(v), "
        f"static_cast<const int*>(slots), {QMAX[shape.kv_dtype]!r}f);\n}}\n#endif\n")
