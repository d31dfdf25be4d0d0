"""The one bridge to TVM's paged-attention kernel factories (`tvm.relax.frontend.nn.llm.kv_cache`).

The factories return PrimFuncs whose trailing scalar parameters (causal mask, rope mode, scales)
kiln fixes at compile time. They are bound here by name, after checking every parameter name
against the signature this code was written for, so a TVM upgrade that renames or reorders them
fails here, loudly, instead of binding the wrong scalar. GPU targets get the scheduled GPU kernels;
the CPU gets TVM's `_cpu` variants of the same kernels (same parameters), which lets the CPU tests
run the very argument binding the GPUs use.

Buffers (kiln's page layout [pages, 2, kv_heads, page_size, head_dim]):
  prefill: q [tokens, Hq, D], q_indptr, pages, page_indptr, page_values, length_info (rows in each
           sequence's last page), k_rope_pos_offset, q_rope_position, output, lse
  decode:  the same without q_indptr (one query per sequence)
Rope is applied before attention (rotary_mode 0), so k_rope_pos_offset and the rope scalars are unused.
MLA (GPUs; latent pages [pages, page_size, R + P], kiln's [pages, 1, 1, page_size, R + P] viewed so):
  mla_prefill: q [tokens, Hq, R + P] ([q_latent | q_rope]), q_indptr, pages, page_indptr,
               page_values, length_info, output [tokens, Hq, R], lse; any step, decode included
  mla_append:  pages, kv_data [tokens, R + P], position_map (slot_mapping)
"""
from __future__ import annotations

from tvm import tirx
from tvm.relax.frontend.nn.llm import kv_cache as tvm_llm

from kiln.errors import KilnError

_PAGED = ["pages", "page_indptr", "page_values", "length_info", "k_rope_pos_offset", "q_rope_position",
          "output", "lse"]
SIGNATURES = {
    "prefill": ["q", "q_indptr", *_PAGED, "causal", "rotary_mode", "rope_scale", "rope_theta", "sm_scale"],
    "decode": ["Q", "pages", "page_table_indptr", "page_table_values", *_PAGED[3:],
               "rotary_mode", "rope_scale", "rope_theta", "sm_scale"],
    "mla_prefill": ["q", "q_indptr", "pages", "page_indptr", "page_values", "length_info", "output", "lse", "causal",
                    "sm_scale"],
    "mla_append": ["pages", "kv_data", "position_map"],
}


def _bind(kind: str, func: tirx.PrimFunc, **scalars) -> tirx.PrimFunc:
    """Check `func`'s parameter names against SIGNATURES[kind] and fix the named scalars."""
    names = [p.name for p in func.params]
    if names != SIGNATURES[kind]:
        raise KilnError(f"TVM's paged {kind} attention kernel has parameters {names}; kiln binds "
                        f"{SIGNATURES[kind]} (codegen/kernels/tvm_kernels.py needs updating for this TVM)")
    by_name = {p.name: p for p in func.params}
    values = {}
    for name, value in scalars.items():
        param = by_name[name]
        dtype = str(param.ty)
        values[param] = tirx.IntImm(dtype, value) if dtype.startswith("int") else tirx.FloatImm(dtype, value)
    return func.specialize(values)


def _on_cpu(target) -> bool:
    return not target.thread_blocks


def prefill_attention(target, kv_heads: int, q_heads: int, head_dim: int, page_size: int, dtype: str,
                      scale: float) -> tirx.PrimFunc:
    """Causal ragged attention of new tokens over paged KV (any step), rope already applied."""
    if _on_cpu(target):
        func = tvm_llm._attention_prefill_cpu(kv_heads, q_heads, head_dim, dtype, False, {}, page_size=page_size)
    else:
        func = tvm_llm._attention_prefill(kv_heads, q_heads, head_dim, dtype, False, {}, target.tvm_target(),
                                          page_size=page_size)
    return _bind("prefill", func, causal=1, rotary_mode=0, rope_scale=1.0, rope_theta=1e4, sm_scale=scale)


def decode_attention(target, kv_heads: int, q_heads: int, head_dim: int, page_size: int, dtype: str,
                     scale: float) -> tirx.PrimFunc:
    """One query per sequence over its paged KV. On GPUs a block serves the q heads of one KV
    head, so a GQA group reads each K/V page once."""
    if _on_cpu(target):
        func = tvm_llm._attention_decode_cpu(kv_heads, q_heads, head_dim, dtype, False, {}, page_size=page_size)
    else:
        func = tvm_llm._attention_decode(kv_heads, q_heads, head_dim, dtype, False, {}, target.tvm_target(),
                                         page_size=page_size)
    return _bind("decode", func, rotary_mode=0, rope_scale=1.0, rope_theta=1e4, sm_scale=scale)


def mla_attention(target, q_heads: int, rank: int, rope: int, page_size: int, dtype: str,
                  scale: float) -> tirx.PrimFunc:
    """TVM's MLA attention (GPUs): causal ragged MQA of [q_latent | q_rope] over latent rows, values
    their first `rank` values."""
    func = tvm_llm._attention_prefill_mla(q_heads, rank, rope, dtype, False, target.tvm_target(), page_size=page_size)
    return _bind("mla_prefill", func, causal=1, sm_scale=scale)


def mla_append(width: int, dtype: str, page_size: int) -> tirx.PrimFunc:
    """TVM's latent append (GPUs): (pages, kv_data [tokens, width], slot_mapping)."""
    return _bind("mla_append", tvm_llm._kv_cache_transpose_append_mla(width, dtype, page_size))


def kv_append(kv_heads: int, head_dim: int, dtype: str, page_size: int) -> tirx.PrimFunc:
    """Write the new tokens' k and v rows into their slots: (pages, k, v, slot_mapping)."""
    func = tvm_llm._kv_cache_transpose_append(kv_heads, head_dim, dtype, page_size)
    if len(func.params) != 4:
        raise KilnError(f"TVM's KV append kernel has {len(func.params)} parameters; kiln passes "
                        "(pages, k, v, slot_mapping) (codegen/kernels/tvm_kernels.py needs updating for this TVM)")
    return func
