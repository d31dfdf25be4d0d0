// A Hopper (sm_90a) linear y = x @ W.T (+ bias) (+ residual) on CUTLASS's warp-specialised TMA +
// wgmma GEMM, for one activation dtype and one tile (codegen/kernels/gpu/hopper_gemm.py builds one
// object per variant with nvcc, the variant given as macros, and links it into the artifact).
//
// Operands are swapped, as kiln's tensors lie: CUTLASS computes D[out, rows] = W[out, K] . X[rows, K]^T,
// so the weight is CUTLASS's K-major A, the activations its K-major B, and D column-major is kiln's
// y[rows, out] row-major. The tile's M side then runs over output features and its N side over the
// step's rows; the per-output bias is a per-row broadcast of D, the residual D's source C.
//
// The variant registers one global function, KILN_GEMM_NAME(x, w, y, bias, residual, epilogue), or
// with KILN_Q4 KILN_GEMM_NAME(x, w, scale, zeros, y, bias, residual, epilogue): destination-passing, on
// TVM's current CUDA stream (so the decode CUDA graphs capture it like TVM's own kernels). `epilogue`
// says which of bias (1) and residual (2) are real; absent ones are passed as y and never read (a
// zero beta leaves the source unread, a null bias adds nothing).
//
// KILN_Q4: kiln's q4 weights [out, K / 2] (input k in byte k / 2, the odd one high: CUTLASS's uint4
// order) widened in registers into the wgmma operand (CUTLASS's mixed-input main loop): level * scale
// + zero in half precision, scale and zero [K / group, out] with zero = -8 scale (kiln's level is the
// nibble - 8), so the weights are read as stored; the group a multiple of the K tile.
//
// Macros (all required but KILN_Q4): KILN_GEMM_NAME, KILN_ELEMENT (cutlass::bfloat16_t or
// cutlass::half_t), KILN_TILE_M, KILN_TILE_N, KILN_TILE_K, KILN_CLUSTER_M, KILN_CLUSTER_N, KILN_SCHEDULE
// (cooperative or pingpong: 1 or 0).
#include <cuda_runtime.h>

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#define KILN_STR2(x) #x
#define KILN_STR(x) KILN_STR2(x)

namespace {

using tvm::ffi::TensorView;
using Element = KILN_ELEMENT;
constexpr int kAlignment = 16 / sizeof(Element);   // TMA moves 16-byte lines
#if KILN_Q4
using Weight = cutlass::uint4b_t;
using ScaleElement = cutlass::half_t;
using MainloopA = cute::tuple<Weight, ScaleElement, ScaleElement>;   // levels, scales, zeros
constexpr int kWeightAlignment = 128 / 4;
#else
using Weight = Element;
using MainloopA = Element;
constexpr int kWeightAlignment = kAlignment;
#endif

using TileShape = cute::Shape<cute::Int<KILN_TILE_M>, cute::Int<KILN_TILE_N>, cute::Int<KILN_TILE_K>>;
using ClusterShape = cute::Shape<cute::Int<KILN_CLUSTER_M>, cute::Int<KILN_CLUSTER_N>, cute::_1>;
#if KILN_SCHEDULE
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#else
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#endif

// D = alpha * acc + beta * C + bias[row of D]: a bias per output feature
using Fusion = cutlass::epilogue::fusion::LinCombPerRowBias<Element, float, Element, Element, float>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    Element, cutlass::layout::ColumnMajor, kAlignment,
    Element, cutlass::layout::ColumnMajor, kAlignment,
    EpilogueSchedule, Fusion>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    MainloopA, cutlass::layout::RowMajor, kWeightAlignment,   // A: the weight [out, K]
    Element, cutlass::layout::ColumnMajor, kAlignment,    // B: the activations [rows, K]
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

int MultiprocessorCount(int device) {
  static int counts[64] = {0};
  if (counts[device] == 0) {
    counts[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }
  return counts[device];
}

void CheckOperand(const TensorView& t, const char* what) {
  TVM_FFI_CHECK(t.ndim() == 2 && t.IsContiguous(), ValueError)
      << KILN_STR(KILN_GEMM_NAME) << ": " << what << " must be a contiguous matrix";
  TVM_FFI_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, ValueError)
      << KILN_STR(KILN_GEMM_NAME) << ": " << what << " must start on a 16-byte boundary (TMA)";
}

// The product's arguments but the epilogue's: weight (with its scales and zeros for q4) and activations.
#if KILN_Q4
typename Mainloop::Arguments MainloopArgs(const TensorView& x, const TensorView& w, const TensorView& scale,
                                          const TensorView& zeros) {
  const int k = static_cast<int>(x.shape()[1]), out = static_cast<int>(w.shape()[0]);
  const int groups = static_cast<int>(scale.shape()[0]);
  CheckOperand(scale, "the scales");
  CheckOperand(zeros, "the zeros");
  TVM_FFI_CHECK(groups > 0 && k % groups == 0 && scale.shape()[1] == out && zeros.shape()[0] == groups &&
                zeros.shape()[1] == out, ValueError)
      << KILN_STR(KILN_GEMM_NAME) << ": scales and zeros must be [K / group, out]";
  return {static_cast<const Weight*>(w.data_ptr()), cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(0)),
          static_cast<const Element*>(x.data_ptr()), cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(0)),
          static_cast<const ScaleElement*>(scale.data_ptr()),
          cute::make_stride(cute::Int<1>{}, int64_t(out), int64_t(0)), k / groups,
          static_cast<const ScaleElement*>(zeros.data_ptr())};
}
#else
typename Mainloop::Arguments MainloopArgs(const TensorView& x, const TensorView& w) {
  const int64_t k = x.shape()[1];
  return {static_cast<const Weight*>(w.data_ptr()), cute::make_stride(k, cute::Int<1>{}, int64_t(0)),
          static_cast<const Element*>(x.data_ptr()), cute::make_stride(k, cute::Int<1>{}, int64_t(0))};
}
#endif

void Run(const TensorView& x, const TensorView& w, typename Mainloop::Arguments mainloop,
         TensorView y, const TensorView& bias, const TensorView& residual, int64_t epilogue) {
  CheckOperand(x, "x");
  CheckOperand(w, "the weight");
  CheckOperand(y, "y");
  const int rows = static_cast<int>(x.shape()[0]), k = static_cast<int>(x.shape()[1]);
  const int out = static_cast<int>(w.shape()[0]);
  const int64_t stored_k = int64_t(k) * cutlass::sizeof_bits<Weight>::value / w.dtype().bits;   // q4: K / 2 bytes
  TVM_FFI_CHECK(w.shape()[1] == stored_k && y.shape()[0] == rows && y.shape()[1] == out, ValueError)
      << KILN_STR(KILN_GEMM_NAME) << ": shapes x " << rows << "x" << k << ", weight " << out << "x"
      << w.shape()[1] << ", y " << y.shape()[0] << "x" << y.shape()[1] << " do not agree";
  if (rows == 0) return;
  const bool has_bias = epilogue & 1, has_residual = epilogue & 2;
  if (has_residual) CheckOperand(residual, "the residual");

  auto* y_ptr = static_cast<Element*>(y.data_ptr());
  // absent source: y's own address (valid and aligned), never read with beta = 0
  auto* c_ptr = has_residual ? static_cast<const Element*>(residual.data_ptr()) : y_ptr;

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {out, rows, k, 1},
      mainloop,
      {{},
       c_ptr, cute::make_stride(cute::Int<1>{}, int64_t(out), int64_t(0)),
       y_ptr, cute::make_stride(cute::Int<1>{}, int64_t(out), int64_t(0))}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = has_residual ? 1.0f : 0.0f;
  args.epilogue.thread.bias_ptr = has_bias ? static_cast<const Element*>(bias.data_ptr()) : nullptr;
  // the device TVM's runtime made current (the tensors TIR passes need not name it)
  TVM_FFI_CHECK(cudaGetDevice(&args.hw_info.device_id) == cudaSuccess, RuntimeError)
      << KILN_STR(KILN_GEMM_NAME) << ": no current CUDA device";
  args.hw_info.sm_count = MultiprocessorCount(args.hw_info.device_id);

  Gemm gemm;
  TVM_FFI_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, ValueError)
      << KILN_STR(KILN_GEMM_NAME) << " cannot run " << rows << "x" << out << "x" << k
      << " (alignment: K and the outputs must be multiples of " << kAlignment << ")";
  // the persistent tile scheduler of a plain GEMM needs no workspace; refuse one that would
  TVM_FFI_CHECK(Gemm::get_workspace_size(args) == 0, RuntimeError)
      << KILN_STR(KILN_GEMM_NAME) << " asks for a workspace, which kiln's binding does not provide";
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, args.hw_info.device_id));
  cutlass::Status status = gemm.initialize(args, nullptr, stream);
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
  TVM_FFI_CHECK(status == cutlass::Status::kSuccess, RuntimeError)
      << KILN_STR(KILN_GEMM_NAME) << " failed to launch: " << cutlassGetStatusString(status) << " ("
      << cudaGetErrorString(cudaGetLastError()) << ")";
}

#if KILN_Q4
void Linear(TensorView x, TensorView w, TensorView scale, TensorView zeros, TensorView y, TensorView bias,
            TensorView residual, int64_t epilogue) {
  Run(x, w, MainloopArgs(x, w, scale, zeros), y, bias, residual, epilogue);
}
#else
void Linear(TensorView x, TensorView w, TensorView y, TensorView bias, TensorView residual, int64_t epilogue) {
  Run(x, w, MainloopArgs(x, w), y, bias, residual, epilogue);
}
#endif

}  // namespace

// A global function (not a library symbol): the linear's TIR calls it through call_packed, which
// looks in the library's imports and the global registry.
TVM_FFI_STATIC_INIT_BLOCK() {
  tvm::ffi::reflection::GlobalDef().def(KILN_STR(KILN_GEMM_NAME), Linear);
}
