"""Build, on this machine, what a bigger CPU machine (the GPU machine's host) needs to measure how
kiln's CPU kernels scale with threads beside llama.cpp (bench/threads_cpu.py).

    python bench/cpu_kit.py [--out build/cpu-kit] [--preset llama-3.2-1b] [--modes bf16 q8 q4]
                            [--arch CPU] [--llama-cpp build/peers/llama_cpp_python-*/vendor/llama.cpp | none]

That machine has PyTorch and transformers but no TVM compiler, no llama.cpp and no internet, and
takes at most 64 MiB per transfer:
  site/         TVM's runtime (bench/gpu_kit.py), for the device's Python 3.12
  cpu/<mode>/   the preset's CPU artifacts, compiled with --no-weights for --arch (LLVM's name of
                that machine's CPU model, e.g. emeraldrapids; default: this machine's CPU). An
                artifact checks at load that the CPU it runs on has every instruction set it uses
  llama.cpp/    llama.cpp's built binaries and libraries (with OpenMP's), its GGUF converter and
                gguf-py, as ../shared/PEERS.md builds them (--llama-cpp none: left out, kiln alone)
  run.sh        installs kiln, draws the weights and runs bench/threads_cpu.py; results go to $OUT
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from big_model import MODES, built_llama_cpp  # noqa: E402
from gpu_kit import RUNTIME_WHEELS, make_site, print_sizes  # noqa: E402

# llama.cpp's system libraries that a machine without a compiler may lack (OpenSSL 3, which it also
# loads, is part of the GPU machine's Ubuntu 24.04: run.sh checks with ldd and runs kiln alone if not)
SYSTEM_LIBS = ("libgomp.so.1",)

RUN_SH = """#!/bin/bash
# On the bigger machine, from the repository root:  bash KIT/run.sh KIT [SECONDS] [THREADS] [MODES]
set -o pipefail
KIT=${1:?kit folder}; BUDGET=${2:-400}; THREADS=${3:-1,2,4,8,16}; MODES=${4:-$(ls $KIT/cpu | paste -sd,)}
export PYTHONPATH=$PWD/$KIT/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=$PWD/$KIT/llama.cpp/build/bin:${LD_LIBRARY_PATH:-}
mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tee $OUT/pip.log || exit 1
(lscpu; free -g) > $OUT/cpu.txt
for m in ${MODES//,/ }; do timeout 120 python3 -m kiln.cli fill-weights $KIT/cpu/$m --seed 0 --force || exit 1; done
PEER=$KIT/llama.cpp
if [ ! -x $PEER/build/bin/llama-bench ] || ldd $PEER/build/bin/llama-bench | grep "not found"; then PEER=none; fi
timeout $BUDGET python3 bench/threads_cpu.py --artifacts $KIT/cpu --llama-cpp $PEER --threads $THREADS \\
  --modes $MODES --workdir /tmp/threads-work 2>&1 | tee $OUT/threads_cpu.md
"""


def copy_llama_cpp(source: Path, dest: Path) -> None:
    """The built binaries and libraries, the converter and gguf-py: what bench/big_model.py runs."""
    bin_dir = dest / "build" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    # each library once, under the name the binaries load (libllama.so.0, not its links): a
    # device call may not carry links
    for f in (source / "build" / "bin").iterdir():
        if re.search(r"\.so\.\d+\.", f.name) or (f.is_symlink() and f.name.endswith(".so")):
            continue
        shutil.copy2(f.resolve(), bin_dir / f.name)
    for lib in SYSTEM_LIBS:
        shutil.copy2(Path("/lib/x86_64-linux-gnu") / lib, bin_dir / lib)
    for part in ("conversion", "gguf-py"):
        shutil.copytree(source / part, dest / part, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "tests"))
    shutil.copy2(source / "convert_hf_to_gguf.py", dest / "convert_hf_to_gguf.py")


def main() -> None:
    from kiln.testing.tiny import preset_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/cpu-kit"))
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--modes", nargs="+", default=["bf16", "q8", "q4"], choices=list(MODES))
    ap.add_argument("--arch", default=None, help="the CPU model to compile for, by LLVM's name")
    ap.add_argument("--llama-cpp", default=None)
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    make_site(out, RUNTIME_WHEELS)
    if args.llama_cpp != "none" and not (out / "llama.cpp" / "build" / "bin" / "llama-bench").exists():
        copy_llama_cpp(built_llama_cpp(args.llama_cpp), out / "llama.cpp")
    model = preset_model(args.preset, Path("build/bench") / args.preset / "model")
    for mode in args.modes:
        if not (out / "cpu" / mode / "manifest.json").exists():
            dtype, quant = MODES[mode]
            subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model), "--target", "cpu",
                            *(["--arch", args.arch] if args.arch else []), "--dtype", dtype,
                            *(["--quant", quant] if quant else []), "--no-weights", "-o", str(out / "cpu" / mode),
                            "--force"], check=True)
    (out / "run.sh").write_text(RUN_SH)
    print_sizes(out)


if __name__ == "__main__":
    main()
