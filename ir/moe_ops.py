"""Mixture-of-experts: which experts each token uses, with what weight (moe_router), and the
routed experts' MLPs (moe_experts).

`moe_router` turns a step's router logits [tokens, experts] (the router is a plain linear before
it) into dense routing weights [tokens, experts], zero for every expert a token does not use.
One op with a `scheme` per routing family, each a few lines of NumPy in float32, as transformers
computes routers:
    softmax_topk        softmax over all experts, the top_k largest kept, renormalised to sum to 1
                        when `normalize` (Mixtral always; Qwen2/3-MoE and OLMoE per norm_topk_prob),
                        then × `scaling` (DeepSeek-V2 greedy: routed_scaling_factor, no renormalising)
    topk_softmax        the top_k logits, softmax over those k only (Granite-MoE, gpt-oss)
    softmax_group_max   DeepSeek-V2 group-limited greedy: softmax, experts in `n_group` groups, a
                        group scored by its best expert, the best `topk_group` groups' experts
                        eligible, top_k of those, × scaling
    sigmoid_group_top2  DeepSeek-V3: sigmoid scores; the choice uses scores + bias
                        (e_score_correction_bias), a group scored by the sum of its 2 best, the
                        best topk_group groups eligible; the weights are the unbiased scores of
                        the chosen, renormalised when `normalize` (denominator + 1e-20), × scaling

`moe_experts` (its experts stored in any weight format) runs the routed experts; `sigmoid_gate`
weighs Qwen2-MoE's shared expert.
"""
from __future__ import annotations

import numpy as np

from .opdef import ACTIVATIONS, REQUIRED, as_type, f32, op
from .quant import SCHEMES as QUANT_SCHEMES

EXPERT_FORMATS = ("q8", "q4", "fp8")       # a q8g model's experts are q8, a q4a one's q4 (passes/quantize.py)
from .types import IRError, TensorType

SCHEMES = ("softmax_topk", "topk_softmax", "softmax_group_max", "sigmoid_group_top2")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Per row, the indices of the k largest values (order within the k does not matter here)."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def _group_mask(choice: np.ndarray, n_group: int, topk_group: int, group_score) -> np.ndarray:
    """[tokens, experts] True for the experts of each token's topk_group best groups."""
    tokens, experts = choice.shape
    groups = choice.reshape(tokens, n_group, experts // n_group)
    best = _top(group_score(groups), topk_group)                        # [tokens, topk_group]
    keep = np.zeros((tokens, n_group), bool)
    np.put_along_axis(keep, best, True, axis=-1)
    return np.repeat(keep, experts // n_group, axis=-1)


@op("moe_router", ["logits", "bias?"],
    {"scheme": REQUIRED, "top_k": REQUIRED, "normalize": False, "scaling": 1.0, "n_group": 1, "topk_group": 1})
def _moe_router():
    """Dense routing weights f32[tokens, experts] from router logits (schemes above)."""
    def rule(types, attrs, fail):
        logits, bias = types
        if attrs["scheme"] not in SCHEMES:
            fail(f"scheme must be one of {', '.join(SCHEMES)}, got {attrs['scheme']!r}")
        if logits.rank != 2 or logits.dtype != "float32" or not isinstance(logits.shape[1], int):
            fail(f"logits must be f32[tokens, experts], got {logits}")
        experts = logits.shape[1]
        if not 0 < attrs["top_k"] <= experts:
            fail(f"top_k {attrs['top_k']} must be in 1..{experts}")
        if experts % attrs["n_group"] or not 0 < attrs["topk_group"] <= attrs["n_group"]:
            fail(f"{experts} experts do not split into {attrs['n_group']} groups of which {attrs['topk_group']} kept")
        if (attrs["scheme"] == "sigmoid_group_top2") != (bias is not None):
            fail("sigmoid_group_top2 takes the score-correction bias, and only it")
        if bias is not None and bias != TensorType((experts,), "float32"):
            fail(f"bias must be f32[{experts}], got {bias}")
        return logits

    def ref(x, at, ty, dims):
        logits, k, scheme = f32(x[0]), at["top_k"], at["scheme"]
        if scheme == "topk_softmax":
            chosen = _top(logits, k)
            weights = _softmax(np.take_along_axis(logits, chosen, -1))
        elif scheme == "sigmoid_group_top2":
            with np.errstate(over="ignore"):           # exp overflows to inf: the score is 0
                scores = np.float32(1) / (np.float32(1) + np.exp(-logits))
            choice = scores + f32(x[1])
            eligible = _group_mask(choice, at["n_group"], at["topk_group"],
                                   lambda g: np.sort(g, axis=-1)[..., -2:].sum(-1))
            chosen = _top(np.where(eligible, choice, -np.inf), k)
            weights = np.take_along_axis(scores, chosen, -1)
            if at["normalize"]:
                weights = weights / (weights.sum(-1, keepdims=True) + np.float32(1e-20))
        else:
            scores = _softmax(logits)
            if scheme == "softmax_group_max":
                scores = np.where(_group_mask(scores, at["n_group"], at["topk_group"], lambda g: g.max(-1)),
                                  scores, np.float32(0))
            chosen = _top(scores, k)
            weights = np.take_along_axis(scores, chosen, -1)
            if at["normalize"]:
                weights = weights / weights.sum(-1, keepdims=True)
        dense = np.zeros(logits.shape, np.float32)
        np.put_along_axis(dense, chosen, (weights * np.float32(at["scaling"])).astype(np.float32), axis=-1)
        return dense
    return rule, ref


def _experts_out(x, routing, fail) -> tuple[int, int]:
    if x.rank != 2 or routing.rank != 2 or routing.dtype != "float32" or routing.shape[0] != x.shape[0]:
        fail(f"x must be [tokens, hidden] and routing f32[tokens, experts], got {x}, {routing}")
    if x.dtype not in ("float32", "float16", "bfloat16"):
        fail(f"x must be a float tensor, got {x}")
    return routing.shape[1], x.shape[1]


def _check_experts_attrs(attrs, fail):
    if attrs["activation"] not in ("silu", "gelu_tanh"):
        fail(f"activation must be silu or gelu_tanh, got {attrs['activation']!r}")
    if attrs["top_k"] < 1:
        fail(f"top_k must be at least 1, got {attrs['top_k']}")


def _experts_ref(hidden, routing, weight, at, ty) -> np.ndarray:
    """The routed experts' gated MLPs for `weight(name, e)` -> f32 [out, in] of expert e."""
    hidden, routing = f32(hidden), f32(routing)
    if (np.count_nonzero(routing > 0, axis=1) > at["top_k"]).any():
        raise IRError(f"moe_experts: a token is routed to more than top_k={at['top_k']} experts")
    out = np.zeros(hidden.shape, np.float32)
    for e in np.flatnonzero((routing > 0).any(0)):
        rows = np.flatnonzero(routing[:, e] > 0)
        gate_up = weight("gate_up", e)
        ffn = gate_up.shape[0] // 2
        projected = f32(as_type(hidden[rows] @ gate_up.T, ty))
        gate, up = projected[:, :ffn], projected[:, ffn:]
        act = f32(as_type(f32(as_type(ACTIVATIONS[at["activation"]](gate), ty)) * up, ty))
        expert_out = f32(as_type(act @ weight("down", e).T, ty))
        out[rows] += f32(as_type(expert_out * routing[rows, e:e + 1], ty))
    return as_type(out, ty)


@op("moe_experts", ["x", "routing", "gate_up", "gate_up_scale?", "down", "down_scale?"],
    {"top_k": REQUIRED, "activation": "silu", "format": "none", "group_size": 0, "kernels": None})
def _moe_experts():
    """The routed experts' gated MLPs, summed by routing weight: for x [tokens, H], routing
    f32[tokens, E] (moe_router's: at most top_k experts per token), gate_up [E, 2F, H] (gate rows
    first, then up) and down [E, H, F],
        out[t] = sum over experts e with routing[t, e] > 0 of
                 routing[t, e] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t]))
    Each product is rounded to x's dtype as transformers' experts loop rounds it; the sum is kept in
    float32 and rounded once. Only the experts a token is routed to are computed.
    `format` q8, q4 or fp8: gate_up and down are stored quantised expert by expert as a linear's
    weight would be (ir/quant.py), each with its scales (gate_up_scale, down_scale) behind it."""
    def rule(types, attrs, fail):
        x, routing, gate_up, gate_up_scale, down, down_scale = types
        _check_experts_attrs(attrs, fail)
        experts, hidden = _experts_out(x, routing, fail)
        fmt = attrs.get("format", "none")
        if fmt == "none":
            if gate_up_scale is not None or down_scale is not None:
                fail("experts of format none take no scales")
            if gate_up.rank != 3 or gate_up.shape[0] != experts or gate_up.shape[2] != hidden or gate_up.shape[1] % 2:
                fail(f"gate_up must be [{experts}, 2 * ffn, {hidden}], got {gate_up}")
            if down != TensorType((experts, hidden, gate_up.shape[1] // 2), x.dtype) or gate_up.dtype != x.dtype:
                fail(f"down must be {x.dtype}[{experts}, {hidden}, {gate_up.shape[1] // 2}], got {down}")
            return x
        if fmt not in EXPERT_FORMATS:
            fail(f"format must be none or one of {', '.join(EXPERT_FORMATS)}, got {fmt!r}")
        scheme = QUANT_SCHEMES[fmt]
        if gate_up_scale is None or down_scale is None:
            fail(f"experts of format {fmt} take gate_up_scale and down_scale")
        if gate_up.rank != 3 or gate_up.shape[0] != experts:
            fail(f"gate_up must be {scheme.weight_dtype}[{experts}, 2 * ffn, ...], got {gate_up}")
        ffn = gate_up.shape[1] // 2
        group = attrs.get("group_size", 0)
        if scheme.grouped and (group <= 0 or hidden % group or ffn % group or group % 2):
            fail(f"hidden {hidden} and ffn {ffn} must be multiples of an even group_size {group}")
        for name, (q, scale), (n_out, n_in) in (("gate_up", (gate_up, gate_up_scale), (2 * ffn, hidden)),
                                                ("down", (down, down_scale), (hidden, ffn))):
            shapes = scheme.part_shapes(n_out, n_in, group)
            want_q = TensorType((experts, *shapes["q"]), scheme.weight_dtype)
            want_scale = TensorType((experts, *shapes["scale"]), scheme.scale_dtype)
            if q != want_q or scale != want_scale:
                fail(f"{name} must be {want_q} with scales {want_scale}, got {q}, {scale}")
        return x

    def ref(x, at, ty, dims):
        fmt = at.get("format", "none")
        parts = {"gate_up": (x[2], x[3]), "down": (x[4], x[5] if len(x) > 5 else None)}
        if fmt == "none":
            return _experts_ref(x[0], x[1], lambda name, e: f32(parts[name][0][e]), at, ty)
        scheme = QUANT_SCHEMES[fmt]
        options = {"group_size": at["group_size"]} if scheme.grouped else {}

        def weight(name, e):
            q, scale = parts[name]
            return scheme.dequantize({"q": np.asarray(q[e]), "scale": np.asarray(scale[e])}, **options)
        return _experts_ref(x[0], x[1], weight, at, ty)
    return rule, ref


@op("sigmoid_gate", ["x", "gate"])
def _sigmoid_gate():
    """x * sigmoid(gate) for x [tokens, H] and gate [tokens, 1]: Qwen2-MoE's gated shared expert.
    The sigmoid is rounded to x's dtype before the product, as transformers computes it."""
    def rule(types, attrs, fail):
        x, gate = types
        if x.rank != 2 or gate != TensorType((x.shape[0], 1), x.dtype):
            fail(f"gate must be {x.dtype}[tokens, 1] for x {x}, got {gate}")
        return x

    def ref(x, at, ty, dims):
        with np.errstate(over="ignore"):
            sig = f32(as_type(np.float32(1) / (np.float32(1) + np.exp(-f32(x[1]))), ty))
        return as_type(sig * f32(x[0]), ty)
    return rule, ref
