"""The pass manager and the pipeline: passes run in order, the graph is verified after each.

`pipeline_for` lists the phases; `run_pipeline` runs them, times them and
hands the graph after each to `dump` (for --print-after-all, --print-after and
KILN_DUMP=dir).
"""
from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kiln.errors import KilnError
from kiln.ir import Graph, print_graph, verify
from kiln.options import CompileOptions
from kiln.targets import target_defaults

from .add_lora import AddLoRA
from .fuse_append_attend import FuseAppendAttend
from .fuse_gate_up import FuseGateUp
from .fuse_qkv import FuseQKV
from .fuse_residual_add import FuseResidualAdd
from .fuse_rope_attention import FuseRopeAttention
from .graph_pass import GraphPass
from .quantize import Quantize
from .quantize_embedding import QuantizeEmbedding
from .quantize_kv import QuantizeKV
from .raise_patterns import RaisePatterns
from .select_kernels import SelectKernels
from .specialize_mla import SpecializeMLA


@dataclass
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    ops: dict[str, int] = field(default_factory=dict)     # op -> how many more (or fewer) nodes run it
    rewritten: int = 0         # nodes new or changed (inputs, attributes), params added or dropped included

    @property
    def changed(self) -> bool:
        return bool(self.ops or self.rewritten)


def _signatures(graph: Graph) -> Counter:
    """Each node and param as a hashable value: what a pass's record compares."""
    nodes = Counter((n.op, tuple(n.inputs), repr(sorted(n.attrs.items())), n.output) for n in graph.nodes)
    return nodes + Counter(("param", name, repr(p.type)) for name, p in graph.params.items())


def _record(name: str, seconds: float, signatures: Counter, after: Graph) -> tuple[PassRecord, Counter]:
    """The pass's record (its op counts' changes, nodes rewritten) and the graph's signatures after it.
    From the signatures taken before the pass: a pass may have edited the graph in place."""
    def op_counts(sigs: Counter) -> Counter:
        counts = Counter()
        for sig, count in sigs.items():
            if sig[0] != "param":
                counts[sig[0]] += count
        return counts
    now = _signatures(after)
    ops, was = op_counts(now), op_counts(signatures)
    ops.subtract(was)
    record = PassRecord(name, seconds, sum(was.values()), len(after.nodes),
                        {op: d for op, d in sorted(ops.items()) if d}, sum((now - signatures).values()))
    return record, now


def pipeline_for(target, options: CompileOptions = CompileOptions()) -> list[GraphPass]:
    """The passes for a target (a Target, or a target's name for its defaults), in order: fuse (with
    the fusions the target's kernels want; MLA absorbed) -> quantise weights, the LM head and the
    embedding table in their own formats (options.head_format, table_format), KV -> kernel choice.
    MLA prefill steps run the expanded form from `options.mla_expanded_from` new tokens per sequence
    (default: the target's; 0: never).
    q8/q4 linears take int8 activations in the target's blocks unless `options.int8_activations` is
    False (None: the target's choice; True where the target has no such kernel is refused)."""
    target = target_defaults(target) if isinstance(target, str) else target
    expanded_from = target.mla_expanded_from if options.mla_expanded_from is None else options.mla_expanded_from
    passes: list[GraphPass] = [
        RaisePatterns(),                  # an imported graph's spellings of kiln's ops (nothing on HF's or GGUF's)
        FuseAppendAttend(),               # every kernel runs append and attention together
        # latent layers attend over the latent rows (and over rows rebuilt from them in long prefills)
        SpecializeMLA(expanded_from),
        FuseQKV(),
        FuseGateUp(),
        FuseResidualAdd(),
    ]
    if options.max_loras:
        # after the projections fuse (one lora each) and while slices still split qkv into its parts
        # beside quantised CPU weights the adapters are bfloat16: a step of many adapters reads them all
        quantised_cpu = options.quant not in (None, "none") and target.device == "cpu"
        passes.append(AddLoRA(options.max_loras, options.max_lora_rank,
                              options.lora_dtype or ("bfloat16" if quantised_cpu else None)))
    if target.kernels.fuses_rope():
        passes.append(FuseRopeAttention())
    if options.quant:
        if options.int8_activations and not target.activation_block:
            raise KilnError(f"--activations int8 is not supported on target {target.name}: it has no integer "
                            "dot-product linear kernel (the cpu target has one where the CPU has AVX2)")
        act_block = target.activation_block if options.int8_activations is not False else 0
        head = options.head_format()
        passes.append(Quantize(options.quant, lm_head=head is not None, group_size=options.group_size,
                               act_block=act_block, float_activations=options.float_activations,
                               lm_head_mode=head, tensor_modes=options.tensor_quant,
                               class_modes=tuple((c, f) for c, f in options.tensor_classes
                                                 if c not in ("lm_head", "embedding")),
                               more_bits=options.more_bits_format(),
                               scale_dtype="float32" if options.scale_dtype == "float32" else ""))
        if options.table_format():
            passes.append(QuantizeEmbedding(options.table_format(), group_size=options.group_size))
    if options.kv_dtype:
        passes.append(QuantizeKV(options.kv_dtype))
    passes.append(SelectKernels(target))           # last: what codegen emits is chosen from the graph as it is
    return passes


def run_pipeline(graph: Graph, target, dump: Callable[[str, Graph], None] | None = None,
                 passes: list[GraphPass] | None = None,
                 options: CompileOptions = CompileOptions()) -> tuple[Graph, list[PassRecord]]:
    """Run `passes`, or the target's pipeline for `options` (less its disable_passes)."""
    passes = pipeline_for(target, options) if passes is None else passes
    disable = options.disable_passes
    unknown = set(disable) - {p.name for p in passes}
    if unknown:
        raise KilnError(f"no pass named {', '.join(sorted(unknown))} (passes: {', '.join(p.name for p in passes)})")
    if SelectKernels.name in disable:
        raise KilnError(f"the {SelectKernels.name} pass cannot be disabled: codegen emits the kernels it records")
    if RaisePatterns.name in disable:
        raise KilnError(f"the {RaisePatterns.name} pass cannot be disabled: no target lowers what it raises")
    verify(graph)
    if dump:
        dump("import", graph)
    records, signatures = [], _signatures(graph)
    for rewrite in [p for p in passes if p.name not in disable]:
        t0 = time.perf_counter()
        graph = verify(rewrite(graph))
        record, signatures = _record(rewrite.name, time.perf_counter() - t0, signatures, graph)
        records.append(record)
        if dump:
            dump(rewrite.name, graph)
    return graph, records


def make_dumper(print_after: set[str] | None = None, print_all: bool = False, dump_dir: str | None = None,
                out: Callable[[str], None] = print) -> Callable[[str, Graph], None] | None:
    """A dump callback for the CLI flags and KILN_DUMP (a directory that gets one file per pass)."""
    dump_dir = dump_dir or os.environ.get("KILN_DUMP")
    if not (print_all or print_after or dump_dir):
        return None
    counter = iter(range(1000))

    def dump(name: str, graph: Graph) -> None:
        text = print_graph(graph)
        if print_all or name in (print_after or ()):
            out(f"// ----- IR after {name} -----\n{text}")
        if dump_dir:
            Path(dump_dir).mkdir(parents=True, exist_ok=True)
            (Path(dump_dir) / f"{next(counter):02d}-{name}.txt").write_text(text + "\n")
    return dump
