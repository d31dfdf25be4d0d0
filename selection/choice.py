"""The kernel each step kind runs for one node, chosen from its target's order, and the record of it.

A node's choice is its `kernels` attribute: step kind -> kernel name, holding "mixed" (any step) and
only the steps whose kernel differs from the step it falls back to (STEP_FALLBACK): decode steps fall
back to mixed ones, wide decode steps (decode_mma_from sequences and up) to decode ones, prefill
steps (the graph's alternative forms) to mixed ones. passes/select_kernels.py records it; codegen,
the compiler's manifest and `kiln inspect` read it (`recorded`).
"""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.ir.ops import ATTENTION_OPS

from .attention import ATTENTION_KERNELS, AttentionSite
from .experts import EXPERT_KERNELS, expert_site
from .latent import LATENT_KERNELS
from .linear import GATE_ACTIVATIONS, LINEAR_KERNELS, gate_of, linear_site

STEP_FALLBACK = {"decode": "mixed", "decode_wide": "decode", "prefill": "mixed"}
LATENT_FAMILY_OPS = ("latent_append", "latent_attend")          # run the layer's family (per step kind)
EXPANDED_OPS = ("latent_gather", "expanded_attend")             # its expanded prefill form's
CHOSEN_OPS = (*ATTENTION_OPS, *LATENT_FAMILY_OPS, *EXPANDED_OPS, "linear", "moe_experts")


def steps_of(target) -> tuple[str, ...]:
    """The step kinds a target's artifact may build an entry for: wide decode steps where some
    decode steps run the prefill's tensor-core linears (decode_mma_from)."""
    return ("mixed", "decode", "prefill") + (("decode_wide",) if target.decode_mma_from else ())


def _resolved(kernels: dict[str, str], step: str) -> str:
    while step not in kernels:
        step = STEP_FALLBACK[step]
    return kernels[step]


def recorded(node, step: str) -> str:
    """The kernel recorded for `node` in steps of kind `step`."""
    kernels = node.attrs.get("kernels")
    if not kernels:
        raise KilnError(f"%{node.output} ({node.op}) has no kernel recorded: the select_kernels pass "
                        "(passes/select_kernels.py) runs before lowering")
    return _resolved(kernels, step)


def differs(node, step: str) -> bool:
    """Whether `node` runs another kernel in `step` steps than in the steps they fall back to."""
    return step in STEP_FALLBACK and bool(node.attrs.get("kernels")) and \
        recorded(node, step) != recorded(node, STEP_FALLBACK[step])


def _compact(kernels: dict[str, str]) -> dict[str, str]:
    """Only "mixed" and the steps whose kernel differs from their fallback's."""
    return {step: name for step, name in kernels.items()
            if step == "mixed" or name != _resolved(kernels, STEP_FALLBACK[step])}


def _attention(node, graph: Graph, target) -> dict[str, str]:
    spec = graph.kv_specs[node.attrs["layer"]]
    softcap = bool(node.attrs["softcap"])
    kernels = {}
    for step, order in target.kernels.attention.items():
        site = AttentionSite(node.op, spec, softcap, step)
        name = next((n for n in order if ATTENTION_KERNELS[n].supports(site)), None)
        if name is None:
            capped = " with soft-capped scores" if softcap else ""
            raise KilnError(f"target {target.name} has no attention kernel for {node.op}{capped} over a KV cache "
                            f"of {spec.describe()} in {step} steps (its kernels: {', '.join(order)})")
        kernels[step] = name
    return kernels


def _latent_family(node, graph: Graph, target, step: str = "mixed"):
    spec = graph.kv_specs[node.attrs["layer"]]
    for name in target.kernels.latent:
        if LATENT_KERNELS[name].supports(spec, step):
            return LATENT_KERNELS[name]
    raise KilnError(f"target {target.name} has no MLA attention kernel for a latent KV cache of {spec.describe()} "
                    f"(kernels: {', '.join(target.kernels.latent)})")


def _expanded(node, graph: Graph, target) -> str:
    family = _latent_family(node, graph, target)
    if family.expanded is None:
        raise KilnError(f"{node.op}: the expanded MLA prefill form has no {family.name} kernels (target "
                        f"{target.name}); compile with --mla-expanded-from 0 (absorbed in every step)")
    return family.expanded


def _linear(node, graph: Graph, target, types) -> dict[str, str]:
    def first(step, activation=None):
        site = linear_site(node, graph, target, types, step, activation)
        name = next((n for n in target.kernels.linear if LINEAR_KERNELS[n].supports(site)), None)
        if name is None:
            raise KilnError(f"target {target.name} has no linear kernel for %{node.output} ({site.n_out}x{site.n_in}, "
                            f"{site.dtype}, weights {site.fmt.kind} as {site.layout}) in {step} steps")
        return name
    mixed = first("mixed")
    gate = gate_of(node, graph) if LINEAR_KERNELS[mixed].applies_gate else None
    activation = GATE_ACTIVATIONS.get(gate)
    return {step: mixed if step == "mixed" else first(step, activation) for step in steps_of(target)}


def _experts(node, graph: Graph, target, types) -> str:
    site = expert_site(node, graph, target, types)
    return next(n for n in target.kernels.experts if EXPERT_KERNELS[n].supports(site))


def choose(node, graph: Graph, target, types: dict) -> dict[str, str] | None:
    """The kernels `node` runs on `target` by step kind (compact, as recorded), or None for an op
    without a choice. `types`: the graph's value types."""
    if node.op in ATTENTION_OPS:
        kernels = _attention(node, graph, target)
    elif node.op in LATENT_FAMILY_OPS:
        kernels = {step: _latent_family(node, graph, target, step).name for step in ("mixed", "decode")}
    elif node.op in EXPANDED_OPS:
        kernels = {"mixed": _expanded(node, graph, target)}
    elif node.op == "linear":
        kernels = _linear(node, graph, target, types)
    elif node.op == "moe_experts":
        kernels = {"mixed": _experts(node, graph, target, types)}
    else:
        return None
    return _compact(kernels)


def gated_activation(node, graph: Graph) -> str | None:
    """The activation a linear's recorded kernel applies after it (its weight then stored 'gated', gate
    and up rows interleaved): where the kernel of its mixed steps applies the gated op that alone
    reads its output (selection/linear.py gate_of)."""
    if node.op != "linear" or not LINEAR_KERNELS[recorded(node, "mixed")].applies_gate:
        return None
    return GATE_ACTIVATIONS.get(gate_of(node, graph))
