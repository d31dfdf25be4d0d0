"""A GGUF file's metadata (`general.architecture`, `<arch>.*` keys) as the config.json of the same
model, so that kiln's family registry (frontend/families.py) parses it as it parses a Hugging Face
directory. One function per llama.cpp architecture; each writes the fields transformers' config of
that family has, as llama.cpp's converter read them from it.

Where llama.cpp stores a setting as a tensor (Llama 3.1's and Phi-3's rope factors) it becomes the
rope variant that divides each frequency by its factor (LongRoPE's short factors, attention factor 1):
llama.cpp computes exactly that."""
from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.errors import KilnError

from .gguf_file import GGUFFile


class Metadata:
    """`<arch>.*` keys of one file, read with the architecture's prefix and a clear error when missing."""

    def __init__(self, gguf: GGUFFile):
        self.file, self.arch, self.values = gguf, gguf.architecture, gguf.metadata

    def get(self, key: str, default=None):
        return self.values.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise KilnError(f"{self.file.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    def per_layer(self, key: str):
        """A count that newer files may store per layer (feed_forward_length, head_count_kv): its value
        if every layer has the same, else an error naming the key."""
        value = self.need(key)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise KilnError(f"{self.file.path}: {self.arch}.{key} differs between layers ({value[:8]}...); "
                                "kiln needs one value")
            value = value[0]
        return int(value)


def _rope_scaling(m: Metadata, factors: np.ndarray | None) -> dict | None:
    if factors is not None:
        original = m.get("rope.scaling.original_context_length") or m.need("context_length")
        return {"rope_type": "longrope", "short_factor": [float(f) for f in factors],
                "long_factor": [float(f) for f in factors],
                "attention_factor": float(m.get("rope.scaling.attn_factor", 1.0)),
                "original_max_position_embeddings": int(original)}
    kind = m.get("rope.scaling.type", "none")
    factor = m.get("rope.scaling.factor")
    if kind == "none" or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(m.need("rope.scaling.original_context_length"))}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if m.get(f"rope.scaling.{key}") is not None:
                scaling[name] = float(m.get(f"rope.scaling.{key}"))
        return scaling
    raise KilnError(f"{m.file.path}: {m.arch}.rope.scaling.type {kind!r} is not supported (supported: linear, yarn)")


def _common(m: Metadata, model_type: str, architecture: str, rope_factors, **extra) -> dict:
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    head_dim = int(m.get("attention.key_length") or hidden // heads)
    tokens = m.values.get("tokenizer.ggml.tokens")
    cfg = {
        "model_type": model_type, "architectures": [architecture],
        "vocab_size": int(m.get("vocab_size") or (len(tokens) if tokens else 0)) or None,
        "hidden_size": hidden,
        "intermediate_size": m.per_layer("feed_forward_length") if m.get("feed_forward_length") is not None else None,
        "num_hidden_layers": int(m.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": m.per_layer("attention.head_count_kv") if m.get("attention.head_count_kv") else heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(m, rope_factors),
        "max_position_embeddings": int(m.get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in m.file.tensors,
        "bos_token_id": m.values.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.values.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    rotary = m.get("rope.dimension_count")
    if rotary and int(rotary) != head_dim:
        cfg["partial_rotary_factor"] = int(rotary) / head_dim
    cfg.update(extra)
    return cfg


def _has(m: Metadata, tensor: str) -> bool:
    return tensor in m.file.tensors


def _llama(m: Metadata, factors) -> dict:
    """llama.cpp writes Llama, Mistral and Mixtral as `llama`: experts make it Mixtral, a window Mistral."""
    bias, window = _has(m, "blk.0.attn_q.bias"), m.get("attention.sliding_window")
    if m.get("expert_count"):
        return _common(m, "mixtral", "MixtralForCausalLM", factors, num_local_experts=int(m.need("expert_count")),
                       num_experts_per_tok=int(m.need("expert_used_count")), sliding_window=window)
    if window:
        return _common(m, "mistral", "MistralForCausalLM", factors, sliding_window=int(window))
    return _common(m, "llama", "LlamaForCausalLM", factors, attention_bias=bias,
                   mlp_bias=_has(m, "blk.0.ffn_up.bias"))


def _qwen_experts(m: Metadata, norm_topk: bool) -> dict:
    return {"num_experts": int(m.need("expert_count")), "num_experts_per_tok": int(m.need("expert_used_count")),
            "moe_intermediate_size": int(m.need("expert_feed_forward_length")), "norm_topk_prob": norm_topk,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen2moe(m: Metadata, factors) -> dict:
    shared = m.get("expert_shared_feed_forward_length")
    return _common(m, "qwen2_moe", "Qwen2MoeForCausalLM", factors, **_qwen_experts(m, False),
                   shared_expert_intermediate_size=int(shared) if shared else 0)


def _gemma(m: Metadata, model_type: str, architecture: str, factors, **extra) -> dict:
    """Gemma 2 and 3 scale queries by 1/sqrt(head_dim), and the 27B models by 1/sqrt(hidden / heads),
    as llama.cpp does (the files do not store query_pre_attn_scalar)."""
    cfg = _common(m, model_type, architecture, factors, hidden_act="gelu_pytorch_tanh", **extra)
    big = cfg["num_hidden_layers"] in (46, 62) and cfg["hidden_size"] in (4608, 5376)      # the 27B models
    cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    cfg["sliding_window"] = m.get("attention.sliding_window")
    return cfg


def _gemma2(m: Metadata, factors) -> dict:
    return _gemma(m, "gemma2", "Gemma2ForCausalLM", factors,
                  attn_logit_softcapping=m.get("attn_logit_softcapping"),
                  final_logit_softcapping=m.get("final_logit_softcapping"))


def _gemma3(m: Metadata, factors) -> dict:
    """Gemma 3: local layers unscaled at rope.freq_base_swa (10000 in older files), global ones where
    attention.sliding_window_pattern says (every sixth layer in files without it, as llama.cpp assumes)."""
    cfg = _gemma(m, "gemma3_text", "Gemma3ForCausalLM", factors,
                 final_logit_softcapping=m.get("final_logit_softcapping"))
    pattern = m.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        cfg["layer_types"] = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    cfg.update(sliding_window_pattern=6, rope_local_base_freq=float(m.get("rope.freq_base_swa", 10000.0)))
    return cfg


def _granitemoe(m: Metadata, factors) -> dict:
    """Granite-MoE's four multipliers, as the converter stored them (the logits' is a divisor in both)."""
    return _common(m, "granitemoe", "GraniteMoeForCausalLM", factors,
                   num_local_experts=int(m.need("expert_count")), num_experts_per_tok=int(m.need("expert_used_count")),
                   embedding_multiplier=float(m.get("embedding_scale", 1.0)),
                   residual_multiplier=float(m.get("residual_scale", 1.0)),
                   attention_multiplier=float(m.get("attention.scale", 1.0)),
                   logits_scaling=float(m.get("logit_scale", 1.0)))


def _olmoe(m: Metadata, factors) -> dict:
    return _common(m, "olmoe", "OlmoeForCausalLM", factors, num_experts=int(m.need("expert_count")),
                   num_experts_per_tok=int(m.need("expert_used_count")), norm_topk_prob=False)


def _deepseek2(m: Metadata, factors) -> dict:
    """DeepSeek-V2 and V3 (llama.cpp writes both as `deepseek2`): V3 by its router's correction bias
    (exp_probs_b) or sigmoid gating. MLA's head sizes from key_length_mla/value_length_mla (files before
    the k_b/v_b split: key_length/value_length); YaRN's mscale from yarn_log_multiplier (0.1 ×
    mscale_all_dim, as llama.cpp stores it for this architecture); rope always interleaved."""
    rope = int(m.need("rope.dimension_count"))
    split = m.get("attention.key_length_mla") is not None
    key = int(m.need("attention.key_length_mla" if split else "attention.key_length"))
    v3 = _has(m, "blk.0.exp_probs_b.bias") or any(f"blk.{i}.exp_probs_b.bias" in m.file.tensors
                                                    for i in range(int(m.need("block_count"))))
    if m.get("expert_gating_func") == 2 and not v3:
        raise KilnError(f"{m.file.path}: sigmoid expert gating without a correction bias (exp_probs_b) is not "
                        "supported")
    groups = int(m.get("expert_group_count", 1))
    experts = {} if not m.get("expert_count") else {
        "n_routed_experts": int(m.need("expert_count")), "num_experts_per_tok": int(m.need("expert_used_count")),
        "moe_intermediate_size": int(m.need("expert_feed_forward_length")),
        "n_shared_experts": int(m.get("expert_shared_count", 0)), "first_k_dense_replace":
        int(m.get("leading_dense_block_count", 0)), "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(m.get("expert_weights_norm", False)), "n_group": groups,
        "topk_group": int(m.get("expert_group_used_count", 1)),
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy"}
    family = ("deepseek_v3", "DeepseekV3ForCausalLM") if v3 else ("deepseek_v2", "DeepseekV2ForCausalLM")
    cfg = _common(m, *family, factors, q_lora_rank=m.get("attention.q_lora_rank"),
                  kv_lora_rank=int(m.need("attention.kv_lora_rank")), qk_rope_head_dim=rope,
                  qk_nope_head_dim=key - rope,
                  v_head_dim=int(m.need("attention.value_length_mla" if split else "attention.value_length")),
                  rope_interleave=True, **experts)
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]       # the file says 1: MLA read as MQA
    cfg.pop("head_dim"), cfg.pop("partial_rotary_factor", None)
    multiplier = m.get("rope.scaling.yarn_log_multiplier")
    if cfg.get("rope_scaling") and multiplier:
        cfg["rope_scaling"].update(mscale=float(multiplier) / 0.1, mscale_all_dim=float(multiplier) / 0.1)
    return cfg


def _phi3(m: Metadata, factors) -> dict:
    window = m.get("attention.sliding_window")
    return _common(m, "phi3", "Phi3ForCausalLM", factors, sliding_window=int(window) if window else None)


# llama.cpp's architecture name -> the HF config of the same model
ARCHITECTURES: dict[str, Callable[[Metadata, np.ndarray | None], dict]] = {
    "llama": _llama,
    "qwen2": lambda m, f: _common(m, "qwen2", "Qwen2ForCausalLM", f),
    "qwen3": lambda m, f: _common(m, "qwen3", "Qwen3ForCausalLM", f),
    "qwen2moe": _qwen2moe,
    "qwen3moe": lambda m, f: _common(m, "qwen3_moe", "Qwen3MoeForCausalLM", f, **_qwen_experts(m, True)),
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "olmo2": lambda m, f: _common(m, "olmo2", "Olmo2ForCausalLM", f),
    "olmoe": _olmoe,
    "deepseek2": _deepseek2,
    "granitemoe": _granitemoe,
}


def hf_config(gguf: GGUFFile, rope_factors: np.ndarray | None) -> dict:
    """config.json of the model `gguf` holds; `rope_factors`: its rope_freqs / rope_factors tensor, if any."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise KilnError(f"{gguf.path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    return {k: v for k, v in ARCHITECTURES[arch](Metadata(gguf), rope_factors).items() if v is not None}
