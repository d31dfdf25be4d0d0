"""Interpreter examples of the ops that read a step's structure (the paged KV cache, MoE routing, MLA,
the step forms), for tests/test_ir.py's every-op check: each is (make, expect, inputs) with `make()`
a one-node graph whose node is %y, `inputs(rng)` its inputs, and `expect(inputs)` the output written
here in NumPy, from the op's docstring alone (causal attention through _dense_causal_attention).

Every example runs one step of two sequences over shuffled pages of 2 rows: sequence A has one token
cached and brings two (positions 1, 2 in pages [2, 0]), sequence B brings its first (page [1]).
"""
from __future__ import annotations

import numpy as np

from kiln.interface import KVSpec
from kiln.ir import GraphBuilder, verify

PAGE_SIZE, PAGES = 2, 3
STEP = {"q_indptr": [0, 2, 3], "page_indptr": [0, 2, 3], "page_values": [2, 0, 1], "last_page_len": [1, 1],
        "slot_mapping": [5, 0, 2]}                 # A's positions 1, 2: page 2 row 1, page 0 row 0; B's 0: page 1
CONTEXT_SLOTS = {0: [4, 5, 0], 1: [2]}             # each sequence's slots, position by position
TOKENS = 3
SCALE = 0.4
INDICES = ("q_indptr", "page_indptr", "page_values", "last_page_len")


def dense_causal_attention(q, k, v, scale):
    """q [n, Hq, D] against all of k [L, Hkv, D], v [L, Hkv, Dv]: query i sees keys j <= L - n + i."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    out = np.zeros((n, hq, v.shape[2]))
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        for i in range(n):
            s = kh[:L - n + i + 1] @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vh[:L - n + i + 1]
    return out


def _step_inputs(rng, **tensors):
    return {**{k: np.array(v, np.int32) for k, v in STEP.items()},
            **{k: rng.standard_normal(shape).astype(np.float32) for k, shape in tensors.items()}}


def _by_sequence(queries, attend):
    """Each sequence's queries' rows of the output, from attend(sequence, its query rows)."""
    out = np.zeros((TOKENS, *attend(0, queries[0:2]).shape[1:]))
    for s, (lo, hi) in enumerate(((0, 2), (2, 3))):
        out[lo:hi] = attend(s, queries[lo:hi])
    return out


# -- the paged KV cache: kv_pages [pages, 2 (k, v), kv_heads, page_size, head_dim] --------------------
HQ, HKV, D = 2, 1, 4


def _kv_graph(op, *tensors, **attrs):
    b = GraphBuilder(op)
    names = {name: b.input(name, shape, "float32") for name, shape in tensors}
    pages, _ = b.kv_cache(0, KVSpec("full", HKV, D, D, "float32", PAGE_SIZE))
    ints = {name: b.input(name, (("tokens" if name == "slot_mapping" else "n" + name),), "int32")
            for name in ("slot_mapping", *INDICES)}
    return b, names, pages, ints


def _written(a):
    """kv_pages after the step's k and v rows are written at slot_mapping."""
    pages = a["kv_pages0"].copy()
    for t, slot in enumerate(a["slot_mapping"]):
        pages[slot // PAGE_SIZE, 0, :, slot % PAGE_SIZE] = a["k"][t]
        pages[slot // PAGE_SIZE, 1, :, slot % PAGE_SIZE] = a["v"][t]
    return pages


def _attend_pages(pages, q):
    def attend(s, rows):
        slots = CONTEXT_SLOTS[s]
        keys = np.stack([pages[slot // PAGE_SIZE, 0, :, slot % PAGE_SIZE] for slot in slots])
        values = np.stack([pages[slot // PAGE_SIZE, 1, :, slot % PAGE_SIZE] for slot in slots])
        return dense_causal_attention(rows, keys, values, SCALE)
    return _by_sequence(q, attend)


def _kv_append():
    b, t, pages, i = _kv_graph("kv_append", ("k", ("tokens", HKV, D)), ("v", ("tokens", HKV, D)))
    return verify(b.output(b.op("kv_append", t["k"], t["v"], pages, i["slot_mapping"], layer=0, name="y")))


def _paged_attend():
    b, t, pages, i = _kv_graph("paged_attend", ("q", ("tokens", HQ, D)))
    return verify(b.output(b.op("paged_attend", t["q"], pages, *(i[n] for n in INDICES), layer=0, scale=SCALE,
                                name="y")))


def _paged_attention():
    b, t, pages, i = _kv_graph("paged_attention", *((n, ("tokens", h, D)) for n, h in (("q", HQ), ("k", HKV),
                                                                                        ("v", HKV))))
    return verify(b.output(b.op("paged_attention", t["q"], t["k"], t["v"], pages, i["slot_mapping"],
                                *(i[n] for n in INDICES), layer=0, scale=SCALE, name="y")))


def _rotate_half(x, positions, inv_freq):
    """Rope as the rope op states it: pairs (i, i + D/2) rotated by position * inv_freq[i]."""
    half = x.shape[-1] // 2
    angle = positions[:, None, None] * inv_freq[None, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)], -1)


def _paged_attention_fused():
    b, t, pages, i = _kv_graph("paged_attention_fused", ("qkv", ("tokens", (HQ + 2 * HKV) * D)))
    positions = b.input("positions", ("tokens",), "int32")
    inv_freq = b.input("inv_freq", (D // 2,), "float32")
    return verify(b.output(b.op("paged_attention_fused", t["qkv"], positions, inv_freq, pages, i["slot_mapping"],
                                *(i[n] for n in INDICES), layer=0, scale=SCALE, q_heads=HQ, kv_heads=HKV,
                                head_dim=D, name="y")))


def _fused_expect(a):
    qkv, pos = a["qkv"], a["positions"].astype(np.float64)
    q = _rotate_half(qkv[:, :HQ * D].reshape(TOKENS, HQ, D), pos, a["inv_freq"])
    k = _rotate_half(qkv[:, HQ * D:(HQ + HKV) * D].reshape(TOKENS, HKV, D), pos, a["inv_freq"])
    v = qkv[:, (HQ + HKV) * D:].reshape(TOKENS, HKV, D)
    return _attend_pages(_written({**a, "k": k, "v": v}), q)


def _kv_inputs(rng, **tensors):
    return {**_step_inputs(rng, **tensors),
            "kv_pages0": rng.standard_normal((PAGES, 2, HKV, PAGE_SIZE, D)).astype(np.float32)}


# -- MLA: latent pages [pages, 1, 1, page_size, R + P]; kv_b [H (N + V), R] --------------------------
H, R, P, N, V = 2, 4, 2, 3, 2


def _latent_graph(op, *tensors):
    b = GraphBuilder(op)
    names = {name: b.input(name, shape, "float32") for name, shape in tensors}
    pages, _ = b.kv_cache(0, KVSpec("latent", 1, R + P, R, "float32", PAGE_SIZE))
    ints = {name: b.input(name, (("tokens" if name == "slot_mapping" else "n" + name),), "int32")
            for name in ("slot_mapping", *INDICES)}
    return b, names, pages, ints


def _latent_rows(a, s):
    return np.stack([a["kv_pages0"][slot // PAGE_SIZE, 0, 0, slot % PAGE_SIZE] for slot in CONTEXT_SLOTS[s]])


def _latent_append():
    b, t, pages, i = _latent_graph("latent_append", ("c_kv", ("tokens", R)), ("k_pe", ("tokens", P)))
    return verify(b.output(b.op("latent_append", t["c_kv"], t["k_pe"], pages, i["slot_mapping"], layer=0, name="y")))


def _latent_append_expect(a):
    pages = a["kv_pages0"].copy()
    for t, slot in enumerate(a["slot_mapping"]):
        pages[slot // PAGE_SIZE, 0, 0, slot % PAGE_SIZE] = np.concatenate([a["c_kv"][t], a["k_pe"][t]])
    return pages


def _mla_attend():
    b, t, pages, i = _latent_graph("mla_attend", ("q_nope", ("tokens", H, N)), ("q_rope", ("tokens", H, P)))
    kv_b = b.input("kv_b", (H * (N + V), R), "float32")
    return verify(b.output(b.op("mla_attend", t["q_nope"], t["q_rope"], pages, kv_b, *(i[n] for n in INDICES),
                                layer=0, scale=SCALE, name="y")))


def _mla_attend_expect(a):
    q = np.concatenate([a["q_nope"], a["q_rope"]], -1)

    def attend(s, rows):
        stored = _latent_rows(a, s)
        per_head = (stored[:, :R] @ a["kv_b"].T).reshape(len(stored), H, N + V)
        keys = np.concatenate([per_head[:, :, :N], np.repeat(stored[:, None, R:], H, axis=1)], -1)
        return dense_causal_attention(rows, keys, per_head[:, :, N:], SCALE)
    return _by_sequence(q, attend)


def _latent_attend():
    b, t, pages, i = _latent_graph("latent_attend", ("q_latent", ("tokens", H, R)), ("q_rope", ("tokens", H, P)))
    return verify(b.output(b.op("latent_attend", t["q_latent"], t["q_rope"], pages, *(i[n] for n in INDICES),
                                layer=0, scale=SCALE, name="y")))


def _latent_attend_expect(a):
    q = np.concatenate([a["q_latent"], a["q_rope"]], -1)

    def attend(s, rows):
        stored = _latent_rows(a, s)[:, None]                  # one KV head: MQA
        return dense_causal_attention(rows, stored, stored[:, :, :R], SCALE)
    return _by_sequence(q, attend)


def _latent_gather():
    b = GraphBuilder("latent_gather")
    pages, _ = b.kv_cache(0, KVSpec("latent", 1, R + P, R, "float32", PAGE_SIZE))
    slots = b.input("kv_slots", ("kv_tokens",), "int32")
    return verify(b.output(b.op("latent_gather", pages, slots, layer=0, dtype="float32", name="y")))


def _latent_inputs(rng, **tensors):
    return {**_step_inputs(rng, **tensors),
            "kv_pages0": rng.standard_normal((PAGES, 1, 1, PAGE_SIZE, R + P)).astype(np.float32)}


def _expanded_attend():
    b = GraphBuilder("expanded_attend")
    qn, qr = b.input("q_nope", ("tokens", H, N), "float32"), b.input("q_rope", ("tokens", H, P), "float32")
    kv, rows = b.input("kv", ("kv_tokens", H * (N + V)), "float32"), b.input("rows", ("kv_tokens", R + P), "float32")
    qi, ki = b.input("q_indptr", ("seqs1",), "int32"), b.input("kv_indptr", ("seqs1",), "int32")
    return verify(b.output(b.op("expanded_attend", qn, qr, kv, rows, qi, ki, layer=0, scale=SCALE, name="y")))


def _expanded_attend_expect(a):
    q = np.concatenate([a["q_nope"], a["q_rope"]], -1)
    context = {0: slice(0, 3), 1: slice(3, 4)}                # kv_indptr [0, 3, 4]

    def attend(s, rows):
        kv = a["kv"][context[s]].reshape(-1, H, N + V)
        keys = np.concatenate([kv[:, :, :N], np.repeat(a["rows"][context[s], None, R:], H, axis=1)], -1)
        return dense_causal_attention(rows, keys, kv[:, :, N:], SCALE)
    return _by_sequence(q, attend)


# -- MoE: a softmax router and the experts (gate_up [E, 2F, hidden], down [E, hidden, F]) -----------------
E, HIDDEN, F = 3, 4, 2


def _moe_router():
    b = GraphBuilder("moe_router")
    logits = b.input("logits", ("tokens", E), "float32")
    return verify(b.output(b.op("moe_router", logits, scheme="softmax_topk", top_k=2, normalize=True, name="y")))


def _moe_router_expect(a):
    """Softmax over the experts, the two largest kept and renormalised to sum to 1."""
    p = np.exp(a["logits"] - a["logits"].max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out = np.zeros_like(p)
    for t, row in enumerate(p):
        top = np.argsort(-row)[:2]
        out[t, top] = row[top] / row[top].sum()
    return out


def _q4_levels(packed, scale, group):
    """[.., out, in / 2] nibbles with [.., in / group, out] scales -> float weights [.., out, in]."""
    levels = np.zeros((*packed.shape[:-1], 2 * packed.shape[-1]))
    levels[..., 0::2], levels[..., 1::2] = (packed & 15) - 8.0, (packed >> 4) - 8.0
    return levels * np.repeat(np.swapaxes(scale, -1, -2), group, axis=-1)


MOE_FORMATS = {   # format -> (weight dtype, stored shape of [out, in], scale dtype, scale shape of [out, in])
    "q8": ("int8", lambda o, i: (o, i), "float32", lambda o, i: (o,)),
    "fp8": ("float8_e4m3fn", lambda o, i: (o, i), "float32", lambda o, i: (o,)),
    "q4": ("uint8", lambda o, i: (o, i // 2), "float16", lambda o, i: (i // 2, o)),      # groups of 2
}


def _moe_experts(fmt="none"):
    def make():
        b = GraphBuilder("moe_experts")
        x, routing = b.input("x", ("tokens", HIDDEN), "float32"), b.input("routing", ("tokens", E), "float32")
        parts = []
        for name, (o, i) in (("gate_up", (2 * F, HIDDEN)), ("down", (HIDDEN, F))):
            if fmt == "none":
                parts += [b.input(name, (E, o, i), "float32"), None]
            else:
                wdt, wshape, sdt, sshape = MOE_FORMATS[fmt]
                parts += [b.input(name, (E, *wshape(o, i)), wdt), b.input(f"{name}_scale", (E, *sshape(o, i)), sdt)]
        attrs = {} if fmt == "none" else {"format": fmt, **({"group_size": 2} if fmt == "q4" else {})}
        return verify(b.output(b.op("moe_experts", x, routing, *parts, name="y", top_k=2, **attrs)))
    return make


def _expert_weights(a, fmt, name):
    if fmt == "none":
        return a[name]
    if fmt == "q4":
        return _q4_levels(a[name].astype(np.uint8), a[f"{name}_scale"], 2)
    return a[name].astype(np.float64) * a[f"{name}_scale"][..., None]


def _moe_experts_expect(fmt):
    def expect(a):
        gate_up, down = _expert_weights(a, fmt, "gate_up"), _expert_weights(a, fmt, "down")
        out = np.zeros(a["x"].shape)
        for t, x in enumerate(a["x"]):
            for e in np.flatnonzero(a["routing"][t] > 0):
                g, u = gate_up[e][:F] @ x, gate_up[e][F:] @ x
                out[t] += a["routing"][t, e] * (down[e] @ (g / (1 + np.exp(-g)) * u))
        return out
    return expect


def _moe_inputs(fmt):
    def inputs(rng):
        routing = rng.uniform(0.1, 1.0, (TOKENS, E)).astype(np.float32)
        routing[np.arange(TOKENS), rng.integers(0, E, TOKENS)] = 0          # two experts per token
        arrays = {"x": rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32), "routing": routing}
        for name, (o, i) in (("gate_up", (2 * F, HIDDEN)), ("down", (HIDDEN, F))):
            if fmt == "none":
                arrays[name] = rng.standard_normal((E, o, i)).astype(np.float32)
                continue
            wdt, wshape, sdt, sshape = MOE_FORMATS[fmt]
            shape = (E, *wshape(o, i))
            if fmt == "q8":
                arrays[name] = rng.integers(-127, 128, shape).astype(np.int8)
            elif fmt == "q4":
                arrays[name] = rng.integers(0, 256, shape).astype(np.uint8)
            else:
                import ml_dtypes
                arrays[name] = rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn)
            arrays[f"{name}_scale"] = rng.uniform(0.01, 0.1, (E, *sshape(o, i))).astype(sdt)
        return arrays
    return inputs


# -- the step forms ---------------------------------------------------------------------------------------
def _step_choice():
    b = GraphBuilder("step_choice")
    default, alternative = b.input("default", (2,), "float32"), b.input("alternative", (2,), "float32")
    return verify(b.output(b.op("step_choice", default, alternative, b.input("q_indptr", (3,), "int32"),
                                min_tokens=2, name="y")))


def _step_choice_inputs(rng):   # sequences of 2 and 1 new tokens: one is short of min_tokens
    return {"default": np.array([1, 2], np.float32), "alternative": np.array([3, 4], np.float32),
            "q_indptr": np.array(STEP["q_indptr"], np.int32)}


EXAMPLES = {
    "kv_append": (_kv_append, _written, lambda rng: _kv_inputs(rng, k=(TOKENS, HKV, D), v=(TOKENS, HKV, D))),
    "paged_attend": (_paged_attend, lambda a: _attend_pages(a["kv_pages0"], a["q"]),
                     lambda rng: _kv_inputs(rng, q=(TOKENS, HQ, D))),
    "paged_attention": (_paged_attention, lambda a: _attend_pages(_written(a), a["q"]),
                        lambda rng: _kv_inputs(rng, q=(TOKENS, HQ, D), k=(TOKENS, HKV, D), v=(TOKENS, HKV, D))),
    "paged_attention_fused": (_paged_attention_fused, _fused_expect, lambda rng: {
        **_kv_inputs(rng, qkv=(TOKENS, (HQ + 2 * HKV) * D)), "positions": np.array([1, 2, 0], np.int32),
        "inv_freq": np.array([1.0, 0.1], np.float32)}),
    "latent_append": (_latent_append, _latent_append_expect,
                      lambda rng: _latent_inputs(rng, c_kv=(TOKENS, R), k_pe=(TOKENS, P))),
    "mla_attend": (_mla_attend, _mla_attend_expect,
                   lambda rng: _latent_inputs(rng, q_nope=(TOKENS, H, N), q_rope=(TOKENS, H, P),
                                              kv_b=(H * (N + V), R))),
    "latent_attend": (_latent_attend, _latent_attend_expect,
                      lambda rng: _latent_inputs(rng, q_latent=(TOKENS, H, R), q_rope=(TOKENS, H, P))),
    "latent_gather": (_latent_gather, lambda a: a["kv_pages0"][a["kv_slots"] // PAGE_SIZE, 0, 0,
                                                               a["kv_slots"] % PAGE_SIZE],
                      lambda rng: {"kv_pages0": rng.standard_normal((PAGES, 1, 1, PAGE_SIZE, R + P)).astype(np.float32),
                                   "kv_slots": np.array([4, 5, 0, 2], np.int32)}),
    "expanded_attend": (_expanded_attend, _expanded_attend_expect, lambda rng: {
        **{k: rng.standard_normal(s).astype(np.float32)
           for k, s in (("q_nope", (TOKENS, H, N)), ("q_rope", (TOKENS, H, P)), ("kv", (4, H * (N + V))),
                        ("rows", (4, R + P)))},
        "q_indptr": np.array([0, 2, 3], np.int32), "kv_indptr": np.array([0, 3, 4], np.int32)}),
    "moe_router": (_moe_router, _moe_router_expect,
                   lambda rng: {"logits": rng.standard_normal((TOKENS, E)).astype(np.float32)}),
    **{"moe_experts" + ("" if fmt == "none" else f"/{fmt}"): (_moe_experts(fmt), _moe_experts_expect(fmt),
                                                               _moe_inputs(fmt))
       for fmt in ("none", "q8", "q4", "fp8")},
    "step_choice": (_step_choice, lambda a: a["default"], _step_choice_inputs),
}
