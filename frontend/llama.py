"""The Llama family (Llama 2/3/3.x, Mistral, Qwen2) as one builder with flags.

Variants are flags on LlamaConfig, not copies: Qwen2 adds QKV bias, Llama-3
adds rope scaling, Llama-3.2 ties the embeddings.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from kiln.errors import KilnError
from kiln.ir import Graph, GraphBuilder
from kiln.ir.kv_spec import KVSpec

from .rope import SUPPORTED_ROPE_TYPES


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    bos_token_id: int | list | None
    eos_token_id: int | list | None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()          # per layer: "full_attention" or "sliding_attention"

    def to_json(self) -> dict:
        return asdict(self)


def _need(cfg: dict, key: str, arch: str):
    if key not in cfg or cfg[key] is None:
        raise KilnError(f"config.json of {arch} lacks required field {key!r}")
    return cfg[key]


def parse_config(cfg: dict, arch: str) -> LlamaConfig:
    """Read a transformers config.json (v4 or v5 layout) into a LlamaConfig; refuse what kiln cannot run."""
    hidden = _need(cfg, "hidden_size", arch)
    heads = _need(cfg, "num_attention_heads", arch)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise KilnError(f"{arch}: hidden_act {act!r} is not supported (only 'silu')")
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise KilnError(f"{arch}: rope_scaling type {kind!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if kind == "default":
            scaling = None
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise KilnError(f"{arch}: partial_rotary_factor {cfg['partial_rotary_factor']} is not supported")
    max_pos = cfg.get("max_position_embeddings", 4096)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    return LlamaConfig(
        architecture=arch,
        vocab_size=_need(cfg, "vocab_size", arch),
        hidden_size=hidden,
        intermediate_size=_need(cfg, "intermediate_size", arch),
        num_layers=_need(cfg, "num_hidden_layers", arch),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        **_attention_layers(cfg, arch),
    )


def _attention_layers(cfg: dict, arch: str) -> dict:
    """The sliding window and which layers use it, as transformers decides: Mistral windows every
    layer when `sliding_window` is set; Qwen2 only with `use_sliding_window`, on the layers its
    `layer_types` name (by default those from `max_window_layers` on)."""
    layers = _need(cfg, "num_hidden_layers", arch)
    window = cfg.get("sliding_window") if arch in ("MistralForCausalLM", "Qwen2ForCausalLM") else None
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return {"sliding_window": None, "layer_types": ("full_attention",) * layers}
    if arch == "Qwen2ForCausalLM":
        first = cfg.get("max_window_layers", 28)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(layers)]
    else:
        types = ["sliding_attention"] * layers
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown or len(types) != layers:
        raise KilnError(f"{arch}: layer_types {types} must name full_attention or sliding_attention for each "
                        f"of the {layers} layers")
    return {"sliding_window": int(window), "layer_types": tuple(types)}


ROPE_PARAM = "rope.inv_freq"   # computed from the config, not read from the checkpoint


def build_graph(c: LlamaConfig, dtype: str, page_size: int) -> Graph:
    """The forward of one ragged engine step: new tokens of many sequences in, last-token logits out."""
    b = GraphBuilder(c.architecture)
    H, D, HQ, HKV = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    tokens = b.input("tokens", ("tokens",), "int32")
    positions = b.input("positions", ("tokens",), "int32")
    q_indptr = b.input("q_indptr", ("seqs1",), "int32")              # [seqs + 1]
    page_indptr = b.input("page_indptr", ("seqs1",), "int32")        # [seqs + 1]
    page_values = b.input("page_values", ("nnz_pages",), "int32")
    last_page_len = b.input("last_page_len", ("seqs",), "int32")
    slot_mapping = b.input("slot_mapping", ("tokens",), "int32")
    logit_rows = b.input("logit_rows", ("rows",), "int32")               # rows whose logits come back
    specs = [KVSpec("sliding", HKV, D, D, dtype, page_size, window=c.sliding_window)
             if kind == "sliding_attention" else KVSpec("full", HKV, D, D, dtype, page_size)
             for kind in c.layer_types]
    kv_pages = [b.kv_cache(i, spec)[0] for i, spec in enumerate(specs)]
    inv_freq = b.param(ROPE_PARAM, (D // 2,), "float32")

    def linear(x, prefix, n_out, n_in, bias):
        w = b.param(f"{prefix}.weight", (n_out, n_in), dtype)
        return b.op("linear", x, w, b.param(f"{prefix}.bias", (n_out,), dtype) if bias else None)

    def norm(x, name):
        return b.op("rms_norm", x, b.param(name, (H,), dtype), eps=float(c.rms_norm_eps))

    embed_name = "model.embed_tokens.weight"
    h = b.op("embed", tokens, b.param(embed_name, (c.vocab_size, H), dtype))
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        x = norm(h, f"{p}.input_layernorm.weight")
        q = linear(x, f"{p}.self_attn.q_proj", HQ * D, H, c.qkv_bias)
        k = linear(x, f"{p}.self_attn.k_proj", HKV * D, H, c.qkv_bias)
        v = linear(x, f"{p}.self_attn.v_proj", HKV * D, H, c.qkv_bias)
        q = b.op("reshape", b.op("rope", q, positions, inv_freq, head_dim=D), shape=("tokens", HQ, D))
        k = b.op("reshape", b.op("rope", k, positions, inv_freq, head_dim=D), shape=("tokens", HKV, D))
        v = b.op("reshape", v, shape=("tokens", HKV, D))
        attn = b.op("paged_attention", q, k, v, kv_pages[i], slot_mapping, q_indptr, page_indptr,
                    page_values, last_page_len, layer=i, scale=float(D) ** -0.5, window=specs[i].window or 0)
        attn = b.op("reshape", attn, shape=("tokens", HQ * D))
        h = b.op("add", h, linear(attn, f"{p}.self_attn.o_proj", H, HQ * D, c.o_bias))
        x = norm(h, f"{p}.post_attention_layernorm.weight")
        gate = linear(x, f"{p}.mlp.gate_proj", c.intermediate_size, H, c.mlp_bias)
        up = linear(x, f"{p}.mlp.up_proj", c.intermediate_size, H, c.mlp_bias)
        down = linear(b.op("mul", b.op("silu", gate), up), f"{p}.mlp.down_proj", H, c.intermediate_size, c.mlp_bias)
        h = b.op("add", h, down)
    last = norm(b.op("take_rows", h, logit_rows), "model.norm.weight")
    head = embed_name if c.tie_word_embeddings else b.param("lm_head.weight", (c.vocab_size, H), dtype)
    logits = b.op("cast", b.op("linear", last, head), dtype="float32", name="logits")
    return b.output(logits)
