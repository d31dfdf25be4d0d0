"""Build, on this machine, everything a GPU machine needs to test and benchmark kiln's CUDA path.

    python bench/gpu_kit.py [--out build/gpu-kit] [--shapes llama-3.2-1b llama-3.1-8b]
                            [--modes bfloat16 q8 q4 fp8] [--arch sm_90] [--serve]
    python bench/gpu_kit.py --families [--out build/gpu-kit-families] [--arch sm_90]
    python bench/gpu_kit.py --flashinfer [--out build/gpu-kit-flashinfer] [--shapes llama-3.2-1b llama-3.1-8b]
    python bench/gpu_kit.py --gemm [--out build/gpu-kit-gemm] --shapes llama-3.2-1b llama-3.1-8b
                            --modes bfloat16 q4 q4g128     (sm_90: the Hopper GEMM's candidates too)
    python bench/gpu_kit.py --gemv [--out build/gpu-kit-gemv] --modes bfloat16 q4
    python bench/gpu_kit.py --attention [--out build/gpu-kit-attention] --shapes llama-3.2-1b llama-3.1-8b
                            --modes bfloat16 bfloat16-kv-int8
    python bench/gpu_kit.py --attention --shapes gemma-2-2b gemma-2-2b-full deepseek-v2-lite-4l
                            mixtral-8x7b-4l --modes bfloat16       (the same folder: a kit grows)
    python bench/gpu_kit.py --lora [--out build/gpu-kit-lora] --shapes llama-3.2-1b

The GPU machine has PyTorch and transformers but no TVM, no compiler toolchain for it, no
internet, and takes at most 64 MiB per transfer, so nothing big travels:
  site/                 TVM's runtime only (the wheel without its 260 MB compiler library, which
                        TVM then skips: tvm/base.py), tvm-ffi and blake3 built for the device's
                        Python 3.12; put it first on PYTHONPATH there
  wheels/               with --serve: what `kiln serve` needs beyond the runtime (pyproject.toml's
                        fastapi, uvicorn, prometheus-client, httpx) and the openai client its test
                        drives it with, with every dependency pip's resolver picks for the device's
                        Python (requirements.txt names them); run.sh installs them with pip from
                        there alone, so what the device has and fits stays, as for a user
  bundle/               tests/gpu's tiny model and its CUDA artifacts without weights (tests/gpu/
                        make_bundle.py --without-weights): run.sh attaches them from the model first
  <shape>/model/        the shape's config and tokenizer, no weights (kiln.testing.tiny.make_config_only_model)
  <shape>/<mode>/       its CUDA artifact compiled with --no-weights; `kiln fill-weights` draws seeded
                        random weights there (bench/decode_gpu.py builds the HF side from model/)
  gemm/                 with --gemm: kiln's tensor-core GEMM tiles for the Llama shapes and
                        tests/gpu/test_mma_gemm.py's, built by bench/gemm_gpu.py build (for sm_90
                        with CUTLASS's Hopper GEMM candidates, bf16 and q4 in groups of 128)
  gemv/                 with --gemv: kiln's decode GEMV candidates for the Llama shapes and
                        tests/gpu/test_gemv.py's, built by bench/gemv_gpu.py build
  run.sh                installs kiln, then runs its stages, each under its own time limit: tests
                        (tests/gpu), weights (`kiln fill-weights`), decode (bench/decode_gpu.py),
                        and with --serve serve_tests (tests/gpu/test_cuda_serve.py) after the
                        tests and, after the weights, serve (bench/serve_gpu.py on the first
                        shape's bfloat16 artifact) and speculative (bench/speculative.py
                        verify-cost on each bfloat16 and q4 artifact); with --gemm gemm (bench/gemm_gpu.py run, which
                        writes $OUT/tiles.json) after the tests and prefill (bench/prefill_gpu.py
                        on each bfloat16 artifact) before the decode; with --gemv gemv (bench/gemv_gpu.py
                        run, which writes $OUT/gemv_tuning.json) after the tests and profile
                        (bench/step_profile.py, a batch-1 decode step) before the decode; with
                        --attention longctx (decode steps of the Llama shapes at $LONGCTX tokens of
                        context, 1 and 8 sequences, kernel by kernel against the bytes read) and
                        windows (the Gemma 2 shapes' decode steps at 4,096: windows and soft-capping
                        against neither) and moe_mla (the DeepSeek and Mixtral shapes' decode and
                        2,048-token prefill beside HF eager); with --lora lora (bench/lora.py: each shape's
                        bfloat16 artifact beside its 8-slot LoRA one, batch 32 on 8 adapters); $STAGES picks
                        others; results go to $OUT
With --families the kit is site/ and tests/gpu/test_cuda_families.py's bundle alone: every tiny
family's float32 CUDA artifact without weights (tests/gpu/make_bundle.py --families-without-weights);
its run.sh makes each tiny model there, attaches its weights (kiln attach-weights) and runs the test.
Its size is printed at the end: a device call carries the repository and this folder (`carry`),
64 MiB in all, so build the shapes in separate kits if one is too big.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

MODES = {"float16": ["--dtype", "float16"], "bfloat16": ["--dtype", "bfloat16"],
         "q8": ["--dtype", "float16", "--quant", "q8"], "q4": ["--dtype", "float16", "--quant", "q4"],
         "q4g128": ["--dtype", "float16", "--quant", "q4", "--group-size", "128"],   # sm_90: the Hopper GEMM's q4
         "q4k": ["--dtype", "float16", "--quant", "q4k"],          # GGUF's Q4_K: mma and GEMV with minimums
         "fp8": ["--dtype", "float16", "--quant", "fp8"],
         "bfloat16-kv-int8": ["--dtype", "bfloat16", "--kv-dtype", "int8"],
         "bfloat16-flashinfer": ["--dtype", "bfloat16", "--attention", "flashinfer"],
         "bfloat16-lora8": ["--dtype", "bfloat16", "--max-loras", "8", "--max-lora-rank", "16"]}   # issue 52
DEVICE_PYTHON = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
                 *[f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                               "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                                               "manylinux2014_x86_64")]]
RUNTIME_WHEELS = ["apache-tvm==0.27.0.post1", "apache-tvm-ffi==0.1.14.post1", "blake3"]
# what `kiln serve` adds to the runtime (pyproject.toml's pins), and the client tests/gpu drives it with
SERVE_PACKAGES = {"dependencies": ("fastapi", "uvicorn", "prometheus-client", "httpx"),
                  "test": ("openai",)}
# what the runtime never needs from the wheels: TVM's compiler library, C++ headers and sources
SKIP = ("tvm/lib/libtvm_compiler.so", "tvm/3rdparty/", "tvm/include/", "tvm_ffi/3rdparty/", "tvm_ffi/include/")

RUN_SH = """#!/bin/bash
# On the GPU machine, from the repository root:  bash KIT/run.sh KIT [SECONDS]
# The stages $STAGES names run in turn, each under its own time limit, so a stage that hangs or fails
# still leaves the others' output in $OUT.
set -o pipefail
KIT=${1:?kit folder}; BUDGET=${2:-480}; START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
# within SECONDS CMD...: timeout ends CMD's whole process group (a server it started too)
within() { local s=$1; shift; (( s >= 5 )) || { echo "no time left for $*"; return 124; }; timeout $s "$@"; }
# the kit's artifacts, those whose path matches $ONLY (an extended regex) where it is set
artifacts() { ls -d $KIT/*/*/ | grep -v -e /model/ -e /bundle/ -e /site/ -e $KIT/flashinfer/ | grep -E "${ONLY:-.}"; }
export PYTHONPATH=$PWD/$KIT/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tee $OUT/pip.log || exit 1
if [ -d $KIT/wheels ]; then     # as a user installs them: what is here and fits stays, the rest from wheels/
  python3 -m pip install --no-index --find-links $KIT/wheels -r $KIT/wheels/requirements.txt 2>&1 \\
    | tee -a $OUT/pip.log || exit 1
  python3 -c "import fastapi, openai, kiln.serve.server; print('serve imports, fastapi', fastapi.__version__)" 2>&1 \\
    | tee -a $OUT/pip.log
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import tvm, torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
[ -d $KIT/bundle ] && within 120 python3 tests/gpu/make_bundle.py $KIT/bundle --attach 2>&1 | tee $OUT/attach.log

# tests/gpu but the server's (serve_tests) and the families' (their own kit, gpu_kit.py --families: with
# this one it would pass 64 MiB)
stage_tests() {
  [ -d $KIT/gemm ] && export KILN_GEMM_KERNELS=$PWD/$KIT/gemm      # tests/gpu/test_mma_gemm.py's kernels
  [ -d $KIT/gemv ] && export KILN_GEMV_KERNELS=$PWD/$KIT/gemv      # tests/gpu/test_gemv.py's kernels
  KILN_GPU_BUNDLE=$PWD/$KIT/bundle within $(( $(left) / 2 )) python3 -m pytest -q -rs -p no:cacheprovider tests/gpu \\
    --ignore=tests/gpu/test_cuda_families.py --ignore=tests/gpu/test_cuda_serve.py 2>&1 | tee $OUT/tests_gpu.log
}
stage_serve_tests() {
  KILN_GPU_BUNDLE=$PWD/$KIT/bundle within 150 python3 -m pytest -q -rs -p no:cacheprovider \\
    tests/gpu/test_cuda_serve.py 2>&1 | tee $OUT/tests_serve.log
}
stage_weights() {
  for d in $(artifacts); do within 120 python3 -m kiln.cli fill-weights $d --seed 0 --force || return 1; done
}
stage_serve() {        # kiln serve under load on the first shape's bfloat16 artifact
  within ${SERVE_SECONDS:-240} python3 bench/serve_gpu.py ${SERVE_ARTIFACT:-$(artifacts | grep /bfloat16/ | head -1)} \\
    ${SERVE_ARGS:---concurrency 1,8,32 --num-prompts 32} 2>&1 | tee $OUT/serve_gpu.md
}
stage_gemm() {         # kiln's tensor-core tiles beside cuBLAS; the fastest per shape as codegen's table
  within ${GEMM_SECONDS:-150} python3 bench/gemm_gpu.py run $KIT/gemm --write-table $OUT/tiles.json \
    ${GEMM_ARGS:-} 2>&1 | tee $OUT/gemm_gpu.md
}
stage_gemv() {         # kiln's decode GEMVs against the copy rate; the fastest per shape as codegen's table
  within ${GEMV_SECONDS:-120} python3 bench/gemv_gpu.py run $KIT/gemv --write-table $OUT/gemv_tuning.json \
    ${GEMV_ARGS:-} 2>&1 | tee $OUT/gemv_gpu.md
}
stage_profile() {      # a batch-1 decode step of each bfloat16 and q4 artifact, kernel by kernel (CUPTI)
  for d in $(artifacts | grep -e /bfloat16/ -e /q4/); do
    within ${PROFILE_SECONDS:-40} python3 bench/step_profile.py $d --step decode --tokens 128 --top 12 2>&1 \
      | tee -a $OUT/step_profile.md
  done
}
stage_prefill() {      # TTFT of 512 / 2048 / 8192-token prompts beside HF eager, each bfloat16 artifact
  for d in $(artifacts | grep -e /bfloat16/ -e /bfloat16-flashinfer/); do
    within ${PREFILL_SECONDS:-70} python3 bench/prefill_gpu.py $d ${PREFILL_ARGS:-} 2>&1 | tee -a $OUT/prefill_gpu.md
  done
}
stage_longctx() {      # long-context decode steps: attention's share, and the step against its bytes
  for d in $(artifacts | grep /llama-); do
    for ctx in ${LONGCTX:-8192 32768}; do
      for seqs in 1 8; do
        within ${LONGCTX_SECONDS:-45} python3 bench/step_profile.py $d --step decode --tokens $ctx --seqs $seqs \
          --repeats 3 --top 6 2>&1 | tee -a $OUT/longctx.md
      done
    done
  done
}
stage_windows() {      # Gemma 2's windowed, soft-capped layers (kiln's attention) against the same shape without
  for d in $(artifacts | grep /gemma-2-2b | grep /bfloat16/); do
    for seqs in 1 8; do
      within ${WINDOWS_SECONDS:-45} python3 bench/step_profile.py $d --step decode --tokens 4096 --seqs $seqs \
        --repeats 3 --top 6 2>&1 | tee -a $OUT/windows.md
    done
  done
}
stage_moe_mla() {      # the mixtures of experts and MLA shapes: decode and a 2,048-token prefill beside HF eager
  for d in $(artifacts | grep -e /deepseek -e /mixtral); do
    within ${MOE_MLA_SECONDS:-150} python3 bench/decode_gpu.py $d --batches 1 8 64 --new-tokens 32 --repeats 2 \
      --no-hf-compiled 2>&1 | tee -a $OUT/moe_mla.md
    within ${MOE_MLA_SECONDS:-150} python3 bench/prefill_gpu.py $d --lengths 2048 --repeats 2 2>&1 \
      | tee -a $OUT/moe_mla.md
  done
}
stage_speculative() {  # the verify step (k + 1 tokens of one sequence) against a one-token step, each artifact
  within ${SPECULATIVE_SECONDS:-60} python3 bench/speculative.py verify-cost --artifacts \
    $(artifacts | grep -e /bfloat16/ -e /bfloat16-flashinfer/ -e /q4/) 2>&1 | tee $OUT/speculative_gpu.md
}
stage_flashinfer_tests() {   # --attention flashinfer artifacts against the interpreter (tests/gpu/test_flashinfer_gpu.py)
  within 120 python3 tests/gpu/test_flashinfer_gpu.py $KIT/flashinfer --attach 2>&1 | tail -3 | tee $OUT/attach.log
  KILN_FLASHINFER_BUNDLE=$PWD/$KIT/flashinfer within ${FLASHINFER_TESTS_SECONDS:-120} python3 -m pytest -q -rs \
    -p no:cacheprovider tests/gpu/test_flashinfer_gpu.py 2>&1 | tee $OUT/tests_flashinfer.log
}
stage_prefill_profile() {    # a 2,048-token prefill step of each artifact, kernel by kernel (CUPTI): attention's share
  for d in $(artifacts | grep /bfloat16); do
    within ${PROFILE_SECONDS:-60} python3 bench/step_profile.py $d --step prefill --tokens 2048 --top 8 2>&1 \
      | tee -a $OUT/prefill_profile.md
  done
}
stage_lora() {         # each shape's bfloat16 artifact beside its LoRA one: batch 32 on no, one, and 8 adapters
  for shape in $(ls -d $KIT/*/bfloat16-lora8/ | xargs -n1 dirname); do
    within $(( $(left) - 10 )) python3 bench/lora.py --artifacts $shape/bfloat16 $shape/bfloat16-lora8 \
      --model $shape/model --workdir /tmp/lora ${LORA_ARGS:---batch 32 --adapters 8 --prompt-len 128 --new-tokens 64} \
      2>&1 | tee -a $OUT/lora_gpu.md
  done
}
stage_decode() {
  within $(( $(left) - 10 )) python3 bench/decode_gpu.py $(artifacts) \\
    ${DECODE_ARGS:---new-tokens 64 --no-hf-compiled} 2>&1 | tee $OUT/decode_gpu.md
}
for stage in ${STAGES:-@STAGES@}; do echo "== $stage: $(left) s left"; stage_$stage; done
"""
STAGES = {"plain": "tests weights decode", "serve": "tests serve_tests weights serve speculative decode",
          "gemm": "tests gemm weights prefill decode", "gemv": "tests gemv weights profile decode",
          "attention": "tests weights windows longctx moe_mla",
          "flashinfer": "flashinfer_tests weights prefill speculative prefill_profile serve",
          "lora": "tests weights lora"}

FAMILIES_SH = """#!/bin/bash
# On the GPU machine, from the repository root:  bash KIT/run.sh KIT [SECONDS]
set -o pipefail
KIT=${1:?kit folder}; BUDGET=${2:-240}
export PYTHONPATH=$PWD/$KIT/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tee $OUT/pip.log || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
timeout $(( BUDGET / 2 )) python3 tests/gpu/make_bundle.py $KIT/bundle --attach 2>&1 | tail -5 \\
  | tee $OUT/attach.log || exit 1
KILN_GPU_BUNDLE=$PWD/$KIT/bundle timeout $(( BUDGET / 2 )) python3 -m pytest -q -rs -p no:cacheprovider \\
  tests/gpu/test_cuda_families.py 2>&1 | tee $OUT/families.log
"""


def pip_download(names: list[str], dest: Path, deps: bool = False) -> list[Path]:
    """Wheels for the device's Python: the named ones alone, or with every dependency pip's resolver picks."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *([] if deps else ["--no-deps"]), *DEVICE_PYTHON,
                    "-d", str(dest), *names], check=True)
    return sorted(dest.glob("*.whl"))


def serve_requirements() -> list[str]:
    """SERVE_PACKAGES as pyproject.toml pins them."""
    import tomllib
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    lists = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    return [req for group, names in SERVE_PACKAGES.items() for req in lists[group]
            if re.match(r"[A-Za-z0-9._-]+", req).group(0).lower() in names]


def make_wheels(out: Path, requirements: list[str]) -> None:
    """out/wheels: the requirements' wheels with their dependencies, and requirements.txt naming them
    (downloaded again only when the requirements change)."""
    wheels, listed = out / "wheels", "\n".join(requirements) + "\n"
    if (wheels / "requirements.txt").exists() and (wheels / "requirements.txt").read_text() == listed:
        return
    shutil.rmtree(wheels, ignore_errors=True)
    pip_download(requirements, wheels, deps=True)
    (wheels / "requirements.txt").write_text(listed)


def make_site(out: Path, wheels: list[str]) -> None:
    """out/site: the device Python's wheels unpacked, less what SKIP names (made once)."""
    if not (out / "site" / "tvm").exists():
        for wheel in pip_download(wheels, out / ".wheels"):
            unpack(wheel, out / "site")
        shutil.rmtree(out / ".wheels")


def print_sizes(out: Path) -> None:
    """The kit's size and each part's: a device call carries at most 64 MiB."""
    print(f"{out}: {folder_bytes(out) / 2**20:.1f} MiB")
    for part in sorted(p for p in out.iterdir() if p.is_dir()):
        print(f"  {part.name:<14} {folder_bytes(part) / 2**20:7.1f} MiB")


def unpack(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if not member.startswith(SKIP):
                z.extract(member, site)


def compile_artifact(model: Path, out: Path, arch: str, flags: list[str]) -> None:
    # each CUDA compile runs in its own process: the CUDA loader must be set up before TVM loads
    subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model), "--target", "cuda", "--arch", arch,
                    *flags, "--no-weights", "-o", str(out), "--force"], check=True)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    from kiln.testing.tiny import PRESETS, make_config_only_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="default: build/gpu-kit (--families: build/gpu-kit-families)")
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"],
                    choices=[p for p in PRESETS if p != "tiny"])
    ap.add_argument("--modes", nargs="+", default=["bfloat16", "q8", "q4", "fp8"], choices=list(MODES))
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--serve", action="store_true",
                    help="add the HTTP server's wheels, its test and its benchmark (bench/serve_gpu.py)")
    ap.add_argument("--families", action="store_true", help="a kit for tests/gpu/test_cuda_families.py alone")
    ap.add_argument("--gemm", action="store_true",
                    help="add the tensor-core GEMM kernels (bench/gemm_gpu.py build) and the gemm and prefill stages")
    ap.add_argument("--gemv", action="store_true",
                    help="add the decode GEMV kernels (bench/gemv_gpu.py build) and the gemv and profile stages")
    ap.add_argument("--flashinfer", action="store_true",
                    help="--attention flashinfer artifacts beside bfloat16 ones (modes bfloat16 bfloat16-flashinfer), "
                         "tests/gpu/test_flashinfer_gpu.py's bundle, and the prefill, verify-cost and serve stages")
    ap.add_argument("--attention", action="store_true",
                    help="the windows and longctx stages (kiln's GPU attention beside TVM's, long contexts)")
    ap.add_argument("--lora", action="store_true",
                    help="LoRA artifacts beside bfloat16 ones (modes bfloat16 bfloat16-lora8) and the lora stage")
    args = ap.parse_args()
    if args.flashinfer:
        args.modes, args.serve = ["bfloat16", "bfloat16-flashinfer"], True
    if args.lora:
        args.modes = ["bfloat16", "bfloat16-lora8"]
    out: Path = args.out or Path("build/gpu-kit-flashinfer" if args.flashinfer else
                                 "build/gpu-kit-families" if args.families else "build/gpu-kit-gemm" if args.gemm
                                 else "build/gpu-kit-gemv" if args.gemv else "build/gpu-kit-attention" if args.attention
                                 else "build/gpu-kit-lora" if args.lora else "build/gpu-kit")
    out.mkdir(parents=True, exist_ok=True)

    if args.serve and "bfloat16" not in args.modes:
        ap.error("--serve measures the first shape's bfloat16 artifact: name bfloat16 in --modes")
    make_site(out, RUNTIME_WHEELS)
    if args.serve:
        make_wheels(out, serve_requirements())
    if args.families:
        from kiln.testing.tiny import FAMILIES
        families = ",".join(sorted(set(FAMILIES) - {"llama"}))      # llama: the other GPU tests
        if not (out / "bundle" / "families").exists():
            subprocess.run([sys.executable, "tests/gpu/make_bundle.py", str(out / "bundle"), "--arch", args.arch,
                            "--variants", "", "--families", families, "--families-without-weights"], check=True)
        (out / "run.sh").write_text(FAMILIES_SH)
        return print_sizes(out)
    if args.gemm and not (out / "gemm" / "kernels.json").exists():
        subprocess.run([sys.executable, "bench/gemm_gpu.py", "build", str(out / "gemm"), "--arch", args.arch],
                       check=True)
    if args.gemv and not (out / "gemv" / "kernels.json").exists():
        subprocess.run([sys.executable, "bench/gemv_gpu.py", "build", str(out / "gemv"), "--arch", args.arch],
                       check=True)
    if args.flashinfer and not (out / "flashinfer" / "deepseek_v2" / "cuda-flashinfer" / "manifest.json").exists():
        subprocess.run([sys.executable, "tests/gpu/test_flashinfer_gpu.py", str(out / "flashinfer"), args.arch],
                       check=True)
    elif not args.flashinfer and not (out / "bundle" / "cuda-q4").exists():
        subprocess.run([sys.executable, "tests/gpu/make_bundle.py", str(out / "bundle"), "--arch", args.arch,
                        "--without-weights"], check=True)
    for shape in args.shapes:
        family, overrides = PRESETS[shape]
        model = out / shape / "model"
        if not (model / "config.json").exists():
            shutil.rmtree(model, ignore_errors=True)
            make_config_only_model(model, family, **overrides)
        for mode in args.modes:
            if not (out / shape / mode / "manifest.json").exists():
                compile_artifact(model, out / shape / mode, args.arch, MODES[mode])
    kind = ("flashinfer" if args.flashinfer else "gemm" if args.gemm else "gemv" if args.gemv else "attention"
            if args.attention else "lora" if args.lora else "serve" if args.serve else "plain")
    (out / "run.sh").write_text(RUN_SH.replace("@STAGES@", STAGES[kind]))
    print_sizes(out)


if __name__ == "__main__":
    main()
