"""Fingerprint every kernel kiln generates, so a refactor can show it changed none.

    python bench/kernel_hashes.py --out build/kernel-hashes/HEAD.json      (about 5 minutes, 2 cores)
    python bench/kernel_hashes.py --compare build/kernel-hashes/BEFORE.json build/kernel-hashes/HEAD.json

For each case (the 1B-shaped Llama in bf16, q4 and fp8, a gemma2 with fp8 pages, the tiny MoE (also
quantised) and MLA families, a quantised Qwen2 with biases; CUDA for sm_90 and the CPU for fixed LLVM
CPU models: znver3 (AVX2), znver4 (AVX-512 BF16, VNNI), sapphirerapids (AMX), so the host does not
matter) it runs compile's front half (import, passes, codegen, the target's Relax pipeline, the build)
and records, per function:
  - every TIR kernel's TVMScript after the Relax pipeline (what TVM lowers to machine code);
  - every Relax function's TVMScript (the calling sequence of a step);
  - from the built library, the CUDA source of each `__global__` kernel and the LLVM IR of each host
    (or CPU) function.
The VM's shape functions are left out: TVM splits, numbers and orders them differently from run to
run. `script` and `llvm_functions` say what else is made neutral.
Layer count does not change a kernel, so the 1B shape keeps 2 of its 16 layers. `--compare` lists
what was added, removed or changed per case; it exits 1 on any difference.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kiln.options import CompileOptions

LLAMA_1B_2L = ("llama32", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=64, vocab_size=128256))
TINY_MOE = ("mixtral", {})
TINY_MLA = ("deepseek_v2", {})
TINY_GEMMA = ("gemma2", {})
TINY_QWEN2 = ("qwen2", {})           # q/k/v biases

# case name -> (model, target, arch, compile options)
CASES = {
    "cuda-1b-bf16": (LLAMA_1B_2L, "cuda", "sm_90", dict(dtype="bfloat16")),
    "cuda-1b-q4": (LLAMA_1B_2L, "cuda", "sm_90", dict(dtype="bfloat16", quant="q4")),
    "cuda-1b-fp8": (LLAMA_1B_2L, "cuda", "sm_90", dict(dtype="bfloat16", quant="fp8")),
    "cuda-gemma2-fp8kv": (TINY_GEMMA, "cuda", "sm_90", dict(dtype="bfloat16", kv_dtype="fp8")),
    "cuda-moe": (TINY_MOE, "cuda", "sm_90", dict(dtype="bfloat16")),
    "cuda-moe-q4": (TINY_MOE, "cuda", "sm_90", dict(dtype="bfloat16", quant="q4")),
    "cuda-mla": (TINY_MLA, "cuda", "sm_90", dict(dtype="bfloat16")),
    "cpu-znver3-1b-bf16": (LLAMA_1B_2L, "cpu", "znver3", dict(dtype="bfloat16")),
    "cpu-znver3-1b-q4": (LLAMA_1B_2L, "cpu", "znver3", dict(quant="q4")),
    "cpu-spr-1b-q8-kv8": (LLAMA_1B_2L, "cpu", "sapphirerapids", dict(dtype="bfloat16", quant="q8", kv_dtype="int8")),
    "cpu-znver4-1b-bf16": (LLAMA_1B_2L, "cpu", "znver4", dict(dtype="bfloat16")),
    "cpu-spr-1b-bf16": (LLAMA_1B_2L, "cpu", "sapphirerapids", dict(dtype="bfloat16")),
    "cpu-znver3-moe": (TINY_MOE, "cpu", "znver3", {}),
    "cpu-znver3-moe-q8": (TINY_MOE, "cpu", "znver3", dict(quant="q8")),
    "cpu-znver3-qwen2-q4": (TINY_QWEN2, "cpu", "znver3", dict(quant="q4")),
    "cpu-znver3-mla": (TINY_MLA, "cpu", "znver3", {}),
    "cpu-znver3-gemma2-fp8kv": (TINY_GEMMA, "cpu", "znver3", dict(kv_dtype="fp8")),
}


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cuda_kernels(source: str) -> dict[str, str]:
    """The CUDA source cut at each `extern "C" __global__` kernel: its name -> its text."""
    starts = [m for m in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', source)]
    kernels = {"<prelude>": source[:starts[0].start()] if starts else source}
    for m, end in zip(starts, [*(s.start() for s in starts[1:]), len(source)]):
        kernels[m.group(1)] = source[m.start():end]
    return kernels


SHAPE_FUNC = re.compile(r"shape_func\d*")


def llvm_functions(text: str) -> dict[str, str]:
    """LLVM IR cut at each `define`: its name -> its body, with what shifts when an unrelated function
    changes made neutral (debug and metadata numbers, string constants' and parallel lambdas' numbers;
    functions of one name after that are hashed together)."""
    functions: dict[str, list[str]] = {}
    for block in re.split(r"\n(?=define )", text)[1:]:
        name = re.match(r"define [^@]*@([\w.$]+)", block).group(1)
        if SHAPE_FUNC.search(name):
            continue
        body = block.split("\n}\n")[0]
        body = re.sub(r"^\s*#dbg_\w+\(.*\n", "", body, flags=re.M)
        body = re.sub(r"(, )?!\w[\w.]* !\d+|#\d+|!\d+", "", body)
        body = re.sub(r"(@\.str|__tvm_parallel_lambda)\.\d+", r"\1", body)
        functions.setdefault(re.sub(r"^(__tvm_parallel_lambda)\.\d+$", r"\1", name), []).append(body)
    return {name: "\n".join(sorted(bodies)) for name, bodies in functions.items()}


def modules(library):
    """The library's module and every module it imports, depth first."""
    yield library
    for imported in library.imports:
        yield from modules(imported)


def script(func) -> str:
    """A function's TVMScript, with the VM's shape functions named alike: TVM splits and numbers them
    differently from run to run (they compute shapes on the host; no kernel is one)."""
    return SHAPE_FUNC.sub("shape_func", func.script())


def fingerprint(case: str) -> dict[str, str]:
    """function -> hash, for one case (runs in a fresh process: CUDA must set up its loader first)."""
    (family, overrides), target_name, arch, options = CASES[case]
    from kiln.targets import get_target
    target = get_target(target_name, arch)
    import tvm
    from tvm import tirx
    from kiln.codegen import lower_graph
    from kiln.codegen.pipelines import relax_pipeline
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    from kiln.testing.tiny import make_config_only_model

    with tempfile.TemporaryDirectory() as tmp:
        model = load_hf_model(make_config_only_model(Path(tmp) / "model", family, **overrides))
        dtype = options.get("dtype", target.default_dtype)
        graph = model.build_graph(dtype, target.page_size)
    passes = {k: v for k, v in options.items() if k != "dtype"}
    graph, _ = run_pipeline(graph, target, None, options=CompileOptions(**passes))
    lowered = lower_graph(graph, target)
    module = lowered.module
    if target.device_sampling:
        from kiln.codegen.lowering.sampling import add_sampling_functions
        module = add_sampling_functions(module, model.config.vocab_size)
    with target.tvm_target(), tvm.transform.PassContext(config=target.pass_config()):
        mod = relax_pipeline(target)(module)
    hashes = {f"{'tir' if isinstance(func, tirx.PrimFunc) else 'relax'}:{gv.name_hint}": digest(script(func))
              for gv, func in mod.functions.items() if not SHAPE_FUNC.match(gv.name_hint)}
    library = target.build(mod).mod
    for module in modules(library):
        if module.kind == "llvm":
            for name, text in llvm_functions(module.inspect_source("ll")).items():
                hashes[f"llvm:{name}"] = digest(text)
        elif module.kind == "cuda":
            for name, text in cuda_kernels(module.inspect_source()).items():
                hashes[f"cuda:{name}"] = digest(text)
    return dict(sorted(hashes.items()))


def run_case(case: str) -> tuple[str, dict]:
    # one process per case: the CUDA target sets up TVM's loader before TVM is first imported
    out = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{case} failed:\n{out.stderr[-3000:]}")
    return case, json.loads(out.stdout)


def compare(before: dict, after: dict) -> int:
    differences = 0
    for case in sorted(set(before) | set(after)):
        old, new = before.get(case, {}), after.get(case, {})
        changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
        added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        differences += len(changed) + len(added) + len(removed)
        print(f"{case:<26} {len(new):4d} functions: {len(changed)} changed, {len(added)} added, {len(removed)} removed")
        for label, names in (("changed", changed), ("added", added), ("removed", removed)):
            for name in names:
                print(f"    {label:<8} {name}")
    return 1 if differences else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--case", help=argparse.SUPPRESS)      # the worker: one case's hashes as JSON on stdout
    args = ap.parse_args()
    if args.case:
        print(json.dumps(fingerprint(args.case)))
        return
    if args.compare:
        sys.exit(compare(*(json.loads(p.read_text()) for p in args.compare)))
    with ProcessPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(run_case, args.cases))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    for case, hashes in results.items():
        print(f"{case:<26} {len(hashes):4d} functions")


if __name__ == "__main__":
    main()
