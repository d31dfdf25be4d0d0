// Runs codegen/mma_source.py's kernel (KERNEL_TEMPLATES, unchanged) on the CPU: every CUDA thread of
// a block is a std::thread, and the PTX primitives the kernel issues are emulated as the PTX ISA
// specifies them: cp.async copies (and zero-fills) when a wait lets their group complete, ldmatrix hands lane l row l / 4 of each
// 8 x 8 matrix whose row addresses lanes 8j .. 8j + 7 gave, mma.sync.m16n8k16 gathers the warp's
// fragments into A (16 x 16), B (16 x 8) and C and gives each lane its elements of A B + C.
// half is GCC's _Float16; bf16 is rounded to nearest even from float, as the CUDA intrinsics do.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __restrict__

struct Index { int x = 0, y = 0, z = 0; };
thread_local Index threadIdx, blockIdx;

// ---- half and bf16 as the CUDA headers name them -------------------------------------------------
struct __half { _Float16 v; };
struct __half2 { _Float16 x, y; };
struct __nv_bfloat16 { uint16_t bits; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned float_bits(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline unsigned __float_as_uint(float f) { return float_bits(f); }
inline float __half2float(__half h) { return float(h.v); }
inline __half __float2half_rn(float f) { return {_Float16(f)}; }
inline __half __int2half_rn(int i) { return {_Float16(float(i))}; }
inline __half2 __half2half2(__half h) { return {h.v, h.v}; }
inline __half2 __floats2half2_rn(float a, float b) { return {_Float16(a), _Float16(b)}; }
inline __half2 __hsub2(__half2 a, __half2 b) { return {_Float16(float(a.x) - float(b.x)), _Float16(float(a.y) - float(b.y))}; }
inline __half2 __hmul2(__half2 a, __half2 b) { return {_Float16(float(a.x) * float(b.x)), _Float16(float(a.y) * float(b.y))}; }
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(unsigned(b.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u = float_bits(f);
  if (std::isnan(f)) return {uint16_t(0x7FC0)};
  u += 0x7FFF + ((u >> 16) & 1);                     // round to nearest, ties to even
  return {uint16_t(u >> 16)};
}
inline __nv_bfloat16 __int2bfloat16_rn(int i) { return __float2bfloat16_rn(float(i)); }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 b) { return {b, b}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {__float2bfloat16_rn(__bfloat162float(a.x) - __bfloat162float(b.x)),
          __float2bfloat16_rn(__bfloat162float(a.y) - __bfloat162float(b.y))};
}
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {__float2bfloat16_rn(__bfloat162float(a.x) * __bfloat162float(b.x)),
          __float2bfloat16_rn(__bfloat162float(a.y) * __bfloat162float(b.y))};
}
inline __half __ushort_as_half(unsigned short u) { __half h; std::memcpy(&h, &u, 2); return h; }
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
using std::min;
using std::max;

// ---- one block's threads: barriers for the block and for each warp, shared memory ----------------
struct Block {
  std::vector<unsigned char> shared;
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<unsigned> addresses;               // ldmatrix: each lane's row address
  std::vector<unsigned> fragments;               // mma: each lane's a (4), b (2)
  std::vector<float> sums;                       // mma: each lane's c (4)
  std::vector<float> lanes;                      // shuffles: each lane's value
};
thread_local Block* block;

inline void __syncthreads() { block->all->arrive_and_wait(); }

// __shfl_*_sync over the whole warp (mask 0xFFFFFFFF, as the kernels use them): every lane
// offers its value, then reads its source lane's; a source outside the warp reads its own
inline float shuffle(float v, int source) {
  const int warp = threadIdx.x / 32;
  block->lanes[threadIdx.x] = v;
  block->warps[warp]->arrive_and_wait();
  const float got = source >= 0 && source < 32 ? block->lanes[warp * 32 + source] : v;
  block->warps[warp]->arrive_and_wait();
  return got;
}
inline float __shfl_xor_sync(unsigned, float v, int mask) { return shuffle(v, int(threadIdx.x % 32) ^ mask); }
inline float __shfl_down_sync(unsigned, float v, int delta) { return shuffle(v, int(threadIdx.x % 32) + delta); }
inline float __shfl_sync(unsigned, float v, int source) { return shuffle(v, source); }

namespace kiln_mma {

inline unsigned shared_address(const void* p) {
  return unsigned(static_cast<const unsigned char*>(p) - block->shared.data());
}
// cp.async: a thread's copies land only when a wait_group lets their group complete, as on the
// GPU they may; a tile read before its wait reads the garbage that was there
struct Copy { unsigned dst; const void* src; int bytes; };
thread_local std::vector<Copy> open_group;
thread_local std::deque<std::vector<Copy>> committed;
inline void copy16(unsigned dst, const void* src, int src_bytes) { open_group.push_back({dst, src, src_bytes}); }
inline void commit() { committed.push_back(std::move(open_group)); open_group.clear(); }
template <int PENDING> inline void wait() {
  while (committed.size() > PENDING) {
    for (const Copy& c : committed.front()) {
      std::memset(block->shared.data() + c.dst, 0, 16);
      if (c.bytes) std::memcpy(block->shared.data() + c.dst, c.src, c.bytes);
    }
    committed.pop_front();
  }
}

inline void warp_sync() { block->warps[threadIdx.x / 32]->arrive_and_wait(); }

inline void ldmatrix4(unsigned* r, unsigned address) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  block->addresses[threadIdx.x] = address;
  warp_sync();
  for (int j = 0; j < 4; ++j) {                  // matrix j: rows at lanes 8j .. 8j + 7
    unsigned row = block->addresses[warp * 32 + j * 8 + lane / 4];
    std::memcpy(&r[j], block->shared.data() + row + (lane % 4) * 4, 4);
  }
  warp_sync();
}

template <typename T> inline float element(unsigned reg, int half) {
  uint16_t bits = uint16_t(half ? reg >> 16 : reg & 0xFFFF);
  T value;
  std::memcpy(&value, &bits, 2);
  if constexpr (std::is_same_v<T, __half>) return float(value.v);
  else return __bfloat162float(value);
}

template <typename T> inline void mma(float* c, const unsigned* a, const unsigned* b) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned* mine = &block->fragments[threadIdx.x * 6];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b[0]; mine[5] = b[1];
  for (int i = 0; i < 4; ++i) block->sums[threadIdx.x * 4 + i] = c[i];
  warp_sync();
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const unsigned* f = &block->fragments[(warp * 32 + l) * 6];
    const int group = l / 4, pair = (l % 4) * 2;
    for (int i = 0; i < 8; ++i) {                // a_i: row group (+ 8 for i % 4 >= 2), column pair (+ 8 for i >= 4)
      int row = group + ((i % 4) >= 2 ? 8 : 0), col = pair + (i % 2) + (i >= 4 ? 8 : 0);
      A[row][col] = element<T>(f[i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) {                // b_i: row (k) pair (+ 8 for i >= 2), column group
      B[pair + (i % 2) + (i >= 2 ? 8 : 0)][group] = element<T>(f[4 + i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) {                // c_i: row group (+ 8 for i >= 2), column pair
      C[group + (i >= 2 ? 8 : 0)][pair + (i % 2)] = block->sums[(warp * 32 + l) * 4 + i];
    }
  }
  warp_sync();
  const int group = lane / 4, pair = (lane % 4) * 2;
  for (int i = 0; i < 4; ++i) {
    int row = group + (i >= 2 ? 8 : 0), col = pair + (i % 2);
    float d = C[row][col];
    for (int k = 0; k < 16; ++k) d += A[row][k] * B[k][col];
    c[i] = d;
  }
}

}  // namespace kiln_mma

// runs `kernel` over a grid of (grid_x, grid_y, grid_z) blocks of `threads` threads with `shared_bytes`
inline void launch_grid(int grid_x, int grid_y, int grid_z, int threads, size_t shared_bytes,
                        const std::function<void()>& kernel) {
  for (int bz = 0; bz < grid_z; ++bz)
  for (int by = 0; by < grid_y; ++by)
    for (int bx = 0; bx < grid_x; ++bx) {
      Block b;
      b.shared.assign(shared_bytes, 0xA5);        // garbage, as real shared memory holds
      b.all = std::make_unique<std::barrier<>>(threads);
      for (int w = 0; w < threads / 32; ++w) b.warps.push_back(std::make_unique<std::barrier<>>(32));
      b.addresses.resize(threads);
      b.fragments.resize(threads * 6);
      b.sums.resize(threads * 4);
      b.lanes.resize(threads);
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          threadIdx.x = t;
          blockIdx.x = bx;
          blockIdx.y = by;
          blockIdx.z = bz;
          block = &b;
          kernel();
          if (!kiln_mma::committed.empty() || !kiln_mma::open_group.empty()) std::abort();   // copies never waited for
        });
      for (auto& th : pool) th.join();
    }
}

inline void launch(int grid_x, int grid_y, int threads, size_t shared_bytes, const std::function<void()>& kernel) {
  launch_grid(grid_x, grid_y, 1, threads, shared_bytes, kernel);
}
