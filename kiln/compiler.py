"""`kiln compile`: HF directory or GGUF file -> IR -> passes -> TVM module -> built library + weights -> artifact."""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from kiln.artifact import WEIGHTS, new_artifact_dir, write_manifest
from kiln.interface import GRAPH_ENTRIES, STEP_KINDS, KVLayout, Manifest, ModelRecord, Quantization, TargetRecord
from kiln.ir import input_of, weight_format
from kiln.ir.ops import ATTENTION_OPS
from kiln.ir.step_forms import for_step, prefill_min_tokens
from kiln.errors import KilnError
from kiln.options import CompileOptions
from kiln.selection.choice import recorded
from kiln.selection.tiles import HOPPER_FROM


class Phases:
    """Times the compile phases and shows each as it runs (the running one only on a terminal)."""

    def __init__(self, show: Callable[[str], None] | None):
        self.show = show or (lambda line: None)
        self.live = show is not None and sys.stderr.isatty()
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn, *args):
        self.current, self.shown_tenths = name, 0
        if self.live:
            print(f"  {name:<8} ...", end="\r", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        result = fn(*args)
        self.seconds[name] = round(time.perf_counter() - t0, 3)
        if self.live:
            print(" " * 100, end="\r", file=sys.stderr)     # clear the progress line
        self.show(f"  {name:<8} {self.seconds[name]:6.1f}s")
        return result

    def progress(self, text: str, fraction: float) -> None:
        """How far the running phase is: every step on a terminal, each tenth elsewhere (logs)."""
        if self.live:
            print(f"  {self.current:<8} {text}"[:100].ljust(100), end="\r", file=sys.stderr, flush=True)
        elif int(fraction * 10) > self.shown_tenths:
            self.shown_tenths = int(fraction * 10)
            self.show(f"  {self.current:<8} {self.shown_tenths * 10:3d}% {text}")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _embedding_storage(graph) -> tuple[str, bool]:
    """The embedding's quantisation scheme ("none" for a float table) and whether its stored table is
    the LM head's weight too (one tensor read by both: codegen stores a shared table once)."""
    embed = next((n for n in graph.nodes if n.op == "embed"), None)
    if embed is None:
        return "none", False
    table = input_of(embed, "table")
    return weight_format(embed), any(n.op == "linear" and input_of(n, "weight") == table for n in graph.nodes)


def _attention_layers(graph) -> list[dict]:
    """Per layer: the kernel variant and the attention kernel select_kernels recorded for each step
    kind. A latent (MLA) layer runs its families' kernels, and its expanded form's kernels
    in prefill steps where the graph has that form."""
    expanded = {n.attrs["layer"]: recorded(n, "prefill") for n in graph.nodes if n.op == "expanded_attend"}
    layers = []
    for n in graph.nodes:
        if n.op in ATTENTION_OPS:
            layers.append({"layer": n.attrs["layer"], "variant": n.attrs["variant"],
                           **{step: recorded(n, step) for step in ("mixed", "decode")}})
        elif n.op == "latent_attend":
            layers.append({"layer": n.attrs["layer"], "variant": "mla",
                           **{step: recorded(n, step) for step in ("mixed", "decode")}})
            if n.attrs["layer"] in expanded:            # long prefill chunks: the expanded form
                layers[-1]["prefill"] = expanded[n.attrs["layer"]]
    return layers


def _launch_counts(launches: dict) -> dict:
    """The manifest's launches_per_step: the mixed entry's kernels, and per entry the kernels a step
    runs and the launches the host issues for them (fewer where kernels replay as a CUDA graph)."""
    by_kernel, _ = launches["mixed"]
    return {"total": sum(by_kernel.values()), "by_kernel": dict(sorted(by_kernel.items())),
            "entries": {step: {"kernels": sum(kernels.values()), "host_launches": host}
                        for step, (kernels, host) in launches.items()}}


def _step_kernels(graph, entries, op: str) -> dict:
    """Per step kind with an entry, the kernels select_kernels recorded for the nodes of `op` it runs."""
    kernels = {step: sorted({recorded(n, step) for n in for_step(graph, step)[0] if n.op == op})
               for step in entries if step not in GRAPH_ENTRIES}      # a graph replays its step's entry
    return {step: names for step, names in kernels.items() if names}


def _hopper_gemms(variants: tuple[str, ...]) -> dict | None:
    """The manifest's hopper_gemms: CUTLASS's release, the variants linked in, and the rows from which
    a wgmma linear calls them (fewer: mma's tiles)."""
    if not variants:
        return None
    from kiln.codegen.kernels.gpu.hopper_gemm import CUTLASS_RELEASE
    return {"cutlass": CUTLASS_RELEASE, "variants": list(variants), "from_rows": HOPPER_FROM + 1}


def compile_model(model_dir: str | Path, out_dir: str | Path, options: CompileOptions = CompileOptions(),
                  force: bool = False, show: Callable[[str], None] | None = _stderr,
                  dump: Callable | None = None) -> Manifest:
    """Compile `model_dir` into an artifact at `out_dir` as `options` say; `show` sees a line per compile
    phase, `dump(pass_name, graph)` the IR after each pass.

    `out_dir` must not exist, be an empty directory, or (with `force`) hold a kiln artifact. The
    artifact is written beside it and moved into place once complete, so a failed or interrupted
    compile leaves nothing at `out_dir` (and an old artifact there untouched)."""
    with new_artifact_dir(out_dir, force) as partial:
        return _compile_into(model_dir, partial, options, show, dump)


def _lm_head_format(graph, quant: str | None) -> str | None:
    """The LM head's weight format where it is not the other linears' (None: the same)."""
    from kiln.passes.quantize import Quantize
    heads = Quantize._linears_feeding(graph, graph.outputs)
    head = next((n for n in graph.nodes if n.op == "linear" and n.output in heads), None)
    fmt = weight_format(head) if head is not None else "none"
    return fmt if quant and fmt not in ("none", quant) else None


def _class_formats(graph) -> dict:
    """Each kind of weight's formats, in words (passes/tensor_classes.py)."""
    from kiln.passes.quantize import Quantize
    from kiln.passes.tensor_classes import class_formats
    routers = Quantize._linears_feeding(graph, [input_of(n, "logits") for n in graph.nodes if n.op == "moe_router"])
    return class_formats(graph, Quantize._linears_feeding(graph, graph.outputs), routers, _activation_block(graph))


def _calibrate(model, options: CompileOptions, tokenizer_files: list[str], tgt, out_dir: Path, progress):
    """--calibrate: the input importances (kiln/calibrate.py), written into the artifact, and the options
    with float activations for the linears whose int8 activations measured too coarse (unless
    --activations chose for all)."""
    from kiln.calibrate import calibrate
    if "tokenizer.json" not in tokenizer_files:
        raise KilnError(f"--calibrate needs the model's tokenizer.json to read {options.calibrate}, and the model "
                        "has none")
    block = tgt.activation_block if options.int8_activations is not False else 0
    importance, record = calibrate(model, options.calibrate, out_dir / "tokenizer.json", tgt.page_size, out_dir,
                                   progress, block)
    if "activations" in record and options.int8_activations:     # --activations int8: int8 everywhere
        record["activations"]["float"] = []
    options = replace(options, float_activations=tuple(record.get("activations", {}).get("float", ())))
    return importance, record, options


def _activation_block(graph) -> int:
    """The int8 activation block of the graph's q8/q4 linears (0: float activations)."""
    return max((n.attrs.get("act_block", 0) for n in graph.nodes if n.op == "linear"), default=0)


def _compile_into(model_dir: str | Path, out_dir: Path, options: CompileOptions, show: Callable[[str], None] | None,
                  dump: Callable | None) -> Manifest:
    """Compile `model_dir` into the empty directory `out_dir`. Without `options.weights`, no weights file
    is written (the manifest says they are absent; `kiln fill-weights` draws them)."""
    phases = Phases(show)
    from kiln.frontend import load_model
    model = phases.run("import", load_model, model_dir)      # no TVM yet: a bad model is refused at once
    options = model.default_options(options)                # a GGUF file's quantisation where none is named

    if options.attention == "flashinfer":
        from kiln.codegen.kernels.gpu.flashinfer import check_release
        check_release()                                           # before TVM, as the model
    from kiln.targets import get_target  # CUDA must set up its loader before TVM is imported
    target = options.target
    tgt = get_target(target, options.arch) if isinstance(target, str) else target
    if options.attention == "flashinfer":
        from kiln.selection.order import CUDA_FLASHINFER_KERNELS
        tgt = replace(tgt, kernels=CUDA_FLASHINFER_KERNELS)
    dtype = options.dtype or tgt.default_dtype
    quant, kv_dtype = options.quant, options.kv_dtype
    tgt.check_dtype(dtype)
    tgt.check_quant(quant, kv_dtype)
    graph = phases.run("graph", model.build_graph, dtype, tgt.page_size)
    tokenizer_files = model.write_tokenizer(out_dir)
    importance = calibration = None
    if options.calibrate:
        importance, calibration, options = phases.run("calibrate", _calibrate, model, options, tokenizer_files, tgt,
                                                      out_dir, phases.progress)

    from kiln.passes import run_pipeline
    from kiln.passes.add_lora import lora_layout
    graph, pass_records = phases.run("passes", lambda: run_pipeline(graph, tgt, dump, options=options))

    from kiln.codegen import lower_graph
    from kiln.codegen.pipelines import relax_pipeline
    lowered = phases.run("codegen", lower_graph, graph, tgt)

    def build():
        import tvm
        module = lowered.module
        if tgt.device_sampling:
            from kiln.codegen.lowering.sampling import add_sampling_functions
            module = add_sampling_functions(module, model.config.vocab_size)
        with tgt.tvm_target(), tvm.transform.PassContext(config=tgt.pass_config()):
            mod = relax_pipeline(tgt)(module)
        from kiln.codegen.launches import host_launches, kernel_launches, kernel_names
        kernels = kernel_names(mod)
        launches = {step: (kernel_launches(mod, name), host_launches(mod, name))
                    for step, name in lowered.entries.items()}
        return tgt.build(mod), kernels, launches
    executable, kernels, launches = phases.run("build", build)

    if lowered.links_cuda_objects:      # FlashInfer's and CUTLASS's objects call CUDA's runtime library
        from kiln.codegen.kernels.gpu.cuda_objects import cudart_link_options
        tgt = replace(tgt, link_options=tuple(cudart_link_options()))
    phases.run("export", lambda: tgt.export_library(executable, str(out_dir / tgt.library_name)))

    from kiln.weights.convert import write_weights
    weights = options.weights
    weights_digest = phases.run("weights", write_weights, model, graph, lowered.weights, dtype, out_dir / WEIGHTS,
                                phases.progress, importance) if weights else None

    c = model.config
    embedding, embedding_shared = _embedding_storage(graph)
    attention = _attention_layers(graph)
    return write_manifest(out_dir, digests={WEIGHTS: weights_digest} if weights else {}, manifest=Manifest(
        model=ModelRecord(c.architecture, c.to_json(), str(Path(model_dir).resolve())),
        target=TargetRecord(tgt.name, tgt.device, tgt.arch, str(tgt.tvm_target()), tgt.runs_here, tgt.note or None,
                            tuple(tgt.cpu_features()) if tgt.device == "cpu" else None,
                            tgt.tiles if any(k.startswith("amx_") for k in kernels) else None),
        dtype=dtype,
        quantization=Quantization(quant or "none", options.head_format() is not None, embedding,
                                  embedding_shared, kv_dtype or "none",
                                  options.group_size if quant in ("q4", "q8g", "q4a", "q4k") else None,
                                  _activation_block(graph), _lm_head_format(graph, quant),
                                  dict(options.tensor_quant) if quant and options.tensor_quant else None,
                                  dict(options.tensor_classes) or None, _class_formats(graph) if quant else None,
                                  options.more_bits_format(), calibration,
                                  "float32" if quant and options.scale_dtype == "float32" else None),
        kv=KVLayout(tgt.page_size, tuple(graph.kv_specs[i].to_json() for i in range(len(graph.kv_specs)))),
        vocab_size=c.vocab_size,
        max_context=c.max_context,
        library=tgt.library_name,
        entries=lowered.entries,
        prefill_min_tokens=prefill_min_tokens(graph) if "prefill" in lowered.entries else None,
        decode_gemm_from=tgt.decode_gemm_from or None
        if "gemm" in tgt.kernels.linear and "decode" in lowered.entries else None,
        decode_mma_from=tgt.decode_mma_from if "decode_wide" in lowered.entries else None,
        inputs=tuple(lowered.inputs),
        weights=tuple(lowered.weights),
        weights_source="checkpoint" if weights else "absent",
        kernels=tuple(kernels),
        attention_variants=tuple(sorted({layer["variant"] for layer in attention})),
        attention_kernels={step: sorted({layer[step] for layer in attention if step in layer})
                           for step in STEP_KINDS if any(step in layer for layer in attention)},
        attention_layers=tuple(attention),
        graph_batches=tuple(tgt.graph_batches),
        sampling="device" if tgt.device_sampling else "host",
        lora=lora_layout(graph),
        launches_per_step=_launch_counts(launches),
        linear_kernels=_step_kernels(graph, lowered.entries, "linear"),
        expert_kernels=_step_kernels(graph, lowered.entries, "moe_experts"),
        flashinfer=lowered.flashinfer,
        hopper_gemms=_hopper_gemms(lowered.hopper_gemms),
        passes=tuple({"name": r.name, "seconds": round(r.seconds, 4), "nodes_before": r.nodes_before,
                      "nodes_after": r.nodes_after, "ops": r.ops, "rewritten": r.rewritten} for r in pass_records),
        compile_seconds=phases.seconds,
        tokenizer_files=tuple(tokenizer_files),
        source=model.source_record(),
    ))
