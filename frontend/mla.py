"""Multi-head Latent Attention blocks (DeepSeek-V2/V3): how the config and checkpoint names become
the literal graph that specialize_mla later absorbs.

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x) without a q LoRA rank)
    q_nope, q_pe = q per head split N | P;  q_pe roped
    c_kv, k_pe   = kv_a_proj_with_mqa(x) split R | P;  c_kv normed (kv_a_layernorm), k_pe roped
    latent_append(c_kv, k_pe) into the layer's latent cache; mla_attend(q_nope, q_pe, kv_b_proj)
DeepSeek's rope turns interleaved pairs (x0, x1), (x2, x3), …; kiln's rope op turns rotate-half
pairs (i, i + P/2). Reordering the rope rows of q_b_proj (or q_proj) and kv_a_proj_with_mqa evens
first, by a weight recipe, makes the one the other: q and k are permuted alike, so every q·k is
unchanged, and the cache stores k_pe in the permuted order.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.interface import KVSpec

LATENT_NORM_EPS = 1e-6      # q_a_layernorm and kv_a_layernorm keep RMSNorm's default, not rms_norm_eps


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None           # None: a plain q_proj
    kv_lora_rank: int                 # R: the compressed KV width
    nope_dim: int                     # N: qk_nope_head_dim
    rope_dim: int                     # P: qk_rope_head_dim
    v_dim: int                        # V: v_head_dim
    interleaved_rope: bool = True     # DeepSeek's complex-pair rope (V3: rope_interleave)
    bias: bool = False                # attention_bias: q_a_proj and kv_a_proj_with_mqa have biases

    def kv_spec(self, dtype: str, page_size: int) -> KVSpec:
        width = self.kv_lora_rank + self.rope_dim
        return KVSpec("latent", 1, width, self.kv_lora_rank, dtype, page_size)

    @classmethod
    def from_json(cls, d: dict) -> MLAConfig:
        return cls(**d)


def build_mla(b, mla: MLAConfig, x: str, prefix: str, heads: int, hidden: int, dtype: str, positions: str,
              inv_freq: str, mscale: float, pages: str, slots: str, page_indices: list[str], layer: int,
              scale: float, norm) -> str:
    """Layer `layer`'s attention on its normed input x [tokens, hidden], before o_proj: [tokens, H V].
    `norm(x, weight_name, width, eps)` builds the family's RMSNorm."""
    N, P, R, V = mla.nope_dim, mla.rope_dim, mla.kv_lora_rank, mla.v_dim
    attn = f"{prefix}.self_attn"

    def weight(name: str, rows: int, cols: int, rope_spans: list | None = None) -> str:
        """A projection's weight; with rope_spans, its rope rows reordered to rotate-half pairs."""
        if not (rope_spans and mla.interleaved_rope):
            return b.param(name, (rows, cols), dtype)
        return b.param(f"{name}.rope_pairs", (rows, cols), dtype,
                       recipe={"deinterleave": rope_spans, "of": name})

    def linear(x, name, rows, cols, bias=False, rope_spans=None):
        w = weight(f"{name}.weight", rows, cols, rope_spans)
        if not bias:
            return b.op("linear", x, w)
        bias_name = f"{name}.bias"
        if rope_spans and mla.interleaved_rope:
            bias_name = b.param(f"{bias_name}.rope_pairs", (rows,), dtype,
                                recipe={"deinterleave": rope_spans, "of": bias_name})
        return b.op("linear", x, w, None, b.param(bias_name, (rows,), dtype))          # no scale: float

    def roped(v, heads_of_v):
        flat = b.op("reshape", v, shape=("tokens", heads_of_v * P))
        turned = b.op("rope", flat, positions, inv_freq, head_dim=P, mscale=mscale)
        return b.op("reshape", turned, shape=("tokens", heads_of_v, P))

    q_spans = [[h * (N + P) + N, P] for h in range(heads)]
    if mla.q_lora_rank:
        q_a = linear(x, f"{attn}.q_a_proj", mla.q_lora_rank, hidden, mla.bias)
        q_a = norm(q_a, f"{attn}.q_a_layernorm.weight", mla.q_lora_rank, LATENT_NORM_EPS)
        q = linear(q_a, f"{attn}.q_b_proj", heads * (N + P), mla.q_lora_rank, rope_spans=q_spans)
    else:
        q = linear(x, f"{attn}.q_proj", heads * (N + P), hidden, rope_spans=q_spans)
    q = b.op("reshape", q, shape=("tokens", heads, N + P))
    q_nope = b.op("slice", q, begin=0, end=N)
    q_pe = roped(b.op("slice", q, begin=N, end=N + P), heads)
    compressed = linear(x, f"{attn}.kv_a_proj_with_mqa", R + P, hidden, mla.bias, rope_spans=[[R, P]])
    c_kv = norm(b.op("slice", compressed, begin=0, end=R), f"{attn}.kv_a_layernorm.weight", R, LATENT_NORM_EPS)
    k_pe = b.op("reshape", roped(b.op("slice", compressed, begin=R, end=R + P), 1), shape=("tokens", P))
    written = b.op("latent_append", c_kv, k_pe, pages, slots, layer=layer)
    kv_b = b.param(f"{attn}.kv_b_proj.weight", (heads * (N + V), R), dtype)
    out = b.op("mla_attend", q_nope, q_pe, written, kv_b, *page_indices, layer=layer, scale=float(scale))
    return b.op("reshape", out, shape=("tokens", heads * V))
