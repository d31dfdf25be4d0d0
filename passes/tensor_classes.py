"""Tensor classes: the groups of weights --tensor-quant chooses formats for, the layers a 4-bit policy
gives more bits, and what each kind of weight got in a quantised graph (the manifest records it; `kiln
inspect` prints it)."""
from __future__ import annotations

from collections import Counter

from kiln.ir import Graph, input_of, weight_format
from kiln.ir.quant import INTEGER_LEVELS, SCHEMES

PROJECTIONS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
               "down_proj": "down"}


def tensor_classes(weight: str) -> tuple[str, ...]:
    """The --tensor-quant classes a (checkpoint-named) weight belongs to, the most specific first:
    model.layers.3.self_attn.q_proj.weight -> (q, attention); ...mlp.shared_experts.down_proj.weight ->
    (down, mlp); ...mlp.experts.gate_up -> (experts,)."""
    parts = weight.split(".")
    if "experts" in parts:
        return ("experts",)
    projection = next((PROJECTIONS[p] for p in parts if p in PROJECTIONS), None)
    group = "attention" if "self_attn" in parts else "mlp" if "mlp" in parts else None
    return tuple(c for c in (projection, group) if c)


MORE_BITS_CLASSES = ("v", "down")       # the projections a 4-bit policy gives more bits in some layers


def layer_of(weight: str) -> int | None:
    """The decoder layer a checkpoint-named weight belongs to (model.layers.N...), None for others."""
    parts = weight.split(".")
    return next((int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()),
                None)


def more_bits_layers(num_layers: int) -> set[int]:
    """The layers whose v and down projections a 4-bit model keeps at 8 bits: the first and last eighth
    and every third between, as llama.cpp's Q4_K_M picks them (its use_more_bits) for its 6-bit ones.
    Measured on SmolLM2 (docs/BENCHMARKS.md): the perplexity 4 bits lose falls by a third for some
    15 % more bytes in the layers' weights."""
    eighth = num_layers // 8
    return {i for i in range(num_layers) if i < eighth or i >= num_layers - eighth or (i - eighth) % 3 == 2}


def _described(node, act_block: int) -> str:
    """A node's weight format in words ("q4 g32"; "q4 g32 f32 scales"; "float"), with its activations where
    they are not the graph's (`act_block`: int8 activations' block, 0 for float)."""
    fmt = weight_format(node)
    if fmt == "none":
        return "float"
    group = f" g{node.attrs['group_size']}" if SCHEMES[fmt].grouped else ""
    group += " f32 scales" if node.attrs.get("scale_dtype") == "float32" else ""
    block = node.attrs.get("act_block", 0)
    acts = "" if node.op != "linear" or block == act_block or fmt not in INTEGER_LEVELS else (
        " on int8 activations" if block else " on float activations")
    return f"{fmt}{group}{acts}"


def _kind(parts: list[str]) -> str:
    """What a stored weight is, by its parts: qkv, gate_up, o, down, experts, q_a (MLA's), ..."""
    fine = [tensor_classes(p)[0] for p in parts if tensor_classes(p) and tensor_classes(p)[0] in PROJECTIONS.values()]
    if len(fine) == len(parts):
        return ("" if set(fine) <= {"q", "k", "v"} else "_").join(fine)
    if tensor_classes(parts[0]) == ("experts",):
        return "experts"
    name = parts[0].split(".")
    return (name[-2] if name[-1] == "weight" else name[-1]).removesuffix("_proj")


def class_formats(graph: Graph, heads: set[str], routers: set[str], act_block: int) -> dict[str, str]:
    """Each kind of stored weight (embedding, lm_head, qkv, o, gate_up, down, experts, ...) -> the formats
    it got in `graph` (after quantisation) and in how many layers each where they differ ("q4 g32 ×17,
    q8 ×13"); MoE routers (producing `routers`) are left out: they stay float."""
    seen: dict[str, Counter] = {}

    def parts_of(weight: str) -> list[str]:
        """The checkpoint weights a stored one is made of (a quantised weight's source, a fused one's parts)."""
        param = graph.params.get(weight)
        name = ((param.recipe or {}) if param is not None else {}).get("of", weight)
        source = graph.params.get(name)        # absent for a plain weight the quantiser reads from the checkpoint
        return ((source.recipe or {}).get("concat") if source is not None else None) or [name]

    for node in graph.nodes:
        if node.op == "embed":
            kind = "embedding"
        elif node.op in ("linear", "moe_experts") and node.output not in routers:
            kind = "lm_head" if node.output in heads else _kind(
                parts_of(input_of(node, "weight" if node.op == "linear" else "gate_up")))
        else:
            continue
        seen.setdefault(kind, Counter())[_described(node, act_block)] += 1
    return {kind: ", ".join(text if len(counts) == 1 else f"{text} ×{n}" for text, n in counts.most_common())
            for kind, counts in seen.items()}
