"""FlashInfer in a graph (the `flashinfer` attention kernel, selection/attention.py, and the
`flashinfer_mla` latent one, selection/latent.py): the one variant its layers need, the step inputs it
adds, and their emitters.

FlashInfer plans a step on the host before the step's launches (runtime/flashinfer_plan.py): each
entry of an artifact that runs it takes, besides the graph's inputs, a float workspace, and per
distinct sliding window of its layers (0: full attention) an int workspace and the plan the runtime
made in it. Every entry takes the same inputs; the decode entries leave them unread.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

from kiln.errors import KilnError
from kiln.ir import input_of
from kiln.ir.ops import ATTENTION_OPS
from kiln.ir.step_forms import for_step
from kiln.selection.choice import recorded

from ..kernels import tvm_kernels
from ..kernels.gpu.flashinfer import FLASHINFER_RELEASE, FlashInferVariant

FLOAT_WORKSPACE = "flashinfer_float_workspace"
FLOAT_WORKSPACE_BYTES = 256 << 20       # FlashInfer's split-KV partial outputs; its plan refuses a step that needs more
INT_WORKSPACE_BYTES = 8 << 20           # the plan's schedule (and its pinned host copy)


def plan_input(window: int) -> str:
    return f"flashinfer_plan_w{window}"


def int_workspace_input(window: int) -> str:
    return f"flashinfer_int_workspace_w{window}"


@dataclass(frozen=True)
class FlashInferUse:
    variant: FlashInferVariant
    windows: tuple[int, ...]        # the distinct windows of its layers (0: full attention)
    q_heads: int
    kv_heads: int

    def inputs(self) -> dict[str, tuple[tuple, str]]:
        """The step inputs it adds: name -> (shape, dtype), symbolic lengths by name."""
        inputs = {FLOAT_WORKSPACE: (("flashinfer_float_bytes",), "uint8")}
        for w in self.windows:
            inputs[int_workspace_input(w)] = (("flashinfer_int_bytes",), "uint8")
            inputs[plan_input(w)] = (("flashinfer_plan_len",), "int64")
        return inputs

    def manifest(self) -> dict:
        """What the runtime needs to plan (the manifest's `flashinfer`)."""
        v = self.variant
        return {"release": FLASHINFER_RELEASE, "kind": v.kind, "variant": v.name, "dtype": v.dtype,
                "head_dim": v.head_dim,
                "q_heads": self.q_heads, "kv_heads": self.kv_heads,
                "float_workspace": {"input": FLOAT_WORKSPACE, "bytes": FLOAT_WORKSPACE_BYTES},
                "plans": [{"input": plan_input(w), "int_workspace": int_workspace_input(w),
                           "int_workspace_bytes": INT_WORKSPACE_BYTES, "window_left": w - 1 if w else -1}
                          for w in self.windows]}


def flashinfer_use(graph, steps) -> FlashInferUse | None:
    """The variant the graph's FlashInfer layers need (in the entries of `steps`), or None without any.
    One build serves an artifact, so its layers must agree on kind, dtype, head dims and head counts."""
    types = graph.value_types()
    shapes, windows, softcap = set(), set(), False
    for step in steps:
        for n in for_step(graph, step)[0]:
            spec = graph.kv_specs[n.attrs["layer"]] if "layer" in n.attrs else None
            if n.op in ATTENTION_OPS and recorded(n, step) == "flashinfer":
                q_heads = int(types[input_of(n, "q")].shape[1])
                shapes.add(("prefill", spec.dtype, spec.head_dim, 0, q_heads, spec.kv_heads))
                windows.add(int(n.attrs["window"]))
                softcap = softcap or bool(n.attrs["softcap"])
            elif n.op == "latent_attend" and recorded(n, step) == "flashinfer_mla":
                q_heads = int(types[input_of(n, "q_latent")].shape[1])
                shapes.add(("mla", spec.dtype, spec.v_head_dim, spec.k_head_dim - spec.v_head_dim, q_heads, 1))
                windows.add(0)
    if not shapes:
        return None
    if len(shapes) > 1:
        raise KilnError(f"--attention flashinfer builds one FlashInfer variant an artifact, and these layers need "
                        f"several (kind, dtype, head dim, rope, q heads, KV heads): {sorted(shapes)}; compile with "
                        f"--attention builtin")
    (kind, dtype, head_dim, rope, q_heads, kv_heads), = shapes
    windows = tuple(sorted(windows))
    variant = FlashInferVariant(kind, dtype, head_dim, rope, window=windows != (0,), softcap=softcap)
    return FlashInferUse(variant, windows, q_heads, kv_heads)


def emit_flashinfer(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len,
                    kv_scales):
    """TVM's append of the step's K/V rows, then FlashInfer's causal attention over the pages through
    kiln's binding (destination-passing: the output is allocated by the graph)."""
    spec = ctx.kv_spec(node)
    append = ctx.add_kernel(tvm_kernels.kv_append(spec.kv_heads, spec.head_dim, node.type.dtype, spec.page_size),
                            "kv_append")
    pages = ctx.bb.emit(relax.call_tir_inplace(append, [pages, k, v, slots], [0], pages.ty))
    a, window = node.attrs, int(node.attrs["window"])
    args = [q, pages, q_indptr, page_indptr, page_values, last_page_len, ctx.input(FLOAT_WORKSPACE),
            ctx.input(int_workspace_input(window)), ctx.input(plan_input(window)),
            relax.prim_value(tvm.tirx.IntImm("int64", window - 1 if window else -1)),
            relax.prim_value(tvm.tirx.FloatImm("float64", float(a["softcap"] or 0.0))),
            relax.prim_value(tvm.tirx.FloatImm("float64", float(a["scale"])))]
    return ctx.bb.emit(relax.call_dps_packed("kiln_flashinfer_attend", args, relax.TensorType(q.ty.shape, q.ty.dtype)))


def emit_flashinfer_mla(ctx, node, q_latent, q_rope, pages, q_indptr, page_indptr, page_values, last_page_len,
                        scales):
    """FlashInfer's causal MLA attention over the latent pages (after TVM's append, which the
    latent family's append emits), through kiln's MLA binding."""
    args = [q_latent, q_rope, pages, page_values, ctx.input(FLOAT_WORKSPACE), ctx.input(int_workspace_input(0)),
            ctx.input(plan_input(0)), relax.prim_value(tvm.tirx.FloatImm("float64", float(node.attrs["scale"])))]
    return ctx.bb.emit(relax.call_dps_packed("kiln_flashinfer_attend", args,
                                             relax.TensorType(q_latent.ty.shape, q_latent.ty.dtype)))
