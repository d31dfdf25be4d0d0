"""The paged KV cache ops: kv_append writes a step's new K/V rows, paged_attend reads them, and
their fused forms.

kv_append and paged_attend are what the frontend emits. `paged_attention` is their fused form,
made by the fuse_append_attend pass, and `paged_attention_fused` adds the q/k/v slices and rope
(fuse_rope_attention); each op's reference is written on its own (tests compare them).
Page layout (every op): kv_pages [num_pages, 2 (k, v), kv_heads, page_size, head_dim]; slot s is
row s % page_size of page s // page_size. Quantised pages (int8, float8_e4m3fn) store each row
as x / scale with its float32 scale in kv_scales [num_pages, 2, kv_heads, page_size].
"""
from __future__ import annotations

import numpy as np

from .opdef import OPS, REQUIRED, as_type, check_indices, check_kv_pages, f32, need_float, op
from .quant import kv_scheme_for
from .types import TensorType, numpy_dtype


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
            # the rows any of this step's queries reads, gathered once (a window's older rows are not read)
            first = max(0, kv_len - n - window + 1) if window else 0
            readable = np.arange(first, kv_len)
            page, row = seq_pages[readable // page_size], readable % page_size
            rows = f32(pages[page, :, :, row])                                  # [rows, 2, kv_heads, head_dim]
            if scheme is not None:
                rows = rows * scales[page, :, :, row][..., None]
            keys_t, values_t = rows[:, 0].transpose(1, 2, 0), rows[:, 1].transpose(1, 0, 2)
            for i in range(n):
                p = kv_len - n + i
                start = (max(0, p - window + 1) if window else 0) - first
                # every query head at once: head h reads KV head h // group
                queries = f32(q[int(qi[s]) + i]).reshape(kv_heads, group, -1)           # [kv_heads, group, D]
                scores = np.matmul(queries, keys_t[:, :, start:p + 1 - first]) * np.float32(at["scale"])
                if cap:
                    scores = np.tanh(scores / cap) * cap
                w = np.exp(scores - scores.max(axis=-1, keepdims=True))
                w /= w.sum(axis=-1, keepdims=True)                                     # [kv_heads, group, keys]
                out[int(qi[s]) + i] = np.matmul(w, values_t[:, start:p + 1 - first]).reshape(q_heads, -1)
        return as_type(out, ty)
    return rule, ref


@op("paged_attention",
    ["q", "k", "v", "kv_pages", "slot_mapping", "q_indptr", "page_indptr", "page_values", "last_page_len",
     "kv_scales?"],
    {"layer": REQUIRED, "scale": REQUIRED, "window": 0, "softcap": 0.0, "variant": "auto", "kernels": None},
    mutates=(3, 9))
def _paged_attention():
    """Causal attention of a ragged batch over paged KV.

    First writes k and v of every new token into kv_pages at slot_mapping[t]
    (page = slot // page_size, row = slot % page_size); then each sequence s
    (its queries are q[q_indptr[s]:q_indptr[s+1]]) attends over its pages
    page_values[page_indptr[s]:page_indptr[s+1]], the last one holding
    last_page_len[s] rows. Query i of n sits at position p = kv_len - n + i and attends to keys
    j <= p; with a sliding `window` W > 0 only to keys p - W < j <= p (the last W positions).
    Keys outside that range are never read (their pages may have been freed).
    Scores are q·k * scale, and with `softcap` c > 0, c * tanh(score / c) (Gemma 2), before softmax.
    kv_pages: [num_pages, 2 (k, v), kv_heads, page_size, head_dim].
    Quantised pages (int8 or float8_e4m3fn, ir/quant.py KV_SCHEMES) store each row as
    x / scale with its float32 scale in kv_scales [num_pages, 2, kv_heads, page_size];
    attention reads q * scale.
    `variant` names the head ratio's family ("mha", "gqaN", "mqa"; "auto" until select_kernels
    records it) and `kernels` the kernel each kind of step runs (selection/choice.py; None until
    select_kernels records it); neither changes the result.
    """
    def rule(types, attrs, fail):
        q, k, v, pages, slots, qi, pi, pv, lpl, scales = types
        if q.rank != 3 or k.rank != 3 or k != v:
            fail(f"q, k, v must be [tokens, heads, head_dim] with k == v, got {q}, {k}, {v}")
        if q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0] or q.dtype != k.dtype:
            fail(f"q {q} and k {k} disagree on tokens, head_dim or dtype")
        if q.shape[1] % k.shape[1]:
            fail(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
        check_kv_pages(pages, scales, k.shape[1], k.shape[2], k.dtype, fail)
        check_indices(dict(slot_mapping=slots, q_indptr=qi, page_indptr=pi, page_values=pv, last_page_len=lpl), fail)
        return q

    def ref(x, at, ty, dims):
        q, k, v, pages, slots, qi, pi, pv, lpl = x[:9]
        scales = x[9] if len(x) > 9 else None
        page_size = pages.shape[3]
        page, row = slots // page_size, slots % page_size
        scheme = kv_scheme_for(pages.dtype.name)
        for kind, new in ((0, k), (1, v)):
            if scheme is None:
                pages[page, kind, :, row] = new
            else:
                pages[page, kind, :, row], scales[page, kind, :, row] = scheme.quantize_rows(new)

        def rows_of(seq_pages, kind):           # [kv_len_padded, kv_heads, head_dim] in float32
            vals = f32(pages[seq_pages, kind])
            if scheme is not None:
                vals = vals * scales[seq_pages, kind][..., None]
            return vals.transpose(0, 2, 1, 3).reshape(-1, k.shape[1], k.shape[2])

        group, window = q.shape[1] // k.shape[1], at["window"]
        out = np.zeros(q.shape, np.float32)
        for s in range(len(qi) - 1):
            rows = slice(int(qi[s]), int(qi[s + 1]))
            n = rows.stop - rows.start
            seq_pages = pv[pi[s]:pi[s + 1]]
            kv_len = (len(seq_pages) - 1) * page_size + int(lpl[s]) if len(seq_pages) else 0
            # only the pages some query sees are read: with a window, earlier ones may be gone
            first_key = max(0, kv_len - n + 1 - window) if window else 0
            first_page = first_key // page_size
            offset = first_page * page_size
            keys = rows_of(seq_pages[first_page:], 0)[:kv_len - offset]           # positions offset..
            vals = rows_of(seq_pages[first_page:], 1)[:kv_len - offset]
            qs = f32(q[rows])                                                  # [n, Hq, D]
            kh = np.repeat(keys, group, axis=1)                                 # [L, Hq, D]
            vh = np.repeat(vals, group, axis=1)
            scores = np.einsum("nhd,lhd->hnl", qs, kh) * np.float32(at["scale"])
            if at["softcap"]:
                scores = np.tanh(scores / np.float32(at["softcap"])) * np.float32(at["softcap"])
            key_pos = offset + np.arange(kv_len - offset)[None, :]
            query_pos = (kv_len - n + np.arange(n))[:, None]
            visible = (key_pos <= query_pos) & ((key_pos > query_pos - window) if window else True)
            scores = np.where(visible[None], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[rows] = np.einsum("hnl,lhd->nhd", np.where(visible[None], p, 0), vh)
        return as_type(out, ty)
    return rule, ref


@op("paged_attention_fused",
    ["qkv", "positions", "inv_freq", "kv_pages", "slot_mapping", "q_indptr", "page_indptr", "page_values",
     "last_page_len", "kv_scales?"],
    {"layer": REQUIRED, "scale": REQUIRED, "window": 0, "softcap": 0.0, "variant": "auto", "kernels": None,
     "mscale": 1.0, "rotary_dim": 0, "q_heads": REQUIRED, "kv_heads": REQUIRED, "head_dim": REQUIRED}, mutates=(3, 9))
def _paged_attention_fused():
    """paged_attention over the parts of one fused projection, rope applied inside: with
    D = head_dim, Hq = q_heads, Hkv = kv_heads and qkv [tokens, (Hq + 2 Hkv) D],
        q = rope(qkv[:, :Hq D]),  k = rope(qkv[:, Hq D:(Hq + Hkv) D]),  v = qkv[:, (Hq + Hkv) D:]
    (rope as the rope op, rounded to qkv's dtype), each viewed [tokens, heads, D]; then exactly
    paged_attention(q, k, v, kv_pages, slot_mapping, …, kv_scales)."""
    def parts(at):
        d, hq, hkv = at["head_dim"], at["q_heads"], at["kv_heads"]
        return d, ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv))     # head ranges of q, k, v

    def rule(types, attrs, fail):
        qkv, pos, inv = types[:3]
        d, ranges = parts(attrs)
        need_float(qkv, "qkv", fail)
        if qkv.rank != 2 or qkv.shape[1] != ranges[2][1] * d:
            fail(f"qkv must be [tokens, {ranges[2][1] * d}] for {attrs['q_heads']}/{attrs['kv_heads']} heads "
                 f"of {d}, got {qkv}")
        OPS["rope"].type_rule([TensorType((qkv.shape[0], d), qkv.dtype), pos, inv],
                              {"head_dim": d, "rotary_dim": attrs["rotary_dim"]}, fail)
        q, k = (TensorType((qkv.shape[0], hi - lo, d), qkv.dtype) for lo, hi in ranges[:2])
        return OPS["paged_attention"].type_rule([q, k, k, *types[3:]], attrs, fail)

    def ref(x, at, ty, dims):
        # Written apart from the rope and paged_attention references (tests compare the two
        # graphs): token by token, each query walks its sequence's slots through the page table.
        qkv, pos, inv, pages, slots, qi, pi, pv, lpl = x[:9]
        scales = x[9] if len(x) > 9 else None
        d, (_, k_heads, v_heads) = parts(at)
        r = at["rotary_dim"] or d
        half, page_size, dtype = r // 2, pages.shape[3], numpy_dtype(ty.dtype)
        heads = f32(qkv).reshape(qkv.shape[0], -1, d)                          # [T, Hq + 2 Hkv, D]

        def rotated(t: int, h: int) -> np.ndarray:     # head h of token t turned by pos[t] * inv_freq
            ang = np.float32(pos[t]) * f32(inv)
            a, b = heads[t, h, :half], heads[t, h, half:r]
            turned = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)])
            return np.concatenate([turned * np.float32(at["mscale"]), heads[t, h, r:]]).astype(dtype)

        scheme = kv_scheme_for(pages.dtype.name)
        for t, slot in enumerate(slots.tolist()):
            page, row = divmod(slot, page_size)
            new = (np.stack([rotated(t, h) for h in range(*k_heads)]), heads[t, v_heads[0]:v_heads[1]].astype(dtype))
            for kind in (0, 1):
                if scheme is None:
                    pages[page, kind, :, row] = new[kind]
                else:
                    pages[page, kind, :, row], scales[page, kind, :, row] = scheme.quantize_rows(new[kind])

        def stored(kind: int, slot_ids: np.ndarray) -> np.ndarray:         # [L, Hkv, D] in float32
            page, row = slot_ids // page_size, slot_ids % page_size
            vals = f32(pages[page, kind, :, row])
            return vals if scheme is None else vals * scales[page, kind, :, row][..., None]

        group = at["q_heads"] // at["kv_heads"]
        out = np.zeros((qkv.shape[0], at["q_heads"], d), np.float32)
        for s in range(len(qi) - 1):
            seq_pages = np.asarray(pv[pi[s]:pi[s + 1]], np.int64)
            kv_len = (len(seq_pages) - 1) * page_size + int(lpl[s])
            seq_slots = seq_pages[np.arange(kv_len) // page_size] * page_size + np.arange(kv_len) % page_size
            first = kv_len - (int(qi[s + 1]) - int(qi[s]))                     # position of the first query
            for i, t in enumerate(range(int(qi[s]), int(qi[s + 1]))):
                seen = first + i + 1                                            # causal: itself and before
                lo = max(0, seen - at["window"]) if at["window"] else 0           # a window: the last W only
                keys, values = stored(0, seq_slots[lo:seen]), stored(1, seq_slots[lo:seen])
                for h in range(at["q_heads"]):
                    q = f32(rotated(t, h))
                    logits = keys[:, h // group] @ q * np.float32(at["scale"])
                    if at["softcap"]:
                        logits = np.tanh(logits / np.float32(at["softcap"])) * np.float32(at["softcap"])
                    w = np.exp(logits - logits.max())
                    out[t, h] = (w / w.sum()) @ values[:, h // group]
        return as_type(out, ty)
    return rule, ref
