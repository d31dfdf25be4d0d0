"""quantize: projections read int8 weights with per-channel scales (weight-only quantisation).

Rewrite (mode q8; fp8 likewise; q4 adds {group_size}, with u8 packed nibbles and f16 group scales (f32 and
{scale_dtype='float32'} with `scale_dtype`, where a file's float32 scales are kept exactly); q8g
too, with int8 levels; q4a too, with group minimums; q4k with super-blocks, q4a where they do not divide a
weight's inputs, as llama.cpp gives such a Q4_K tensor another type; MoE experts of a q8g model are q8,
of a q4a or q4k one q4):
    %y = linear(%x, @w[, _, @b][, %r])
  ->
    %y = linear(%x, @w.q8, @w.q8_scale[, @b][, %r]) {format='q8'}
        @w.q8 = q8.q(@w)   @w.q8_scale = q8.scale(@w)      (computed once, when weights are written)
    %y = moe_experts(%x, %routing, @gate_up, _, @down)
  ->
    %y = moe_experts(%x, %routing, @gate_up.q8, @gate_up.q8_scale, @down.q8, @down.q8_scale) {format='q8'}
        each expert quantised on its own, as a linear weight would be
With act_block > 0 (the target's choice), q8/q4 linears get {act_block}: their input rows are
quantised to int8 in blocks of act_block inputs and multiplied in integer dot products (ir/ops.py
gives the numerics); MoE experts keep float activations, as do the linears of weights named in
`float_activations` (a fused weight where any of its parts is: calibration measured int8 too coarse).
A weight of a tensor class named in `class_modes` (--tensor-quant: its projection, as q or down, before
its group, as attention or mlp) takes that scheme, or stays float for "none"; else a weight named in
`tensor_modes` its own (a GGUF file's tensors of another type); else, with `more_bits` (a 4-bit
policy), the v and down projections of the layers llama.cpp's Q4_K_M gives more bits
(tensor_classes.more_bits_layers) take that scheme. A fused weight takes the finest of its parts'.
Refuses (KilnError naming it): a grouped scheme for a weight whose inputs its groups do not divide.
Requires: the weight is a param (plain or fused); the LM head (the linear producing the graph's
  logits) only when `lm_head` is set, in `lm_head_mode` where that is given. MoE routers (linears
  feeding moe_router) stay in float, as llama.cpp keeps them: a rounding there changes which experts
  run. MLA's kv_b_proj in the expanded form (feeding expanded_attend) stays in float, as its absorbed
  halves do, so that both forms compute one function. Embedding tables are left to quantize_embedding.
Leaves: %y keeps its name and type; the float weight param is dropped once no node reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.errors import KilnError
from kiln.ir import Graph, IRError, Param, TensorType, attrs_for, input_of, named_inputs, weight_format
from kiln.ir.quant import INTEGER_LEVELS, SCHEMES

from .graph_pass import GraphPass
from .rewrite import drop_unused_params
from .tensor_classes import MORE_BITS_CLASSES, layer_of, more_bits_layers, tensor_classes

SUPER_BLOCK_FALLBACK = {"q4k": "q4a"}     # the scheme of a weight whose inputs a scheme's super-blocks do not divide


def add_quantized_params(graph: Graph, w: Param, mode: str, group_size: int, scale_dtype: str = "") -> tuple[str, str]:
    """Declare the params holding `w` [out, in] (or experts [E, out, in]) quantised with `mode`: @w.<mode> and @w.<mode>_scale,
    made from @w by recipe when weights are written (the scale table in `scale_dtype` where given).
    Declared once: a table that is both an LM head and an embedding (tied) gets one pair, which both ops read."""
    scheme = SCHEMES[mode]
    experts = w.type.shape[:-2]
    shapes = {part: experts + shape for part, shape in scheme.part_shapes(*w.type.shape[-2:], group_size).items()}
    names = {"q": f"{w.name}.{mode}", "scale": f"{w.name}.{mode}_scale"}
    dtypes = {"q": scheme.weight_dtype, "scale": scale_dtype or scheme.scale_dtype}
    for part, name in names.items():
        recipe = {"quantize": mode, "of": w.name, "part": part}
        if scheme.grouped:
            recipe["group_size"] = group_size
        param = graph.params.setdefault(name, Param(name, TensorType(shapes[part], dtypes[part]), recipe))
        if param.recipe != recipe:
            raise IRError(f"param @{name} is already made by {param.recipe}, not {recipe}")
    return names["q"], names["scale"]


@dataclass(frozen=True)
class Quantize(GraphPass):
    name: ClassVar[str] = "quantize"
    mode: str = "q8"
    lm_head: bool = True
    group_size: int = 32          # q4 only: inputs per scale
    act_block: int = 0            # q8/q4 linears: > 0 quantises x to int8 in blocks of this many inputs
    float_activations: tuple[str, ...] = ()   # weights whose linears keep float activations all the same
    lm_head_mode: str | None = None   # the LM head's scheme where it is not `mode` (a GGUF file's own head's)
    tensor_modes: tuple[tuple[str, str], ...] = ()   # (weight, scheme) where it is not `mode`
    class_modes: tuple[tuple[str, str], ...] = ()    # (tensor class, scheme or "none"), before tensor_modes
    more_bits: str | None = None  # the scheme of v and down in tensor_classes.more_bits_layers (4-bit policy)
    scale_dtype: str = ""         # "float32": linears' float16 scale tables (q4, q8g, q4a) in float32, as a file
    #                               whose float32 scales are kept exactly has them

    def __post_init__(self):
        for mode in (self.mode, self.lm_head_mode or self.mode, *(m for _, m in self.tensor_modes),
                     *(m for _, m in self.class_modes if m != "none"), self.more_bits or self.mode):
            if mode not in SCHEMES:
                raise ValueError(f"unknown quantisation mode {mode!r} (known: {', '.join(SCHEMES)})")

    @staticmethod
    def _linears_feeding(graph: Graph, values: list[str]) -> set[str]:
        """The linears whose results become `values` (through casts and soft-capping only: Gemma 2's
        head caps its logits)."""
        producers = {n.output: n for n in graph.nodes}
        heads, todo = set(), list(values)
        while todo:
            node = producers.get(todo.pop())
            if node is None:
                continue
            if node.op in ("cast", "softcap"):
                todo.append(input_of(node, "x"))
            elif node.op == "linear":
                heads.add(node.output)
        return heads

    def rewrite(self, graph: Graph) -> Graph:
        skip = self._linears_feeding(graph, [input_of(n, "logits") for n in graph.nodes if n.op == "moe_router"])
        skip |= self._linears_feeding(graph, [input_of(n, "kv") for n in graph.nodes if n.op == "expanded_attend"])
        heads = self._linears_feeding(graph, graph.outputs)
        layers = {layer_of(name) for name in graph.params} - {None}
        more = more_bits_layers(max(layers) + 1) if self.more_bits and layers else set()
        if not self.lm_head:
            skip |= heads
        for node in graph.nodes:
            if weight_format(node) != "none":
                continue
            if node.op == "moe_experts":
                self._quantize_experts(graph, node)
            if node.op != "linear" or node.output in skip or input_of(node, "weight") not in graph.params:
                continue
            w = graph.params[input_of(node, "weight")]
            mode = self.lm_head_mode if self.lm_head_mode and node.output in heads else self._mode_of(w, more)
            if mode == "none":
                continue
            if not SCHEMES[mode].holds(w.type.shape[1], self.group_size) and mode in SUPER_BLOCK_FALLBACK:
                mode = SUPER_BLOCK_FALLBACK[mode]
            grouped = SCHEMES[mode].grouped
            self._check_groups(w, mode, "the LM head" if node.output in heads else None)
            wide = self.scale_dtype if SCHEMES[mode].scale_dtype == "float16" else ""
            q, scale = add_quantized_params(graph, w, mode, self.group_size, wide)
            node.inputs = named_inputs("linear", x=input_of(node, "x"), weight=q, scale=scale,
                                       bias=input_of(node, "bias"), residual=input_of(node, "residual"))
            node.attrs = attrs_for("linear", format=mode, **({"group_size": self.group_size} if grouped else {}),
                                   act_block=self.act_block if mode in INTEGER_LEVELS
                                   and self._int8_activations(w, mode) else 0, scale_dtype=wide)
        return drop_unused_params(graph)

    def _mode_of(self, w: Param, more_layers: set[int]) -> str:
        """The scheme of weight `w` ("none": float): its class's (class_modes), its own (tensor_modes),
        more_bits for a v or down projection in `more_layers`, or `mode`; a fused weight (qkv, gate/up)
        takes the finest among its parts' (float before 8 bits before 4), so that no part is stored
        coarser than it was asked for."""
        modes, classes = dict(self.tensor_modes), dict(self.class_modes)

        def own(part: str) -> str:
            chosen = next((classes[c] for c in tensor_classes(part) if c in classes), None)
            if chosen or part in modes:
                return chosen or modes[part]
            projection = tensor_classes(part)[0] if tensor_classes(part) else None
            more = layer_of(part) in more_layers and projection in MORE_BITS_CLASSES
            return self.more_bits if more else self.mode
        parts = (w.recipe or {}).get("concat", [w.name])
        return max(map(own, parts), key=lambda mode: 16 if mode == "none" else 8 // SCHEMES[mode].per_byte)

    def _check_groups(self, w: Param, mode: str, role: str | None = None) -> None:
        """Refuse a grouped scheme for a weight whose input width the groups do not divide."""
        width = w.type.shape[-1]
        if SCHEMES[mode].holds(width, self.group_size):
            return
        parts = (w.recipe or {}).get("concat", [w.name])
        cls = "lm_head" if role else (tensor_classes(parts[0]) or ("its class",))[0]
        raise KilnError(f"{mode} in groups of {self.group_size} cannot hold {role or w.name}: its {width} inputs are "
                        f"not a multiple of {self.group_size} (use --group-size 32, or --tensor-quant {cls}=q8 "
                        f"or {cls}=none for it)")

    def _int8_activations(self, w: Param, mode: str) -> bool:
        """Whether a q8/q4 linear of weight `w` takes int8 activations (blocks dividing its width and, for
        q4, its groups; none of its parts in float_activations)."""
        parts = (w.recipe or {}).get("concat", [w.name])
        return (self.act_block > 0 and w.type.shape[1] % self.act_block == 0
                and (not SCHEMES[mode].grouped or self.group_size % self.act_block == 0)
                and not set(parts) & set(self.float_activations))

    def _quantize_experts(self, graph: Graph, node) -> None:
        mode = dict(self.class_modes).get("experts", self.mode)
        if mode == "none":
            return
        mode = {"q8g": "q8", "q4a": "q4", "q4k": "q4"}.get(mode, mode)   # the expert kernels read q4's groups only
        gate_up, down = (graph.params[input_of(node, name)] for name in ("gate_up", "down"))
        for w in (gate_up, down):
            self._check_groups(w, mode)
        (gate_up_q, gate_up_scale), (down_q, down_scale) = (add_quantized_params(graph, w, mode, self.group_size)
                                                            for w in (gate_up, down))
        node.inputs = named_inputs("moe_experts", x=input_of(node, "x"), routing=input_of(node, "routing"),
                                   gate_up=gate_up_q, gate_up_scale=gate_up_scale, down=down_q, down_scale=down_scale)
        node.attrs = {**node.attrs, "format": mode,
                      **({"group_size": self.group_size} if SCHEMES[mode].grouped else {})}
