"""Multi-head Latent Attention (DeepSeek-V2/V3) over a latent KV cache (kiln/interface.py KVSpec kind "latent").

Each token stores one row: c_kv (the compressed KV after kv_a_layernorm, R = kv_lora_rank values)
then k_pe (the roped key shared by every head, P = qk_rope_head_dim values). kv_b_proj
[H (N + V), R] expands c_kv per head into a no-rope key (N = qk_nope_head_dim) and a value (V).
  latent_append   writes the step's rows (quantised with one scale per row for an int8/fp8 cache)
  mla_attend      the importer's literal attention: keys [k_nope | k_pe] and values rebuilt from
                  the pages through kv_b_proj, then causal softmax attention per head, as
                  transformers computes it
  latent_attend   the absorbed form's core: MQA of q_latent [T, H, R] and q_rope [T, H, P] over
                  the rows themselves (keys R + P wide, values their first R)
  head_linear     a per-head matmul, x [T, H, K] by w [H, K, N]: q_nope · W_UK into latent space
                  and the latent output · W_UV back to V per head
  latent_gather   every sequence's stored rows, in order, as one dense tensor (dequantised)
  expanded_attend causal attention per head over keys and values already rebuilt from those rows
                  by a linear with kv_b_proj: the expanded form, MHA with qk N + P and v V
specialize_mla rewrites mla_attend into head_linear -> latent_attend -> head_linear, and on targets
that want it the expanded form beside it for prefill steps (ir/step_forms.py step_choice).
"""
from __future__ import annotations

import numpy as np

from .opdef import REQUIRED, as_type, check_indices, check_kv_storage, f32, need_float, op
from .quant import kv_scheme_for
from .types import TensorType, numpy_dtype

PAGE_INDICES = ("q_indptr", "page_indptr", "page_values", "last_page_len")


def check_latent_pages(pages: TensorType, scales, width: int, dtype: str, fail) -> None:
    """The type rule of a latent layer's pages [pages, 1, 1, page_size, width] (and row scales)."""
    if pages.rank != 5 or pages.shape[1:3] != (1, 1) or pages.shape[4] != width:
        fail(f"latent kv_pages must be [pages, 1, 1, page_size, {width}], got {pages}")
    check_kv_storage(pages, scales, dtype, fail)


def _sequence_rows(pages, scales, seq_pages: np.ndarray, kv_len: int) -> np.ndarray:
    """A sequence's stored latent rows [kv_len, width] in float32, dequantised."""
    page_size = pages.shape[3]
    at = np.arange(kv_len)
    page, row = seq_pages[at // page_size], at % page_size
    rows = f32(pages[page, 0, 0, row])
    return rows if scales is None else rows * scales[page, 0, 0, row][:, None]


@op("latent_append", ["c_kv", "k_pe", "kv_pages", "slot_mapping", "kv_scales?"], {"layer": REQUIRED, "kernels": None},
    mutates=(2, 4))
def _latent_append():
    """Write [c_kv[t] | k_pe[t]] (c_kv [tokens, R], k_pe [tokens, P]) of every new token t into the
    latent pages at slot_mapping[t], one scale per row for a quantised cache. The result is the
    pages after the write (the same buffer)."""
    def rule(types, attrs, fail):
        c, pe, pages, slots, scales = types
        if c.rank != 2 or pe.rank != 2 or c.shape[0] != pe.shape[0] or c.dtype != pe.dtype:
            fail(f"c_kv and k_pe must be [tokens, R] and [tokens, P] of one dtype, got {c}, {pe}")
        check_latent_pages(pages, scales, c.shape[1] + pe.shape[1], c.dtype, fail)
        check_indices({"slot_mapping": slots}, fail)
        return pages

    def ref(x, at, ty, dims):
        c, pe, pages, slots = x[:4]
        scales = x[4] if len(x) > 4 else None
        scheme = kv_scheme_for(pages.dtype.name)
        page_size = pages.shape[3]
        for t, slot in enumerate(np.asarray(slots).tolist()):
            page, row = divmod(slot, page_size)
            new = np.concatenate([c[t], pe[t]])
            if scheme is None:
                pages[page, 0, 0, row] = new
            else:
                quantized, scale = scheme.quantize_rows(new[None])
                pages[page, 0, 0, row], scales[page, 0, 0, row] = quantized[0], scale[0]
        return pages
    return rule, ref


@op("mla_attend", ["q_nope", "q_rope", "kv_pages", "kv_b", *PAGE_INDICES, "kv_scales?"],
    {"layer": REQUIRED, "scale": REQUIRED})
def _mla_attend():
    """Causal attention of a ragged batch over latent pages (already holding this step's rows), keys
    and values expanded as transformers' DeepSeek attention does.

    Head h's query is [q_nope[t, h] | q_rope[t, h]] (q_nope [tokens, H, N], q_rope [tokens, H, P],
    roped); kv_b [H (N + V), R] is kv_b_proj. A stored row [c | k_pe] gives head h the key
    [c · kv_b_k[h]ᵀ | k_pe] and the value c · kv_b_v[h]ᵀ (kv_b_k[h], kv_b_v[h]: head h's N then V
    rows of kv_b), the products rounded to q's dtype. Sequences and causality as paged_attend;
    scores q·k * scale, softmax in float32. Output [tokens, H, V]."""
    def rule(types, attrs, fail):
        qn, qr, pages, kv_b, qi, pi, pv, lpl, scales = types
        need_float(qn, "q_nope", fail)
        if qn.rank != 3 or qr.rank != 3 or qn.shape[:2] != qr.shape[:2] or qn.dtype != qr.dtype:
            fail(f"q_nope and q_rope must be [tokens, heads, N] and [tokens, heads, P], got {qn}, {qr}")
        heads, nope = qn.shape[1], qn.shape[2]
        if kv_b.rank != 2 or kv_b.dtype != qn.dtype or kv_b.shape[0] % heads or kv_b.shape[0] // heads <= nope:
            fail(f"kv_b must be {qn.dtype}[{heads} × ({nope} + v), R], got {kv_b}")
        check_latent_pages(pages, scales, kv_b.shape[1] + qr.shape[2], qn.dtype, fail)
        check_indices(dict(zip(PAGE_INDICES, (qi, pi, pv, lpl))), fail)
        return TensorType((qn.shape[0], heads, kv_b.shape[0] // heads - nope), qn.dtype)

    def ref(x, at, ty, dims):
        qn, qr, pages, kv_b, qi, pi, pv, lpl = x[:8]
        scales = x[8] if len(x) > 8 else None
        dtype = numpy_dtype(ty.dtype)
        heads, n = qn.shape[1], qn.shape[2]
        rank = kv_b.shape[1]
        kv_b = f32(kv_b)
        out = np.zeros((qn.shape[0], heads, kv_b.shape[0] // heads - n), np.float32)
        for s in range(len(qi) - 1):
            seq_pages = np.asarray(pv[pi[s]:pi[s + 1]], np.int64)
            kv_len = (len(seq_pages) - 1) * pages.shape[3] + int(lpl[s]) if len(seq_pages) else 0
            rows = _sequence_rows(pages, scales, seq_pages, kv_len)
            c, k_pe = rows[:, :rank], rows[:, rank:]
            expanded = f32((c @ kv_b.T).astype(dtype)).reshape(kv_len, heads, -1)     # [L, H, N + V]
            n_q = int(qi[s + 1]) - int(qi[s])
            for i in range(n_q):
                t, seen = int(qi[s]) + i, kv_len - n_q + i + 1
                for h in range(heads):
                    keys = np.concatenate([expanded[:seen, h, :n], k_pe[:seen]], axis=1)
                    query = np.concatenate([f32(qn[t, h]), f32(qr[t, h])])
                    scores = keys @ query * np.float32(at["scale"])
                    w = np.exp(scores - scores.max())
                    out[t, h] = (w / w.sum()) @ expanded[:seen, h, n:]
        return as_type(out, ty)
    return rule, ref


@op("latent_attend", ["q_latent", "q_rope", "kv_pages", *PAGE_INDICES, "kv_scales?"],
    {"layer": REQUIRED, "scale": REQUIRED, "kernels": None})
def _latent_attend():
    """MQA over latent rows: every head's query is [q_latent[t, h] | q_rope[t, h]] (R + P wide),
    every key a stored row [c | k_pe] and its value c. Sequences and causality as paged_attend;
    scores q·k * scale, softmax in float32. Output [tokens, H, R] in q's dtype."""
    def rule(types, attrs, fail):
        ql, qr, pages, qi, pi, pv, lpl, scales = types
        need_float(ql, "q_latent", fail)
        if ql.rank != 3 or qr.rank != 3 or ql.shape[:2] != qr.shape[:2] or ql.dtype != qr.dtype:
            fail(f"q_latent and q_rope must be [tokens, heads, R] and [tokens, heads, P], got {ql}, {qr}")
        check_latent_pages(pages, scales, ql.shape[2] + qr.shape[2], ql.dtype, fail)
        check_indices(dict(zip(PAGE_INDICES, (qi, pi, pv, lpl))), fail)
        return ql

    def ref(x, at, ty, dims):
        ql, qr, pages, qi, pi, pv, lpl = x[:7]
        scales = x[7] if len(x) > 7 else None
        scheme = kv_scheme_for(pages.dtype.name)
        rank, page_size = ql.shape[2], pages.shape[3]
        query = np.concatenate([f32(ql), f32(qr)], axis=-1)             # [T, H, R + P]
        out = np.zeros(ql.shape, np.float32)
        for s in range(len(qi) - 1):
            n_pages = int(pi[s + 1]) - int(pi[s])
            kv_len = (n_pages - 1) * page_size + int(lpl[s]) if n_pages else 0
            slots = [int(pv[int(pi[s]) + j // page_size]) * page_size + j % page_size for j in range(kv_len)]
            rows = np.stack([f32(pages[slot // page_size, 0, 0, slot % page_size]) for slot in slots])
            if scheme is not None:
                rows = rows * np.asarray([scales[slot // page_size, 0, 0, slot % page_size] for slot in slots],
                                         np.float32)[:, None]
            lo, hi = int(qi[s]), int(qi[s + 1])
            scores = np.einsum("thw,lw->htl", query[lo:hi], rows) * np.float32(at["scale"])
            visible = np.arange(kv_len)[None, :] <= (kv_len - (hi - lo) + np.arange(hi - lo))[:, None]
            scores = np.where(visible[None], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[lo:hi] = np.einsum("htl,lr->thr", p, rows[:, :rank])
        return as_type(out, ty)
    return rule, ref


@op("latent_gather", ["kv_pages", "kv_slots", "kv_scales?"], {"layer": REQUIRED, "dtype": REQUIRED, "kernels": None})
def _latent_gather():
    """The stored rows at kv_slots [kv_tokens] (every sequence's context in order, ir/step_forms.py),
    dequantised, in `dtype`: [kv_tokens, R + P]."""
    def rule(types, attrs, fail):
        pages, slots, scales = types
        check_latent_pages(pages, scales, pages.shape[4], attrs["dtype"], fail)
        check_indices({"kv_slots": slots}, fail)
        return TensorType((slots.shape[0], pages.shape[4]), attrs["dtype"])

    def ref(x, at, ty, dims):
        pages, slots = x[0], np.asarray(x[1], np.int64)
        page, row = slots // pages.shape[3], slots % pages.shape[3]
        rows = f32(pages[page, 0, 0, row])
        return as_type(rows if len(x) < 3 else rows * x[2][page, 0, 0, row][:, None], ty)
    return rule, ref


@op("expanded_attend", ["q_nope", "q_rope", "kv", "rows", "q_indptr", "kv_indptr"],
    {"layer": REQUIRED, "scale": REQUIRED, "kernels": None})
def _expanded_attend():
    """Causal attention per head over keys and values rebuilt from latent rows. Sequence s's context
    is rows kv_indptr[s]:kv_indptr[s + 1] of rows [kv_tokens, R + P] (from latent_gather) and of kv
    [kv_tokens, H (N + V)] (their first R values through kv_b_proj: head h's N key then V value
    values). Head h's query [q_nope[t, h] | q_rope[t, h]] scores the key [kv k-part of h | the row's
    last P values]; its values are kv's V part of h. Causality as paged_attend (a sequence's new
    tokens are the last of its context); scores q·k * scale, softmax in float32. Output [tokens, H, V]."""
    def rule(types, attrs, fail):
        qn, qr, kv, rows, qi, ki = types
        need_float(qn, "q_nope", fail)
        if qn.rank != 3 or qr.rank != 3 or qn.shape[:2] != qr.shape[:2] or qn.dtype != qr.dtype:
            fail(f"q_nope and q_rope must be [tokens, heads, N] and [tokens, heads, P], got {qn}, {qr}")
        heads, nope, rope = qn.shape[1], qn.shape[2], qr.shape[2]
        if (kv.rank != 2 or rows.rank != 2 or kv.shape[0] != rows.shape[0] or kv.dtype != qn.dtype
                or rows.dtype != qn.dtype or kv.shape[1] % heads or kv.shape[1] // heads <= nope
                or rows.shape[1] <= rope):
            fail(f"kv and rows must be {qn.dtype}[kv_tokens, {heads} × ({nope} + v)] and "
                 f"{qn.dtype}[kv_tokens, R + {rope}], got {kv}, {rows}")
        check_indices({"q_indptr": qi, "kv_indptr": ki}, fail)
        return TensorType((qn.shape[0], heads, kv.shape[1] // heads - nope), qn.dtype)

    def ref(x, at, ty, dims):
        qn, qr, kv, rows, qi, ki = x
        heads, nope, rope = qn.shape[1], qn.shape[2], qr.shape[2]
        kv = f32(kv).reshape(kv.shape[0], heads, -1)
        query = np.concatenate([f32(qn), f32(qr)], axis=-1)                  # [T, H, N + P]
        out = np.zeros((qn.shape[0], heads, kv.shape[2] - nope), np.float32)
        for s in range(len(qi) - 1):
            lo, hi, k_lo, k_hi = int(qi[s]), int(qi[s + 1]), int(ki[s]), int(ki[s + 1])
            ctx = kv[k_lo:k_hi]
            k_pe = np.broadcast_to(f32(rows[k_lo:k_hi, -rope:])[:, None], (k_hi - k_lo, heads, rope))
            keys = np.concatenate([ctx[:, :, :nope], k_pe], axis=-1)            # [L, H, N + P]
            scores = np.einsum("thd,lhd->htl", query[lo:hi], keys) * np.float32(at["scale"])
            kv_len, n_q = k_hi - k_lo, hi - lo
            visible = np.arange(kv_len)[None, :] <= (kv_len - n_q + np.arange(n_q))[:, None]
            scores = np.where(visible[None], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[lo:hi] = np.einsum("htl,lhv->thv", p, ctx[:, :, nope:])
        return as_type(out, ty)
    return rule, ref


@op("head_linear", ["x", "weight"])
def _head_linear():
    """A matmul per head: out[t, h] = x[t, h] · weight[h] for x [tokens, H, K] and weight [H, K, N],
    in float32, rounded to x's dtype. Output [tokens, H, N]."""
    def rule(types, attrs, fail):
        x, w = types
        need_float(x, "x", fail)
        if x.rank != 3 or w.rank != 3 or w.shape[0] != x.shape[1] or w.shape[1] != x.shape[2] or w.dtype != x.dtype:
            fail(f"head_linear wants x [tokens, H, K] and weight {x.dtype}[H, K, N], got {x}, {w}")
        return TensorType((x.shape[0], x.shape[1], w.shape[2]), x.dtype)
    return rule, lambda x, at, ty, dims: as_type(np.einsum("thk,hkn->thn", f32(x[0]), f32(x[1])), ty)
