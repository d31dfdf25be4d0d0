"""The model registry: config.json's `model_type` -> how its fields become a DecoderConfig.

Each family is a few lines: the fields every decoder shares are read once (`_common`), and a
family adds its flags (frontend/decoder.py). Anything kiln cannot run is refused here, at
compile time, naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kiln.errors import KilnError

from .decoder import DecoderConfig
from .mla import MLAConfig
from .moe import MoEConfig
from .rope import SUPPORTED_ROPE_TYPES, yarn_mscale


@dataclass(frozen=True)
class Family:
    architectures: tuple[str, ...]          # the causal-LM classes of this model_type
    parse: Callable[[dict, str], DecoderConfig]


def need(cfg: dict, key: str, arch: str):
    if key not in cfg or cfg[key] is None:
        raise KilnError(f"config.json of {arch} lacks required field {key!r}")
    return cfg[key]


def _rope(cfg: dict, arch: str, layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """rope_theta and the scaling dict, from the v4 (rope_theta, rope_scaling) or v5 (rope_parameters,
    per layer type where the family has several) layout."""
    rope = cfg.get("rope_parameters") or {}
    if layer_type in rope:
        rope = rope[layer_type]
    elif layer_type != "full_attention":              # v4 Gemma 3: a local base, no scaling
        rope = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    v4_scaling = cfg.get("rope_scaling") if layer_type == "full_attention" else None
    scaling = v4_scaling or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise KilnError(f"{arch}: rope_scaling type {kind!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if kind == "default":
            scaling = None
    return float(theta), scaling


def _rotary_dim(cfg: dict, head_dim: int, arch: str) -> int:
    """How many leading elements of a head rope turns (partial_rotary_factor); 0 for all of them."""
    factor = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise KilnError(f"{arch}: partial_rotary_factor {factor} gives {dim} rotated elements of {head_dim}; "
                        "kiln needs an even number")
    return 0 if dim == head_dim else dim


# transformers' activation names -> kiln's gate activations
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _common(cfg: dict, arch: str, model_type: str, tied_by_default: bool = False, **flags) -> DecoderConfig:
    """The fields every decoder has; `flags` set the family's hooks."""
    hidden = need(cfg, "hidden_size", arch)
    heads = need(cfg, "num_attention_heads", arch)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise KilnError(f"{arch}: hidden activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    theta, scaling = _rope(cfg, arch)
    head_dim = cfg.get("head_dim") or hidden // heads
    return DecoderConfig(
        architecture=arch, model_type=model_type,
        vocab_size=need(cfg, "vocab_size", arch),
        hidden_size=hidden,
        intermediate_size=need(cfg, "intermediate_size", arch),
        num_layers=need(cfg, "num_hidden_layers", arch),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rotary_dim=_rotary_dim(cfg, head_dim, arch),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied_by_default)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        mlp_act=ACTIVATIONS[act],
        **flags)


def _windows(cfg: dict, arch: str, every_layer: bool) -> dict:
    """The sliding window and which layers use it, as transformers decides: every layer when
    `sliding_window` is set (Mistral), or, behind `use_sliding_window`, the layers `layer_types`
    names (Qwen2/Qwen3: by default those from `max_window_layers` on)."""
    layers = need(cfg, "num_hidden_layers", arch)
    window = cfg.get("sliding_window")
    if not every_layer and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return {"sliding_window": None, "layer_types": ("full_attention",) * layers}
    if every_layer:
        types = ["sliding_attention"] * layers
    else:
        first = cfg.get("max_window_layers", 28)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(layers)]
    return {"sliding_window": int(window), "layer_types": checked_layer_types(types, layers, arch)}


def checked_layer_types(types, layers: int, arch: str) -> tuple[str, ...]:
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown or len(types) != layers:
        raise KilnError(f"{arch}: layer_types {list(types)} must name full_attention or sliding_attention for "
                        f"each of the {layers} layers")
    return tuple(types)


def _llama(cfg: dict, arch: str) -> DecoderConfig:
    bias = bool(cfg.get("attention_bias", False))
    return _common(cfg, arch, "llama", qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def _mistral(cfg: dict, arch: str) -> DecoderConfig:
    return _common(cfg, arch, "mistral", **_windows(cfg, arch, every_layer=True))


def _qwen2(cfg: dict, arch: str) -> DecoderConfig:
    return _common(cfg, arch, "qwen2", qkv_bias=True, **_windows(cfg, arch, every_layer=False))


def _qwen3(cfg: dict, arch: str) -> DecoderConfig:
    bias = bool(cfg.get("attention_bias", False))
    return _common(cfg, arch, "qwen3", qkv_bias=bias, o_bias=bias, qk_norm="head",
                   **_windows(cfg, arch, every_layer=False))


def _olmo2(cfg: dict, arch: str) -> DecoderConfig:
    bias = bool(cfg.get("attention_bias", False))
    return _common(cfg, arch, "olmo2", qkv_bias=bias, o_bias=bias, qk_norm="all", norm_weight_in_float32=True,
                   norms={"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"})


def _phi3(cfg: dict, arch: str) -> DecoderConfig:
    """Phi-3 / Phi-4-mini: qkv_proj and gate_up_proj fused in the checkpoint, LongRoPE (older
    configs call it "su" or "yarn"), partial rotary, a window on every layer when configured."""
    scaling = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if scaling.get("rope_type", scaling.get("type")) in ("su", "yarn", "longrope"):
        scaling["rope_type"] = "longrope"
        scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    cfg = {**cfg, "rope_scaling": None, "rope_parameters": scaling}
    return _common(cfg, arch, "phi3", fused_projections=True, **_windows(cfg, arch, every_layer=True))


GEMMA_NORMS = {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
               "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}


def _gemma(cfg: dict, arch: str, model_type: str, window_pattern: int, **flags) -> DecoderConfig:
    """Gemma 2 and 3: norms before and after attention and the MLP, weights stored as offsets
    from 1, embeddings × sqrt(hidden), GeGLU, sliding layers in a fixed pattern."""
    if cfg.get("use_bidirectional_attention"):
        raise KilnError(f"{arch}: use_bidirectional_attention is not supported (kiln runs causal decoders)")
    layers = need(cfg, "num_hidden_layers", arch)
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % window_pattern else "full_attention"
                                       for i in range(layers)]
    if not window:
        types = ["full_attention"] * layers
    bias = bool(cfg.get("attention_bias", False))
    return _common(cfg, arch, model_type, tied_by_default=True, qkv_bias=bias, o_bias=bias, norms=GEMMA_NORMS,
                   norm_offset=1.0, norm_weight_in_float32=True, embed_multiplier=float(need(cfg, "hidden_size", arch)) ** 0.5,
                   attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                   sliding_window=int(window) if window else None,
                   layer_types=checked_layer_types(types, layers, arch), **flags)


def _gemma2(cfg: dict, arch: str) -> DecoderConfig:
    return _gemma(cfg, arch, "gemma2", 2, attn_softcap=cfg.get("attn_logit_softcapping", 50.0),
                  final_softcap=cfg.get("final_logit_softcapping", 30.0))


def _gemma3(cfg: dict, arch: str) -> DecoderConfig:
    local_theta, local_scaling = _rope(cfg, arch, "sliding_attention")
    # Gemma 3's config carries attn_logit_softcapping, but its attention never applies it
    return _gemma(cfg, arch, "gemma3_text", cfg.get("sliding_window_pattern", 6), qk_norm="head",
                  final_softcap=cfg.get("final_logit_softcapping"),
                  local_rope_theta=local_theta, local_rope_scaling=local_scaling)


def _experts(cfg: dict, arch: str, layout: str, router: str, ffn_key: str, sparse=lambda i: True,
             **fields) -> MoEConfig:
    """The MoE fields every family has: experts, top_k, each expert's size, which layers have them.
    The expert count is num_experts or num_local_experts (transformers 5 renamed some)."""
    experts = need(cfg, "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts", arch)
    layers = need(cfg, "num_hidden_layers", arch)
    return MoEConfig(experts=experts, top_k=need(cfg, "num_experts_per_tok", arch), ffn=need(cfg, ffn_key, arch),
                     router=router, layout=layout,
                     sparse_layers=tuple(i for i in range(layers) if experts and sparse(i)), **fields)


def _qwen_sparse(cfg: dict):
    """Qwen-MoE's rule for which layers have experts: not in mlp_only_layers, every
    decoder_sparse_step-th layer."""
    dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step", 1) or 1
    return lambda i: i not in dense and (i + 1) % step == 0


def _mixtral(cfg: dict, arch: str) -> DecoderConfig:
    moe = _experts(cfg, arch, "mixtral", "softmax_topk", "intermediate_size", normalize=True)
    return _common(cfg, arch, "mixtral", moe=moe, **_windows(cfg, arch, every_layer=True))


def _qwen2_moe(cfg: dict, arch: str) -> DecoderConfig:
    shared = cfg.get("shared_expert_intermediate_size") or 0
    moe = _experts(cfg, arch, "qwen", "softmax_topk", "moe_intermediate_size", _qwen_sparse(cfg),
                   normalize=bool(cfg.get("norm_topk_prob", False)), shared_ffn=shared, shared_gate=bool(shared))
    return _common(cfg, arch, "qwen2_moe", qkv_bias=bool(cfg.get("qkv_bias", True)), moe=moe,
                   **_windows(cfg, arch, every_layer=False))


def _qwen3_moe(cfg: dict, arch: str) -> DecoderConfig:
    moe = _experts(cfg, arch, "qwen", "softmax_topk", "moe_intermediate_size", _qwen_sparse(cfg),
                   normalize=bool(cfg.get("norm_topk_prob", False)))
    bias = bool(cfg.get("attention_bias", False))
    return _common(cfg, arch, "qwen3_moe", qkv_bias=bias, o_bias=bias, qk_norm="head", moe=moe,
                   **_windows(cfg, arch, every_layer=False))


def _olmoe(cfg: dict, arch: str) -> DecoderConfig:
    if cfg.get("clip_qkv") is not None:
        raise KilnError(f"{arch}: clip_qkv {cfg['clip_qkv']} is not supported (kiln has no q/k/v clamp)")
    moe = _experts(cfg, arch, "qwen", "softmax_topk", "intermediate_size",
                   normalize=bool(cfg.get("norm_topk_prob", False)))
    bias = bool(cfg.get("attention_bias", False))
    return _common(cfg, arch, "olmoe", qkv_bias=bias, o_bias=bias, qk_norm="all", moe=moe)


def _granitemoe(cfg: dict, arch: str) -> DecoderConfig:
    """Granite-MoE: experts stacked in the checkpoint, top-k logits softmaxed, and four multipliers
    (embeddings, the score scale, block outputs before the residual add, logits as a divisor)."""
    moe = _experts(cfg, arch, "granite", "topk_softmax", "intermediate_size")
    bias = bool(cfg.get("attention_bias", False))
    return _common(cfg, arch, "granitemoe", qkv_bias=bias, o_bias=bias, moe=moe,
                   embed_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                   attn_scale=float(cfg.get("attention_multiplier", 1.0)),
                   residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                   logits_divisor=float(cfg.get("logits_scaling", 1.0)))


def _deepseek(cfg: dict, arch: str, version: int) -> DecoderConfig:
    """DeepSeek-V2/V3: MLA attention (frontend/mla.py), its softmax scale × YaRN's mscale_all_dim
    factor squared; experts from layer first_k_dense_replace on, with ungated shared experts and a
    float32 router: V2 softmax, greedy or group-limited, never renormalised; V3 sigmoid scores
    with the correction bias, groups by their best two."""
    nope, rope = need(cfg, "qk_nope_head_dim", arch), need(cfg, "qk_rope_head_dim", arch)
    bias = bool(cfg.get("attention_bias", False))
    mla = MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=need(cfg, "kv_lora_rank", arch),
                    nope_dim=nope, rope_dim=rope, v_dim=need(cfg, "v_head_dim", arch),
                    interleaved_rope=bool(cfg.get("rope_interleave", True)) if version == 3 else True, bias=bias)
    heads = need(cfg, "num_attention_heads", arch)
    _, scaling = _rope(cfg, arch)
    scale = (nope + rope) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    moe = None
    if cfg.get("n_routed_experts"):
        if version == 2:
            method = cfg.get("topk_method") or "greedy"
            routers = {"greedy": "softmax_topk", "group_limited_greedy": "softmax_group_max"}
            if method not in routers:
                raise KilnError(f"{arch}: topk_method {method!r} is not supported (supported: {', '.join(routers)})")
            router, fields = routers[method], {}
        else:
            router, fields = "sigmoid_group_top2", {"normalize": bool(cfg.get("norm_topk_prob", False)),
                                                    "router_bias": True}
        dense = cfg.get("first_k_dense_replace", 0) or 0
        moe = _experts({**cfg, "num_experts": cfg["n_routed_experts"]}, arch, "qwen", router,
                       "moe_intermediate_size", lambda i: i >= dense,
                       scaling=float(cfg.get("routed_scaling_factor", 1.0)),
                       n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                       shared_ffn=need(cfg, "moe_intermediate_size", arch) * (cfg.get("n_shared_experts") or 0),
                       shared_name="shared_experts", router_float32=True, **fields)
    cfg = {**cfg, "head_dim": nope + rope, "num_key_value_heads": heads, "partial_rotary_factor": 1.0}
    return _common(cfg, arch, f"deepseek_v{version}", o_bias=bias, mla=mla, moe=moe, attn_scale=scale)


FAMILIES = {
    "llama": Family(("LlamaForCausalLM",), _llama),
    "mistral": Family(("MistralForCausalLM",), _mistral),
    "qwen2": Family(("Qwen2ForCausalLM",), _qwen2),
    "qwen3": Family(("Qwen3ForCausalLM",), _qwen3),
    "olmo2": Family(("Olmo2ForCausalLM",), _olmo2),
    "phi3": Family(("Phi3ForCausalLM",), _phi3),
    "gemma2": Family(("Gemma2ForCausalLM",), _gemma2),
    "gemma3_text": Family(("Gemma3ForCausalLM",), _gemma3),
    "mixtral": Family(("MixtralForCausalLM",), _mixtral),
    "qwen2_moe": Family(("Qwen2MoeForCausalLM",), _qwen2_moe),
    "qwen3_moe": Family(("Qwen3MoeForCausalLM",), _qwen3_moe),
    "olmoe": Family(("OlmoeForCausalLM",), _olmoe),
    "granitemoe": Family(("GraniteMoeForCausalLM",), _granitemoe),
    "deepseek_v2": Family(("DeepseekV2ForCausalLM",), lambda cfg, arch: _deepseek(cfg, arch, 2)),
    "deepseek_v3": Family(("DeepseekV3ForCausalLM",), lambda cfg, arch: _deepseek(cfg, arch, 3)),
}


def supported_architectures() -> list[str]:
    return [a for family in FAMILIES.values() for a in family.architectures]


def parse_config(cfg: dict) -> DecoderConfig:
    """The DecoderConfig of a config.json, by its model_type; a clear error for anything else."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise KilnError("config.json lacks required field 'architectures'")
    arch = archs[0]
    model_type = cfg.get("model_type") or next(
        (t for t, family in FAMILIES.items() if arch in family.architectures), None)
    family = FAMILIES.get(model_type)
    if family is None or arch not in family.architectures:
        raise KilnError(f"architecture {arch} (model_type {model_type!r}) is not supported "
                        f"(supported: {', '.join(supported_architectures())})")
    return family.parse(cfg, arch)
