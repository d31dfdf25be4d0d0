"""Lower an IR graph to a TVM IRModule with one Relax function per step kind.

`forward` runs any step; `decode` runs steps of one new token per sequence and `decode_wide` those
of many (target.decode_mma_from and up), each emitted only where some node's recorded kernel for it
differs (select_kernels, selection/choice.py); `prefill` runs the graph's alternative forms
(ir/step_forms.py) and is emitted where it has some. Every entry runs the graph's nodes for its step
kind (`for_step`), each node with the kernel recorded for that step.
Both take the graph's inputs (in order) followed by the stored weights (in `LoweredModel.weights`
order) and return the graph's output. Weight layouts are chosen here, from the target, so the
artifact stores each weight the way its kernel reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.utils import copy_with_new_vars

from kiln.errors import KilnError
from kiln.interface import GRAPH_ENTRY, WIDE_GRAPH_ENTRY, KVSpec, StoredWeight
from kiln.ir import Graph
from kiln.ir.opdef import input_of
from kiln.ir.ops import OPS, weight_format
from kiln.ir.step_forms import for_step, prefill_min_tokens
from kiln.selection.choice import differs, gated_activation, recorded
from kiln.selection.experts import expert_layout
from kiln.selection.formats import WeightFormat
from kiln.selection.layouts import GATED, GATED_COLUMNS, Q4_ZEROS, Q4_ZEROS_GATED, group_scale_layout, stored_shape
from kiln.selection.linear import target_layout

from .kernels.cpu.bf16_micro import micro_module
from .kernels.cpu.tile_micro import tile_module
from .kernels.gpu import flashinfer, hopper_gemm
from .lowering import elementwise, lora, mla, moe
from .lowering.attention import emit_paged_attention, emit_paged_attention_fused
from .lowering.embed import emit_embed
from .lowering.flashinfer import flashinfer_use
from .lowering.linear import emit_linear

ENTRY_NAMES = {"mixed": "forward", "decode": "decode", "prefill": "prefill",     # step kind -> Relax function
               "decode_wide": "decode_wide"}


@dataclass
class LoweredModel:
    module: tvm.IRModule
    inputs: list[str]
    weights: list[StoredWeight] = field(default_factory=list)
    entries: dict[str, str] = field(default_factory=lambda: {"mixed": "forward"})
    flashinfer: dict | None = None      # what the runtime needs to plan FlashInfer's steps (lowering/flashinfer.py)
    hopper_gemms: tuple[str, ...] = ()  # CUTLASS's Hopper GEMM variants linked in (kernels/gpu/hopper_gemm.py)

    @property
    def links_cuda_objects(self) -> bool:
        """Whether objects built with nvcc are linked in: they call CUDA's runtime library."""
        return bool(self.flashinfer or self.hopper_gemms)


class _Context:
    """What an op lowering may use while one entry function is built: the block builder, the step
    kind, symbolic dims, weights, and the kernels (shared by every entry)."""

    def __init__(self, graph: Graph, target, bb: relax.BlockBuilder, step: str, kernels: dict, micro_kernels: set,
                 tile_kernels: set, hopper_gemms: set):
        self.graph, self.target, self.bb, self.step = graph, target, bb, step
        self.types = graph.value_types()
        self.dims: dict[str, tirx.Var] = {}
        self.inputs: dict[str, relax.Var] = {}
        self.weights: dict[tuple[str, str], tuple[StoredWeight, relax.Var]] = {}
        self.kernels = kernels
        # a gated MLP's gate/up linear stored 'gated' -> "fused" (its kernel applied the activation)
        # or "interleaved" (its gate and up columns alternate)
        self.gated: dict[str, str] = {}
        self.micro_kernels = micro_kernels     # (rows, vectors) of the bf16 micro-kernels kernels call
        self.tile_kernels = tile_kernels       # the AMX micro-kernels they call (codegen/kernels/cpu/tile_micro.py)
        self.hopper_gemms = hopper_gemms       # the Hopper GEMM variants linears call

    def shape(self, dims) -> list:
        return [self.dims.setdefault(d, tirx.Var(d, "int64")) if isinstance(d, str) else d for d in dims]

    def input(self, name: str) -> relax.Var:
        return self.inputs[name]

    def weight(self, param: str, layout: str) -> relax.Var:
        """The forward parameter holding `param` stored in `layout` (created once, in plan order)."""
        key = (param, layout)
        if key not in self.weights:
            ty = self.graph.params[param].type
            shape = stored_shape(layout, ty.shape)
            name = param if layout == "nk" else f"{param}@{layout}"
            var = relax.Var(name, relax.TensorType(shape, ty.dtype))
            self.weights[key] = (StoredWeight(name, param, layout, shape, ty.dtype), var)
        return self.weights[key][1]

    def kv_spec(self, node) -> KVSpec:
        """How the KV cache of the layer `node` names (its `layer` attribute) is stored."""
        return self.graph.kv_specs[node.attrs["layer"]]

    def layout(self, node, pos: int) -> str:
        """The stored layout of the param at input `pos` of `node`."""
        return _layout_for(node, pos, self.graph, self.target)

    def add_kernel(self, func: tirx.PrimFunc, name: str, scheduled: bool = False) -> tvm.ir.GlobalVar:
        """Add a hand-written kernel once per name; it is opaque to fusion (op_pattern 8)."""
        func = func.with_attr("global_symbol", name).with_attr("op_pattern", 8)
        if scheduled:
            func = func.with_attr("tirx.is_scheduled", True)
        if name in self.kernels:
            # map_free_vars: TVM's decode kernel factory leaves a free variable, new on each call
            if not tvm_ffi.structural_equal(self.bb.get()[self.kernels[name]], func, map_free_vars=True):
                raise KilnError(f"two different kernels want the name {name!r}")
            return self.kernels[name]
        self.kernels[name] = self.bb.add_func(func, name)
        return self.kernels[name]


def _emit_linear(ctx, node, x, w, scale=None, bias=None, residual=None):
    """linear(x, weight[, scale][, bias][, residual]), the weight in any format, with its recorded kernel."""
    n_out = node.type.shape[-1]
    n_in = ctx.types[input_of(node, "x")].shape[-1]
    layout = _layout_for(node, 1, ctx.graph, ctx.target)
    activation = gated_activation(node, ctx.graph)
    kernel = recorded(node, ctx.step)
    zeros = ctx.weight(*_zeros(node, ctx.graph)) if kernel == "wgmma" and _reads_zeros(node) else None
    y = emit_linear(ctx, kernel, x, w, scale, bias, residual, layout, n_out, n_in, node.type.dtype,
                    WeightFormat.of(node), activation, zeros)
    if activation:
        ctx.gated[node.output] = "fused" if int(y.ty.shape[-1]) == n_out // 2 else "interleaved"
    return y


def _emit_embed(ctx, node, ids, table, scale=None):
    """embed(ids, table[, scale]), the table in any format and its stored layout."""
    fmt = WeightFormat.of(node)

    def stored(pos):            # a table or scale the graph computes (not a param) is 'nk'
        return _layout_for(node, pos, ctx.graph, ctx.target) if node.inputs[pos] in ctx.graph.params else "nk"
    layout, scale_layout = stored(1), stored(2) if scale is not None else "nk"
    vocab = ctx.types[input_of(node, "table")].shape[0]
    return emit_embed(ctx, ids, table, scale, layout, vocab, node.type.shape[1], node.type.dtype, fmt, scale_layout)


LOWERINGS = {
    "add": elementwise.emit_add,
    "mul": elementwise.emit_mul,
    "silu": elementwise.emit_silu,
    "cast": elementwise.emit_cast,
    "reshape": elementwise.emit_reshape,
    "slice": elementwise.emit_slice,
    "swiglu": elementwise.emit_gated,
    "geglu": elementwise.emit_gated,
    "gelu_tanh": elementwise.emit_gelu_tanh,
    "mul_scalar": elementwise.emit_mul_scalar,
    "softcap": elementwise.emit_softcap,
    "embed": _emit_embed,
    "take_rows": elementwise.emit_take_rows,
    "rms_norm": elementwise.emit_rms_norm,
    "qk_norm": elementwise.emit_qk_norm,
    "rope": elementwise.emit_rope,
    "linear": _emit_linear,
    "moe_router": moe.emit_moe_router,
    "moe_experts": moe.emit_moe_experts,
    "sigmoid_gate": elementwise.emit_sigmoid_gate,
    "paged_attention": emit_paged_attention,
    "paged_attention_fused": emit_paged_attention_fused,
    "latent_append": mla.emit_latent_append,
    "latent_attend": mla.emit_latent_attend,
    "head_linear": mla.emit_head_linear,
    "latent_gather": mla.emit_latent_gather,
    "expanded_attend": mla.emit_expanded_attend,
    "lora": lora.emit_lora,
}


def _layout_for(node, pos: int, graph: Graph, target) -> str:
    """The stored layout of the param at input `pos` of `node`: linear weights take the target's, and
    the group scales of q4 weights in byte quads (the VNNI kernel) are stored by weight panel; an
    embedding table that is also a linear weight (tied to the LM head) takes that layout too, and
    its scales the head's, so each is stored once; other tables stay 'nk' (rows contiguous)."""
    name = node.inputs[pos]
    if pos in (1, 2) and gated_activation(node, graph):
        return GATED if pos == 1 else GATED_COLUMNS              # gate and up interleaved
    role = OPS[node.op].inputs[pos].rstrip("?")
    if node.op == "moe_experts" and role in ("gate_up", "down"):
        return expert_layout(target, graph.params[name].type.shape)
    if node.op == "linear" and role == "weight":
        return target_layout(node, graph, target)
    if node.op == "linear" and role == "scale" and WeightFormat.of(node).grouped:
        return group_scale_layout(_layout_for(node, 1, graph, target), node.attrs.get("act_block", 0))
    if node.op == "embed" and role in ("table", "scale"):
        head = next((n for n in graph.nodes if n.op == "linear" and input_of(n, "weight") == input_of(node, "table")),
                    None)
        if head is not None and (pos == 1 or input_of(head, "scale") == name):
            return _layout_for(head, pos, graph, target)
    return "nk"


def _reads_zeros(node) -> bool:
    """A q4 linear that some step runs on the Hopper GEMM: it reads its scales a second time, times
    -8, as CUTLASS's zeros (selection/layouts.py Q4_ZEROS)."""
    return (node.op == "linear" and weight_format(node) == "q4" and "wgmma" in node.attrs.get("kernels", {}).values()
            and input_of(node, "scale") is not None)


def _zeros(node, graph: Graph) -> tuple[str, str]:
    """(param, layout) of a q4 linear's zeros: its scales times -8, in the order of its scales' columns."""
    return input_of(node, "scale"), Q4_ZEROS_GATED if gated_activation(node, graph) else Q4_ZEROS


def _weight_layouts(graph: Graph, target) -> list[tuple[str, str]]:
    """(param, layout) pairs in first-use order."""
    plan: list[tuple[str, str]] = []
    for node in graph.nodes:
        uses = [(name, _layout_for(node, pos, graph, target)) for pos, name in enumerate(node.inputs)]
        uses += [_zeros(node, graph)] if _reads_zeros(node) else []
        for use in uses:
            if use[0] in graph.params and use not in plan:
                plan.append(use)
    return plan


def entry_steps(graph: Graph) -> list[str]:
    """Step kinds that get their own function: "mixed" always; "decode" where some node's recorded
    decode kernel differs from its mixed one; "decode" and "decode_wide" where some node's wide decode
    kernel differs from its decode one; "prefill" where the graph has alternative forms."""
    decode, wide = (any(differs(n, step) for n in graph.nodes) for step in ("decode", "decode_wide"))
    return (["mixed"] + (["decode"] if decode or wide else []) + (["decode_wide"] if wide else [])
            + (["prefill"] if prefill_min_tokens(graph) else []))


def _emit_entry(ctx: _Context, name: str, extra_inputs: dict) -> None:
    graph, bb = ctx.graph, ctx.bb
    for input_name, ty in graph.inputs.items():
        ctx.inputs[input_name] = relax.Var(input_name, relax.TensorType(ctx.shape(ty.shape), ty.dtype))
    for input_name, (shape, dtype) in extra_inputs.items():
        ctx.inputs[input_name] = relax.Var(input_name, relax.TensorType(ctx.shape(shape), dtype))
    weight_vars = [ctx.weight(param, layout) for param, layout in _weight_layouts(graph, ctx.target)]
    nodes, outputs = for_step(graph, ctx.step)      # "decode_wide" runs the decode step's nodes
    with bb.function(name, list(ctx.inputs.values()) + weight_vars):
        with bb.dataflow():
            env: dict = dict(ctx.inputs)
            for node in nodes:
                args = [None if i is None else env[i] if i in env else
                        ctx.weight(i, _layout_for(node, pos, graph, ctx.target)) for pos, i in enumerate(node.inputs)]
                while args and args[-1] is None:
                    args.pop()
                env[node.output] = LOWERINGS[node.op](ctx, node, *args)
            out = bb.emit_output(env[outputs[0]])
        bb.emit_func_output(out)


def lower_graph(graph: Graph, target) -> LoweredModel:
    entries = {step: ENTRY_NAMES[step] for step in entry_steps(graph)}
    ops = {n.op for step in entries for n in for_step(graph, step)[0]}
    missing = sorted(ops - set(LOWERINGS))
    if missing:
        raise KilnError(f"no {target.name} lowering for op(s): {', '.join(missing)}")
    bb = relax.BlockBuilder()
    kernels: dict[str, tvm.ir.GlobalVar] = {}
    micro_kernels: set[tuple[int, int]] = set()
    tile_kernels: set[tuple] = set()
    hopper_gemms: set = set()
    fi_use = flashinfer_use(graph, entries)
    extra_inputs = fi_use.inputs() if fi_use else {}
    for step, name in entries.items():
        ctx = _Context(graph, target, bb, step, kernels, micro_kernels, tile_kernels, hopper_gemms)
        _emit_entry(ctx, name, extra_inputs)
    module = bb.get()
    external = []
    if micro_kernels:
        # LLVM IR kiln writes itself (codegen/kernels/cpu/bf16_micro.py): the Relax build links it into the library
        external.append(micro_module(sorted(micro_kernels), target.tvm_target()))
    if tile_kernels:        # and the AMX ones (codegen/kernels/cpu/tile_micro.py), with kiln_tiles_ready
        external.append(tile_module(sorted(tile_kernels), target.tvm_target(), target.tiles == "emulated"))
    if fi_use:
        external += flashinfer.static_libraries(fi_use.variant, target.arch)
    if hopper_gemms:
        external += hopper_gemm.static_libraries(hopper_gemms)
    if external:
        module = module.with_attr("external_mods", external)
    if target.graph_batches:
        # the decode-step function again (a copy with fresh variables), marked for capture
        decode = module[entries.get("decode", "forward")]
        module[GRAPH_ENTRY] = _graph_attrs(copy_with_new_vars(decode), max(target.graph_batches), GRAPH_ENTRY)
        entries[GRAPH_ENTRY] = GRAPH_ENTRY
        if "decode_wide" in entries:
            wide = copy_with_new_vars(module["decode_wide"])
            module[WIDE_GRAPH_ENTRY] = _graph_attrs(wide, max(target.graph_batches), WIDE_GRAPH_ENTRY)
            entries[WIDE_GRAPH_ENTRY] = WIDE_GRAPH_ENTRY
    return LoweredModel(module, list(graph.inputs) + list(extra_inputs), [w for w, _ in ctx.weights.values()], entries,
                        fi_use.manifest() if fi_use else None, tuple(sorted(v.name for v in hopper_gemms)))




def _graph_attrs(func: relax.Function, max_batch: int, name: str) -> relax.Function:
    """Mark a decode function for TVM's RewriteCUDAGraph: every parameter stays at one address
    (num_input 0: the runtime passes persistent buffers, padded to a batch bucket), so the kernels
    between its inputs and its output are captured, one graph per bucket; intermediate storage is
    planned for the largest bucket. In a decode step tokens, sequences and logit rows are one
    count; `seqs1` is that count plus one."""
    bounds = {"tokens": max_batch, "seqs": max_batch, "rows": max_batch, "seqs1": max_batch + 1}
    return func.with_attrs({"global_symbol": name, "num_input": 0, "tir_var_upper_bound": bounds,
                            "relax.rewrite_cuda_graph.capture_symbolic_vars": list(bounds)})
