// What kiln's FlashInfer bindings share: a DLTensor view of another tensor, its byte offset folded into
// its data pointer (FlashInfer reads `data` alone), optionally reshaped and restrided; a step's plan info.
#pragma once
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>

#include <initializer_list>

namespace kiln {

struct View {
  DLTensor tensor;
  int64_t shape[5];
  int64_t strides[5];

  // `base` as it is, `extra_bytes` further on
  explicit View(const tvm::ffi::TensorView& base, int64_t extra_bytes = 0) {
    tensor.data = static_cast<char*>(base.data_ptr()) + base.byte_offset() + extra_bytes;
    tensor.device = base.device();
    tensor.ndim = base.ndim();
    tensor.dtype = base.dtype();
    tensor.byte_offset = 0;
    for (int i = 0; i < base.ndim(); ++i) {
      shape[i] = base.shape()[i];
      strides[i] = base.strides()[i];
    }
    tensor.shape = shape;
    tensor.strides = strides;
  }

  // `base`'s elements from element `first` on, as `new_shape` with `new_strides` (in elements)
  View(const tvm::ffi::TensorView& base, int64_t first, std::initializer_list<int64_t> new_shape,
       std::initializer_list<int64_t> new_strides)
      : View(base, first * ((base.dtype().bits * base.dtype().lanes) / 8)) {
    tensor.ndim = static_cast<int32_t>(new_shape.size());
    int i = 0;
    for (int64_t d : new_shape) shape[i++] = d;
    i = 0;
    for (int64_t s : new_strides) strides[i++] = s;
  }

  tvm::ffi::TensorView view() const { return tvm::ffi::TensorView(&tensor); }
};

// FlashInfer's plan info from the host int64 tensor the runtime passes it in (runtime/flashinfer_plan.py)
inline tvm::ffi::Array<int64_t> PlanInfo(const tvm::ffi::TensorView& plan) {
  const int64_t* info = static_cast<const int64_t*>(plan.data_ptr());
  return tvm::ffi::Array<int64_t>(info, info + plan.size(0));
}

}  // namespace kiln
