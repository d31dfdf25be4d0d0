// kiln's binding to FlashInfer's MLA attention over a paged latent cache (codegen/kernels/gpu/flashinfer.py
// builds it beside FlashInfer's objects). It exports the two functions flashinfer_binding.cc exports, with
// the same plan signature, so that the runtime plans either alike (runtime/flashinfer_plan.py):
//   kiln_flashinfer_plan    the host-side plan of one step: FlashInfer's MLA plan (causal; the KV head
//                           count, page size, head dim and window are the prefill binding's, unread here)
//   kiln_flashinfer_attend  destination-passing over kiln's latent pages [pages, 1, 1, page_size, R + P]:
//                           FlashInfer's latent (first R) and rope (last P) caches are strided views of them.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include "flashinfer_views.h"

using tvm::ffi::Array;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;
using kiln::View;

// FlashInfer's functions (its batch_mla_plan.cu and batch_mla_run.cu).
Array<int64_t> BatchMLAPagedAttentionPlan(TensorView float_workspace_buffer, TensorView int_workspace_buffer,
                                          TensorView page_locked_int_workspace_buffer, TensorView qo_indptr,
                                          TensorView kv_indptr, TensorView kv_len, int64_t num_heads,
                                          int64_t head_dim_o, bool causal);

void BatchMLAPagedAttentionRun(TensorView float_workspace_buffer, TensorView int_workspace_buffer,
                               Array<int64_t> plan_info_vec, TensorView q_nope, TensorView q_pe,
                               TensorView ckv_cache, TensorView kpe_cache, TensorView kv_indices, TensorView o,
                               Optional<TensorView> maybe_lse, int64_t mask_mode_code, int64_t num_heads,
                               int64_t page_size, double sm_scale, bool return_lse_base_on_e);

namespace {

constexpr int64_t kCausal = 1;  // FlashInfer's MaskMode::kCausal

// Columns [first, first + width) of every latent row: [pages, page_size, width], rows R + P apart.
View LatentColumns(const TensorView& pages, int64_t first, int64_t width) {
  const int64_t page = pages.shape()[3], row = pages.shape()[4];
  return View(pages, first, {pages.shape()[0], page, width}, {page * row, row, 1});
}

Array<int64_t> Plan(TensorView float_workspace, TensorView int_workspace, TensorView pinned_workspace,
                    TensorView qo_indptr, TensorView page_indptr, TensorView kv_lengths, int64_t /*rows*/,
                    int64_t /*seqs*/, int64_t q_heads, int64_t /*kv_heads*/, int64_t /*page_size*/,
                    int64_t head_dim, int64_t /*window_left*/) {
  return BatchMLAPagedAttentionPlan(float_workspace, int_workspace, pinned_workspace, qo_indptr, page_indptr,
                                    kv_lengths, q_heads, head_dim, /*causal=*/true);
}

void Attend(TensorView q_latent, TensorView q_rope, TensorView pages, TensorView page_values,
            TensorView float_workspace, TensorView int_workspace, TensorView plan, double sm_scale,
            TensorView out) {
  const int64_t latent = q_latent.shape()[2], rope = q_rope.shape()[2];
  const View ckv = LatentColumns(pages, 0, latent), kpe = LatentColumns(pages, latent, rope);
  const View q_nope(q_latent), q_pe(q_rope), values(page_values), o(out);
  BatchMLAPagedAttentionRun(float_workspace, int_workspace, kiln::PlanInfo(plan), q_nope.view(), q_pe.view(),
                            ckv.view(), kpe.view(), values.view(), o.view(), Optional<TensorView>(), kCausal,
                            q_latent.shape()[1], pages.shape()[3], sm_scale, /*return_lse_base_on_e=*/false);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kiln_flashinfer_plan, Plan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kiln_flashinfer_attend, Attend);
