"""`kiln inspect`: a readable summary of an artifact's manifest."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from kiln.artifact import WEIGHTS, read_manifest, verify_files
from kiln.dtypes import numpy_dtype
from kiln.interface import KVSpec, Manifest


def _attention_kernels(m: Manifest) -> str:
    """Which attention kernels run which steps (artifacts from before the record: unknown)."""
    kernels = m.attention_kernels
    if not kernels:
        return "kernels not recorded"
    chunks = f" (every sequence ≥ {m.prefill_min_tokens} new tokens)" if m.prefill_min_tokens is not None else ""
    batches = f" (up to {m.decode_gemm_from - 1} sequences)" if m.decode_gemm_from else ""
    return "; ".join(f"{step} steps{chunks if step == 'prefill' else batches if step == 'decode' else ''}: "
                     f"{', '.join(names)}" for step, names in kernels.items())


def _step_rows(m: Manifest, entry: str) -> str:
    """An entry as the steps it runs: 'decode steps (up to 15 sequences)', 'decode steps from 16
    sequences' (their CUDA graphs run the same kernels)."""
    wide_from = m.decode_mma_from or m.decode_gemm_from
    if entry == "decode_wide":
        return f"decode steps from {wide_from} sequences"
    if entry == "decode" and wide_from:
        return f"decode steps (up to {wide_from - 1} sequences)"
    return f"{entry} steps"


def _by_step(label: str, m: Manifest, kernels: dict) -> list[str]:
    """One line: the kernels each entry's nodes of a family run (none for an artifact without them)."""
    if not kernels:
        return []
    return [f"{label:<11}" + "; ".join(f"{_step_rows(m, step)}: {', '.join(names)}"
                                      for step, names in kernels.items() if not step.endswith("graph"))]


def _kv_layers(m: Manifest) -> list[str]:
    """Each run of layers with the same KV spec and attention kernels, one line per run."""
    rows = [(KVSpec.from_json(spec), (k["variant"], k["mixed"], k["decode"], k.get("prefill", k["mixed"])))
            for spec, k in zip(m.kv.layers, m.attention_layers)]
    runs: list[list] = []
    for layer, row in enumerate(rows):
        if runs and runs[-1][2] == row:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, row])
    lines = []
    for first, last, (spec, (variant, mixed, decode, prefill)) in runs:
        which = f"layer {first}" if first == last else f"layers {first}-{last}"
        other = [f"{step} steps: {kernel}" for step, kernel in (("decode", decode), ("prefill", prefill))
                 if kernel != mixed]
        lines.append(f"  {which:<13} {spec.describe()}; {variant}, kernel {mixed}"
                     + (f" ({'; '.join(other)})" if other else ""))
    return lines


def _entry_launches(m: Manifest) -> str:
    """Per entry function other than forward: kernels per step, and host launches where they differ."""
    parts = []
    for step, n in m.launches_per_step.get("entries", {}).items():
        if step != "mixed":
            graphs = f" in {n['host_launches']} host launches (CUDA graph, batches " \
                     f"{', '.join(map(str, m.graph_batches))})" if n["host_launches"] != n["kernels"] else ""
            parts.append(f"; {step} steps: {n['kernels']} kernels{graphs}")
    return "".join(parts)


def _quantization(m: Manifest) -> str:
    """What is quantised and how, in words: the weights (with the LM head and the embedding table,
    which may stay in the model's dtype), the activations, the KV cache."""
    q, dtype = m.quantization, m.dtype
    if q.weights == "none":
        weights = f"weights not quantised ({dtype})"
    else:
        group = f" in groups of {q.group_size}" if q.group_size else ""
        group += " with float32 scales" if q.scale_dtype == "float32" else ""
        head = (f"the LM head {q.lm_head_format}" if q.lm_head and q.lm_head_format
                else "the LM head too" if q.lm_head else f"the LM head in {dtype}")
        table = f"the embedding table {q.embedding}" if q.embedding != "none" else f"the embedding table in {dtype}"
        weights = f"weights {q.weights}{group} ({head}, {table})"
        if q.tensor_formats:
            counts = Counter(q.tensor_formats.values())
            weights += "; " + ", ".join(f"{n} {'tensor' if n == 1 else 'tensors'} {fmt}"
                                        for fmt, n in sorted(counts.items()))
    if q.embedding_shared_with_lm_head:
        weights += "; the embedding table is the LM head's, stored once"
    if q.activation_block:
        weights += f"; activations int8 in blocks of {q.activation_block}"
    kv = q.kv_cache
    return weights + "; KV cache " + (f"{dtype} (not quantised)" if kv == "none" else f"{kv} with a scale per row")


def _tensor_classes(m: Manifest) -> list[str]:
    """What each tensor class got (quantised artifacts that record it), and the calibration text."""
    q = m.quantization
    lines = []
    if q.class_formats:
        lines.append("tensors    " + "; ".join(f"{kind} {text}" for kind, text in q.class_formats.items()))
    if q.more_bits:
        lines.append(f"           (v and down {q.more_bits} in the first and last eighth of the layers and every third "
                     "between, as llama.cpp's Q4_K_M)")
    if q.tensor_classes:
        lines.append("           --tensor-quant " + ",".join(f"{c}={f}" for c, f in q.tensor_classes.items()))
    if q.calibration:
        c = q.calibration
        from kiln.ir.quant import SCHEMES
        use = "the rounding weighed by it" if SCHEMES[q.weights].weighted else f"{q.weights} rounds without it"
        lines.append(f"calibrated on {c['text']} ({c['tokens']} tokens in {c['chunks']} chunks): each input's mean "
                     f"square on {c['linears']} linears ({c['file']}), {use}")
        if c.get("activations"):
            lines.append("           " + _activation_choice(c["activations"]))
    return lines


def _activation_choice(acts: dict) -> str:
    """What calibration measured of int8 activations and what it chose, in words."""
    name, error = acts["largest"]
    measured = (f"int8 activations in blocks of {acts['block']} measured on {acts['measured']} linears "
                f"(largest output error {error:.2%}, {name})")
    floats = acts["float"]
    if not floats:
        return f"{measured}: int8 on all"
    return f"{measured}: float where above {acts['bound']:.0%}: {len(floats)} ({', '.join(floats[:4])}" + (
        ", ...)" if len(floats) > 4 else ")")


def _passes(passes: tuple[dict, ...]) -> list[str]:
    """What each pass did: the op counts it changed and the nodes it rewrote (from manifests that record
    them; older ones give node counts); the passes that changed nothing on one line."""
    lines, idle = [], []
    for p in passes:
        ms = f"{p['seconds'] * 1e3:.1f} ms"
        if "ops" not in p:
            lines.append(f"{p['name']} ({p['nodes_before']}→{p['nodes_after']} nodes, {ms})")
        elif not p["ops"] and not p["rewritten"]:
            idle.append(p["name"])
        else:
            ops = ", ".join(f"{op} {'+' if d > 0 else '−'}{abs(d)}" for op, d in p["ops"].items())
            rewritten = f"{p['rewritten']} nodes or params new or rewritten"
            lines.append(f"{p['name']}: {ops + '; ' if ops else ''}{rewritten} ({ms})")
    if idle:
        lines.append(f"nothing to do here: {', '.join(idle)}")
    return [("passes     " if i == 0 else "           ") + line for i, line in enumerate(lines or ["(none)"])]


def _weights_origin(m: Manifest) -> str:
    """Where the weights came from: a checkpoint, seeded random draws, or nowhere yet."""
    source = m.weights_source
    if source == "generated":
        return f"generated (seeded random, seed {m.files[WEIGHTS]['generated']['seed']}): not a trained model"
    if source == "absent":
        return "absent (compiled with --no-weights; `kiln fill-weights ARTIFACT --seed N` draws them)"
    return "from the checkpoint"


def _source(m: Manifest) -> list[str]:
    """A GGUF file's tensor types and what each became: kept as stored, repacked exactly, or requantised."""
    if not m.source:
        return []
    src = m.source
    types = ", ".join(f"{kind} ×{n}" for kind, n in src["tensor_types"].items())
    lines = [f"source     {src['format'].upper()} {src['file']} ({src['architecture']}): tensors {types}"]
    lines += [f"             {n:4d} {treatment}" for treatment, n in src["treatments"].items()]
    return lines


def summary(artifact_dir) -> str:
    m = read_manifest(artifact_dir, verify=False)
    c = m.model.config
    t = m.target
    total = sum(f["bytes"] for f in m.files.values())
    where = ("runs on this kind of machine" if t.runs_here else t.note if t.device == "cpu"
             else f"built here, runs on a {t.device} GPU")
    lines = [
        f"artifact   {artifact_dir}",
        f"kiln       {m.kiln_version} (interface {m.interface_version})",
        f"model      {m.model.architecture}: {c['num_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_heads']} heads / {c['num_kv_heads']} kv heads, head_dim {c['head_dim']}, vocab {c['vocab_size']}",
        f"target     {t.name}" + (f" {t.arch}" if t.arch else "") + f" ({where})",
        *_source(m),
        "quant      " + _quantization(m),
        *_tensor_classes(m),
        f"dtype      {m.dtype}; KV pages of {m.kv.page_size} tokens; context {m.max_context}",
        f"kv cache   {sum(KVSpec.from_json(s).bytes_per_token for s in m.kv.layers)} bytes per token over "
        f"{len(m.kv.layers)} layers, one page pool:",
        *_kv_layers(m),
        f"weights    {len(m.weights)} tensors, {_weights_origin(m)}",
        f"attention  paged, page size {m.kv.page_size}, kernel variant {', '.join(m.attention_variants)}; "
        + _attention_kernels(m),
        *([f"flashinfer {m.flashinfer['release']} linked in ({m.flashinfer['variant']}); the runtime plans each step "
           f"on the host, {len(m.flashinfer['plans'])} plan(s) (windows: "
           + ", ".join(str(p["window_left"] + 1) if p["window_left"] >= 0 else "full" for p in m.flashinfer["plans"])
           + ")"] if m.flashinfer else []),
        *([f"cutlass    {m.hopper_gemms['cutlass']} Hopper GEMMs linked in (wgmma + TMA; wgmma linears call them in "
           f"steps of {m.hopper_gemms['from_rows']} rows or more, mma's tiles below): "
           + ", ".join(m.hopper_gemms["variants"])] if m.hopper_gemms else []),
        *_lora(m),
        "sampling   " + ("on the device, compiled with the model: token ids (and asked-for logprobs) come back"
                         if m.sampling == "device" else "on the host (NumPy), from the step's logits"),
        *_by_step("linears", m, m.linear_kernels),
        *_tiles(m),
        *_by_step("experts", m, m.expert_kernels),
        f"kernels    {len(m.kernels)}: {', '.join(m.kernels)}",
        f"launches   {m.launches_per_step['total']} kernel launches per forward step: "
        + ", ".join(f"{k}×{n}" for k, n in m.launches_per_step["by_kernel"].items())
        + _entry_launches(m),
        *_passes(m.passes),
        "compile    " + ", ".join(f"{k} {v:.1f}s" for k, v in m.compile_seconds.items()),
        f"files      {total / 2**20:.1f} MiB",
    ]
    lines += [f"  {name:<28} {info['bytes'] / 2**20:9.2f} MiB  {_digest(info)}"
              for name, info in sorted(m.files.items())]
    return "\n".join(lines)


def _tiles(m: Manifest) -> list[str]:
    """Which kernels use the CPU's matrix tiles, and what they do without them."""
    tiled = sorted({name for names in (m.linear_kernels or {}).values() for name in names if name.startswith("amx_")})
    if not m.target.tiles or not tiled:
        return []
    kind = "AMX" if m.target.tiles == "amx" else m.target.tiles
    return [f"tiles      {kind} tiles in {', '.join(tiled)} (in those steps of 16 rows or more); where Linux grants "
            "no tiles (a CPU or kernel without AMX, or KILN_CPU_TILES=off) they run AVX-512's dots (bf16dot's, vnni's)"]


def _lora(m: Manifest) -> list[str]:
    """The adapter slots compiled in, and the projections they reach."""
    if m.lora is None:
        return []
    kinds = Counter("+".join(module.rsplit(".", 1)[-1].removesuffix("_proj") for module in site.modules)
                    for site in m.lora.sites)
    stacked = sum(m.lora.max_loras * m.lora.max_rank * (len(s.modules) * s.inputs + sum(s.rows)) for s in m.lora.sites)
    return [f"lora       {m.lora.max_loras} adapter slots of rank up to {m.lora.max_rank} ({m.lora.dtype}, "
            f"{stacked * numpy_dtype(m.lora.dtype).itemsize / 2**20:.1f} MiB) on "
            + ", ".join(f"{kind} ×{n}" for kind, n in kinds.items())]


def _digest(info: dict) -> str:
    algorithm = "blake3" if "blake3" in info else "sha256"       # sha256: artifacts from before blake3
    return f"{algorithm} {info[algorithm][:16]}…"


def verify(artifact_dir) -> str:
    """Check every file of the artifact against its manifest digest; a line saying what was checked."""
    t0 = time.perf_counter()
    m = read_manifest(artifact_dir, verify=False)
    hashed = verify_files(Path(artifact_dir), m)
    return (f"verified   {len(m.files)} files, {hashed / 2**20:.1f} MiB, in {time.perf_counter() - t0:.1f}s: "
            "every checksum matches")
