"""Mixture-of-experts MLP blocks: how a family's config and checkpoint names become moe_router and
moe_experts (ir/moe_ops.py), with a shared expert where the family has one.

Checkpoints store experts one by one (Mixtral's experts.{j}.w1/w3/w2; Qwen-MoE, OLMoE and
DeepSeek's experts.{j}.gate_proj/up_proj/down_proj) or already stacked (Granite's input_linear
[E, 2F, H] and output_linear [E, H, F]). Per-expert weights become the two 3-D params the experts
op reads by a "stack" recipe (ir/weights.py): gate_up [E, 2F, H] (each expert's gate rows, then
its up rows) and down [E, H, F], made once when weights are written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# layout -> (the block's name under the layer, the router's weight, expert j's gate, up and down
# weights; None where the checkpoint stacks them: Granite's (gate_up, down) are then given instead)
LAYOUTS = {
    "mixtral": ("block_sparse_moe", "gate.weight", ("experts.{j}.w1.weight", "experts.{j}.w3.weight",
                                                    "experts.{j}.w2.weight")),
    "qwen": ("mlp", "gate.weight", ("experts.{j}.gate_proj.weight", "experts.{j}.up_proj.weight",
                                    "experts.{j}.down_proj.weight")),
    "granite": ("block_sparse_moe", "router.layer.weight", ("input_linear.weight", "output_linear.weight")),
}


@dataclass(frozen=True)
class MoEConfig:
    experts: int
    top_k: int
    ffn: int                          # each expert's intermediate size
    router: str                       # moe_router scheme
    layout: str                       # LAYOUTS key
    sparse_layers: tuple[int, ...]    # layers with experts; the others keep the dense MLP
    normalize: bool = False
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_ffn: int = 0               # a shared expert's intermediate size (0: none)
    shared_name: str = "shared_expert"
    shared_gate: bool = False         # the shared expert's output × sigmoid(linear(x)) (Qwen2-MoE)
    router_float32: bool = False      # the router's linear runs in float32, its weight kept so (DeepSeek)
    router_bias: bool = False         # the router takes gate.e_score_correction_bias (DeepSeek-V3)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_json(cls, d: dict) -> MoEConfig:
        return cls(**{**d, "sparse_layers": tuple(d["sparse_layers"])})


def build_moe(b, moe: MoEConfig, x: str, layer_prefix: str, dtype: str, act: str,
              dense_mlp: Callable[[str, str, int], str]) -> str:
    """The MoE block of one layer on its normed input x [tokens, H]: router, routed experts, and the
    shared expert added where there is one. `dense_mlp(x, prefix, ffn)` builds a plain gated MLP."""
    block_name, router_name, names = LAYOUTS[moe.layout]
    block = f"{layer_prefix}.{block_name}"
    hidden = b.type_of(x).shape[1]
    E, F = moe.experts, moe.ffn
    if moe.router_float32:
        router_w = b.param(f"{block}.{router_name}", (E, hidden), "float32")
        logits = b.op("linear", b.op("cast", x, dtype="float32"), router_w)
    else:
        router_w = b.param(f"{block}.{router_name}", (E, hidden), dtype)
        logits = b.op("cast", b.op("linear", x, router_w), dtype="float32")
    bias = b.param(f"{block}.gate.e_score_correction_bias", (E,), "float32") if moe.router_bias else None
    routing = b.op("moe_router", logits, bias, scheme=moe.router, top_k=moe.top_k, normalize=moe.normalize,
                   scaling=float(moe.scaling), n_group=moe.n_group, topk_group=moe.topk_group)
    if len(names) == 2:                                   # stacked in the checkpoint
        gate_up = b.param(f"{block}.{names[0]}", (E, 2 * F, hidden), dtype)
        down = b.param(f"{block}.{names[1]}", (E, hidden, F), dtype)
    else:
        gate, up, down_name = (f"{block}.{n}" for n in names)
        gate_up = b.param(f"{block}.experts.gate_up", (E, 2 * F, hidden), dtype,
                          recipe={"stack": [[gate.format(j=j), up.format(j=j)] for j in range(E)]})
        down = b.param(f"{block}.experts.down", (E, hidden, F), dtype,
                       recipe={"stack": [[down_name.format(j=j)] for j in range(E)]})
    out = b.op("moe_experts", x, routing, gate_up, None, down, top_k=moe.top_k, activation=act)     # float: no scales
    if moe.shared_ffn:
        shared = dense_mlp(x, f"{block}.{moe.shared_name}", moe.shared_ffn)
        if moe.shared_gate:
            gate = b.op("linear", x, b.param(f"{block}.{moe.shared_name}_gate.weight", (1, hidden), dtype))
            shared = b.op("sigmoid_gate", shared, gate)
        out = b.op("add", out, shared)
    return out
