"""One decoder-only transformer builder; model families are flags on its config, not copies.

`DecoderConfig` holds what the graph needs: sizes, and per-block hooks read by `build_graph`:
  norms            which RMSNorms a block has, by role, and their checkpoint names:
                   attn_in / mlp_in before attention / the MLP (Llama), attn_out / mlp_out after
                   them, before the residual add (OLMo 2: only those; Gemma: all four)
  norm_offset      the norm weight is stored as an offset from this (Gemma: 1)
  norm_weight_in_float32  scale in float32 and round once (OLMo 2, Gemma) rather than round the
                   normalised value first (Llama)
  qk_norm          RMSNorm of q and k before rope: per head over head_dim ("head": Qwen3,
                   Gemma 3) or over all heads ("all": OLMo 2)
  mlp_act          the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
  embed_multiplier embeddings × this (Gemma: sqrt(hidden); Granite: embedding_multiplier)
  residual_multiplier  attention and MLP outputs × this before the residual add (Granite)
  logits_divisor   logits / this (Granite's logits_scaling)
  attn_scale       the score scale (default head_dim^-1/2; Gemma: query_pre_attn_scalar^-1/2)
  attn_softcap / final_softcap   cap · tanh(x / cap) on scores / logits (Gemma 2)
  fused_projections  the checkpoint stores qkv_proj and gate_up_proj (Phi-3): imported as the
                   fused linears that fuse_qkv / fuse_gate_up would make
  layer_types, sliding_window   which layers attend through a sliding window
  local_rope_theta, local_rope_scaling   sliding layers rotate with their own rope (Gemma 3)
  rotary_dim       rope turns only the first rotary_dim elements of each head (Phi-4-mini: 3/4)
  moe              mixture-of-experts MLPs (frontend/moe.py MoEConfig), on the layers it names
  mla              Multi-head Latent Attention (frontend/mla.py MLAConfig): a latent KV cache per
                   layer and DeepSeek's low-rank projections in place of q/k/v
The graph is one ragged engine step: new tokens of many sequences in, chosen rows' logits out.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from kiln.interface import STEP_INPUTS, KVSpec
from kiln.ir import Graph, GraphBuilder
from kiln.ir.ops import GATED_OPS

from .mla import MLAConfig, build_mla
from .moe import MoEConfig, build_moe
from .rope import context_limit, rope_parameters

ROPE_PARAM = "rope.inv_freq"             # computed from the config, not read from the checkpoint
LOCAL_ROPE_PARAM = "rope_local.inv_freq"
COMPUTED_PARAMS = (ROPE_PARAM, LOCAL_ROPE_PARAM)
LLAMA_NORMS = {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    model_type: str
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
    bos_token_id: int | list | None
    eos_token_id: int | list | None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()          # per layer: "full_attention" or "sliding_attention"
    norms: dict = field(default_factory=lambda: dict(LLAMA_NORMS))
    norm_offset: float = 0.0
    norm_weight_in_float32: bool = False
    qk_norm: str = "none"
    mlp_act: str = "silu"
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    fused_projections: bool = False
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    rotary_dim: int = 0                        # 0: the whole head
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> DecoderConfig:
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["layer_types"] = tuple(d.get("layer_types", ()))
        if d.get("moe"):
            d["moe"] = MoEConfig.from_json(d["moe"])
        if d.get("mla"):
            d["mla"] = MLAConfig.from_json(d["mla"])
        return cls(**d)

    @property
    def max_context(self) -> int:
        """The longest sequence kiln runs: the model's, or shorter where the rope variant stops being
        exact with a KV cache (frontend/rope.py context_limit)."""
        return context_limit(self.rope_scaling, self.max_position_embeddings)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def kv_spec(self, layer: int, dtype: str, page_size: int) -> KVSpec:
        d = self.head_dim
        if self.mla is not None:
            return self.mla.kv_spec(dtype, page_size)
        if self.is_sliding(layer):
            return KVSpec("sliding", self.num_kv_heads, d, d, dtype, page_size, window=self.sliding_window)
        return KVSpec("full", self.num_kv_heads, d, d, dtype, page_size)

    @property
    def rope_dim(self) -> int:
        """How many elements of a head rope turns (MLA: the shared rope part of q and k)."""
        return self.mla.rope_dim if self.mla else self.rotary_dim or self.head_dim

    def rope(self, local: bool = False) -> tuple:
        """(inverse frequencies, mscale) of the global layers' rope, or of the sliding layers' own."""
        dim = self.rope_dim
        if local:
            return rope_parameters(dim, self.local_rope_theta, self.local_rope_scaling, self.max_position_embeddings)
        return rope_parameters(dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)

    def computed_weights(self) -> dict:
        """Params computed from the config rather than read from the checkpoint: name -> thunk."""
        out = {ROPE_PARAM: lambda: self.rope()[0]}
        if self.local_rope_theta is not None:
            out[LOCAL_ROPE_PARAM] = lambda: self.rope(local=True)[0]
        return out


def build_graph(c: DecoderConfig, dtype: str, page_size: int) -> Graph:
    """The forward of one ragged engine step: new tokens of many sequences in, last-token logits out."""
    b = GraphBuilder(c.architecture)
    H, D, HQ, HKV, FF = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size
    step = {i.name: b.input(i.name, (i.length,), "int32") for i in STEP_INPUTS}     # kiln/interface.py's
    tokens, positions, slot_mapping = step["tokens"], step["positions"], step["slot_mapping"]
    paging = [step[name] for name in ("q_indptr", "page_indptr", "page_values", "last_page_len")]
    specs = [c.kv_spec(i, dtype, page_size) for i in range(c.num_layers)]
    kv_pages = [b.kv_cache(i, spec)[0] for i, spec in enumerate(specs)]
    rope_params = {name: b.param(name, (c.rope_dim // 2,), "float32") for name in c.computed_weights()}
    mscales = {local: c.rope(local)[1] for local in (False, c.local_rope_theta is not None)}

    def linear(x, prefix, n_out, n_in, bias):
        w = b.param(f"{prefix}.weight", (n_out, n_in), dtype)
        return b.op("linear", x, w, None, b.param(f"{prefix}.bias", (n_out,), dtype) if bias else None)

    def norm(x, name, width=H, eps=None):
        return b.op("rms_norm", x, b.param(name, (width,), dtype), eps=float(eps or c.rms_norm_eps),
                    offset=float(c.norm_offset), weight_in_float32=c.norm_weight_in_float32)

    def qk_normed(x, name, heads):
        if c.qk_norm == "all":
            return norm(x, name, heads * D)
        if c.qk_norm == "head":
            per_head = norm(b.op("reshape", x, shape=("tokens", heads, D)), name, D)
            return b.op("reshape", per_head, shape=("tokens", heads * D))
        return x

    def block_norm(x, p, role):
        return norm(x, f"{p}.{c.norms[role]}.weight") if role in c.norms else x

    embed_name = "model.embed_tokens.weight"
    h = b.op("embed", tokens, b.param(embed_name, (c.vocab_size, H), dtype))
    if c.embed_multiplier != 1.0:
        h = b.op("mul_scalar", h, value=float(c.embed_multiplier))

    def residual_add(h, out):
        if c.residual_multiplier != 1.0:
            out = b.op("mul_scalar", out, value=float(c.residual_multiplier))
        return b.op("add", h, out)

    def dense_mlp(x, prefix, ffn, fused=False):
        gated = GATED_OPS[c.mlp_act]
        if fused:
            act = b.op(gated, linear(x, f"{prefix}.gate_up_proj", 2 * ffn, H, c.mlp_bias))
        else:
            gate = linear(x, f"{prefix}.gate_proj", ffn, H, c.mlp_bias)
            act = b.op("mul", b.op(c.mlp_act, gate), linear(x, f"{prefix}.up_proj", ffn, H, c.mlp_bias))
        return linear(act, f"{prefix}.down_proj", H, ffn, c.mlp_bias)

    def attention(x, i, p):
        """Layer i's attention on its normed input, projected back to the hidden size."""
        local = c.is_sliding(i) and c.local_rope_theta is not None
        inv, mscale = rope_params[LOCAL_ROPE_PARAM if local else ROPE_PARAM], mscales[local]
        scale = float(c.attn_scale or D ** -0.5)
        if c.mla is not None:
            attn = build_mla(b, c.mla, x, p, HQ, H, dtype, positions, inv, mscale, kv_pages[i], slot_mapping,
                             paging, i, scale, norm)
            return linear(attn, f"{p}.self_attn.o_proj", H, HQ * c.mla.v_dim, c.o_bias)
        if c.fused_projections:
            qkv = linear(x, f"{p}.self_attn.qkv_proj", (HQ + 2 * HKV) * D, H, c.qkv_bias)
            q, k, v = (b.op("slice", qkv, begin=lo * D, end=hi * D)
                       for lo, hi in ((0, HQ), (HQ, HQ + HKV), (HQ + HKV, HQ + 2 * HKV)))
        else:
            q, k, v = (linear(x, f"{p}.self_attn.{name}", heads * D, H, c.qkv_bias)
                       for name, heads in (("q_proj", HQ), ("k_proj", HKV), ("v_proj", HKV)))
        q = qk_normed(q, f"{p}.self_attn.q_norm.weight", HQ)
        k = qk_normed(k, f"{p}.self_attn.k_norm.weight", HKV)
        turn = {"head_dim": D, "mscale": mscale, "rotary_dim": c.rotary_dim}
        q = b.op("reshape", b.op("rope", q, positions, inv, **turn), shape=("tokens", HQ, D))
        k = b.op("reshape", b.op("rope", k, positions, inv, **turn), shape=("tokens", HKV, D))
        v = b.op("reshape", v, shape=("tokens", HKV, D))
        written = b.op("kv_append", k, v, kv_pages[i], slot_mapping, layer=i)
        attn = b.op("paged_attend", q, written, *paging, layer=i,
                    scale=scale, window=specs[i].window or 0, softcap=float(c.attn_softcap or 0.0))
        return linear(b.op("reshape", attn, shape=("tokens", HQ * D)), f"{p}.self_attn.o_proj", H, HQ * D, c.o_bias)

    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        h = residual_add(h, block_norm(attention(block_norm(h, p, "attn_in"), i, p), p, "attn_out"))
        x = block_norm(h, p, "mlp_in")
        if c.moe is not None and c.moe.is_sparse(i):
            mlp_out = build_moe(b, c.moe, x, p, dtype, c.mlp_act, dense_mlp)
        else:
            mlp_out = dense_mlp(x, f"{p}.mlp", FF, c.fused_projections)
        h = residual_add(h, block_norm(mlp_out, p, "mlp_out"))
    last = norm(b.op("take_rows", h, step["logit_rows"]), "model.norm.weight")
    head = embed_name if c.tie_word_embeddings else b.param("lm_head.weight", (c.vocab_size, H), dtype)
    logits = b.op("linear", last, head)
    if c.logits_divisor != 1.0:
        logits = b.op("mul_scalar", logits, value=1.0 / float(c.logits_divisor))
    if c.final_softcap:
        logits = b.op("softcap", logits, cap=float(c.final_softcap))
    return b.output(b.op("cast", logits, dtype="float32", name="logits"))
