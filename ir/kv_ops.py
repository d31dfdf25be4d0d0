"""The paged KV cache as two ops: kv_append writes a step's new K/V rows, paged_attend reads them.

This is what the frontend emits. `paged_attention` (ir/ops.py) is their fused form, made by the
fuse_append_attend pass, and `paged_attention_fused` adds the q/k/v slices and rope; each op's
reference is written on its own (tests compare them).
Page layout (every op): kv_pages [num_pages, 2 (k, v), kv_heads, page_size, head_dim]; slot s is
row s % page_size of page s // page_size. Quantised pages (int8, float8_e4m3fn) store each row
as x / scale with its float32 scale in kv_scales [num_pages, 2, kv_heads, page_size].
"""
from __future__ import annotations

import numpy as np

from .ops import REQUIRED, _as, _f32, check_indices, check_kv_pages, op
from .quant import kv_scheme_for


@op("kv_append", ["k", "v", "kv_pages", "slot_mapping", "kv_scales?"], {"layer": REQUIRED}, mutates=(2, 4))
def _kv_append():
    """Write k[t] and v[t] ([tokens, kv_heads, head_dim]) of every new token t into kv_pages at
    slot_mapping[t], quantising each row for a quantised cache. The result is kv_pages itself
    after the write (the same buffer): ops that read it come after the write."""
    def rule(types, attrs, fail):
        k, v, pages, slots, scales = types
        if k.rank != 3 or k != v:
            fail(f"k and v must be [tokens, kv_heads, head_dim] of one type, got {k}, {v}")
        check_kv_pages(pages, scales, k.shape[1], k.shape[2], k.dtype, fail)
        check_indices({"slot_mapping": slots}, fail)
        return pages

    def ref(x, at, ty, dims):
        k, v, pages, slots = x[:4]
        scales = x[4] if len(x) > 4 else None
        scheme = kv_scheme_for(pages.dtype.name)
        page_size = pages.shape[3]
        for t, slot in enumerate(np.asarray(slots).tolist()):
            page, row = divmod(slot, page_size)
            for kind, rows in ((0, k), (1, v)):
                if scheme is None:
                    pages[page, kind, :, row] = rows[t]
                else:
                    pages[page, kind, :, row], scales[page, kind, :, row] = scheme.quantize_rows(rows[t:t + 1])
        return pages
    return rule, ref


@op("paged_attend", ["q", "kv_pages", "q_indptr", "page_indptr", "page_values", "last_page_len", "kv_scales?"],
    {"layer": REQUIRED, "scale": REQUIRED, "window": 0, "softcap": 0.0})
def _paged_attend():
    """Causal attention of a ragged batch over paged KV (already holding this step's rows).

    Sequence s has queries q[q_indptr[s]:q_indptr[s+1]] ([tokens, q_heads, head_dim]) and pages
    page_values[page_indptr[s]:page_indptr[s+1]], the last holding last_page_len[s] rows; query i
    of n sits at position p = kv_len - n + i and sees keys j <= p, or with a sliding `window` W > 0
    only p - W < j <= p (keys outside are never read: their pages may be gone). Query head h
    reads KV head h // (q_heads / kv_heads). Scores are q·k * scale, soft-capped to
    softcap * tanh(score / softcap) when softcap > 0, then softmax in float32.
    """
    def rule(types, attrs, fail):
        q, pages, qi, pi, pv, lpl, scales = types
        if q.rank != 3 or pages.rank != 5:
            fail(f"q must be [tokens, q_heads, head_dim] and kv_pages 5-D, got {q}, {pages}")
        if q.shape[1] % pages.shape[2]:
            fail(f"query heads {q.shape[1]} are not a multiple of the pages' kv heads {pages.shape[2]}")
        check_kv_pages(pages, scales, pages.shape[2], q.shape[2], q.dtype, fail)
        check_indices(dict(q_indptr=qi, page_indptr=pi, page_values=pv, last_page_len=lpl), fail)
        return q

    def ref(x, at, ty, dims):
        q, pages, qi, pi, pv, lpl = x[:6]
        scales = x[6] if len(x) > 6 else None
        scheme = kv_scheme_for(pages.dtype.name)
        page_size, q_heads, kv_heads = pages.shape[3], q.shape[1], pages.shape[2]
        group, window, cap = q_heads // kv_heads, at["window"], np.float32(at["softcap"])
        out = np.zeros(q.shape, np.float32)
        for s in range(len(qi) - 1):
            seq_pages = np.asarray(pv[pi[s]:pi[s + 1]], np.int64)
            kv_len = (len(seq_pages) - 1) * page_size + int(lpl[s]) if len(seq_pages) else 0
            n = int(qi[s + 1]) - int(qi[s])
            for i in range(n):
                p = kv_len - n + i
                keys_at = np.arange(max(0, p - window + 1) if window else 0, p + 1)
                page, row = seq_pages[keys_at // page_size], keys_at % page_size
                stored = _f32(pages[page, :, :, row])                        # [L, 2, kv_heads, head_dim]
                if scheme is not None:
                    stored = stored * scales[page, :, :, row][..., None]
                for h in range(q_heads):
                    keys, values = stored[:, 0, h // group], stored[:, 1, h // group]
                    scores = keys @ _f32(q[int(qi[s]) + i, h]) * np.float32(at["scale"])
                    if cap:
                        scores = np.tanh(scores / cap) * cap
                    w = np.exp(scores - scores.max())
                    out[int(qi[s]) + i, h] = (w / w.sum()) @ values
        return _as(out, ty)
    return rule, ref

