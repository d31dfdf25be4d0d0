// kiln's binding to FlashInfer's batch prefill over paged KV (codegen/kernels/gpu/flashinfer.py builds it
// beside FlashInfer's own objects and links both into the artifact's library).
//
// Two exported functions, in the shape kiln's graph and runtime want them:
//   kiln_flashinfer_plan    the host-side plan of one step (runtime/flashinfer_plan.py calls it once per step
//                           and shape, before the step's launches); returns FlashInfer's plan info.
//   kiln_flashinfer_attend  destination-passing: the output tensor comes last, as relax.call_dps_packed
//                           passes it. It reads kiln's page layout [pages, 2, kv_heads, page_size, head_dim]
//                           (FlashInfer's HND with K and V interleaved per page) through strided views.
// Every tensor reaches FlashInfer as a kiln::View (flashinfer_views.h).
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include "flashinfer_views.h"

using tvm::ffi::Array;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;
using kiln::View;

// FlashInfer's functions (its batch_prefill.cu, built with the scalars logits_soft_cap, sm_scale,
// rope_rcp_scale and rope_rcp_theta, in that order).
Array<int64_t> BatchPrefillWithKVCachePlan(
    TensorView float_workspace_buffer, TensorView int_workspace_buffer,
    TensorView page_locked_int_workspace_buffer, TensorView qo_indptr, TensorView kv_indptr,
    TensorView kv_len_arr, int64_t total_num_rows, int64_t batch_size, int64_t num_qo_heads,
    int64_t num_kv_heads, int64_t page_size, bool enable_cuda_graph, int64_t head_dim_qk,
    int64_t head_dim_vo, bool causal, int64_t window_left, int64_t fixed_split_size,
    bool disable_split_kv, int64_t num_colocated_ctas);

void BatchPrefillWithPagedKVCacheRun(
    TensorView float_workspace_buffer, TensorView int_workspace_buffer, Array<int64_t> plan_info_vec,
    TensorView q, TensorView paged_k_cache, TensorView paged_v_cache, TensorView qo_indptr,
    TensorView paged_kv_indptr, TensorView paged_kv_indices, TensorView paged_kv_last_page_len,
    TensorView o, Optional<TensorView> maybe_lse, int64_t mask_mode_code, int64_t layout,
    int64_t window_left, bool enable_pdl, double logits_soft_cap, double sm_scale, double rope_rcp_scale,
    double rope_rcp_theta);

namespace {

constexpr int64_t kCausal = 1;  // FlashInfer's MaskMode::kCausal: the only mask kiln builds
constexpr int64_t kHND = 1;     // FlashInfer's QKVLayout::kHND

// K (half 0) or V (half 1) of kiln's pages: [pages, kv_heads, page_size, head_dim], each page's
// halves apart by kv_heads * page_size * head_dim elements.
View PagesHalf(const TensorView& pages, int half) {
  const int64_t heads = pages.shape()[2], page = pages.shape()[3], dim = pages.shape()[4];
  return View(pages, half * heads * page * dim, {pages.shape()[0], heads, page, dim},
              {2 * heads * page * dim, page * dim, dim, 1});
}

Array<int64_t> Plan(TensorView float_workspace, TensorView int_workspace, TensorView pinned_workspace,
                    TensorView qo_indptr, TensorView page_indptr, TensorView kv_lengths, int64_t rows,
                    int64_t seqs, int64_t q_heads, int64_t kv_heads, int64_t page_size, int64_t head_dim,
                    int64_t window_left) {
  return BatchPrefillWithKVCachePlan(float_workspace, int_workspace, pinned_workspace, qo_indptr,
                                     page_indptr, kv_lengths, rows, seqs, q_heads, kv_heads, page_size,
                                     /*enable_cuda_graph=*/false, head_dim, head_dim, /*causal=*/true,
                                     window_left, /*fixed_split_size=*/-1, /*disable_split_kv=*/false,
                                     /*num_colocated_ctas=*/0);
}

void Attend(TensorView q, TensorView pages, TensorView qo_indptr, TensorView page_indptr,
            TensorView page_values, TensorView last_page_len, TensorView float_workspace,
            TensorView int_workspace, TensorView plan, int64_t window_left, double logits_soft_cap,
            double sm_scale, TensorView out) {
  const View k = PagesHalf(pages, 0), v = PagesHalf(pages, 1);
  const View q_view(q), out_view(out);
  const View qo(qo_indptr), indptr(page_indptr);
  const View values(page_values), last(last_page_len);
  BatchPrefillWithPagedKVCacheRun(float_workspace, int_workspace, kiln::PlanInfo(plan), q_view.view(), k.view(),
                                  v.view(), qo.view(), indptr.view(), values.view(), last.view(),
                                  out_view.view(), Optional<TensorView>(), kCausal, kHND, window_left,
                                  /*enable_pdl=*/false, logits_soft_cap, sm_scale, /*rope_rcp_scale=*/1.0,
                                  /*rope_rcp_theta=*/1.0);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kiln_flashinfer_plan, Plan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kiln_flashinfer_attend, Attend);
