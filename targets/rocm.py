"""AMD GPUs (CDNA: MI200 gfx90a, MI300 gfx942) through TVM's LLVM AMDGPU codegen; kernels scheduled by dlight.

Built here, runs on an AMD GPU. TVM's codegen emits AMDGCN with its bundled LLVM, links in the
ROCm device library bitcode (ocml/oclc: exp, rsqrt, ...), and hands the object to a callback that
links it into an HSA code object (an AMDGPU ELF) which is embedded in the exported .so. TVM's own
callbacks look for a full ROCm install under /opt/rocm; kiln registers its own callbacks that need
only two small Debian packages (`make rocm-deps`):
  lld-22            ld.lld of the same LLVM major as TVM's (22), links the code object;
  rocm-device-libs  the device bitcode, in /usr/lib/<multiarch>/amdgcn/bitcode.
Running needs a TVM runtime built with USE_ROCM=ON on the GPU machine; the PyPI wheel has it off.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

from .base import GPUTarget

ARCHS = ("gfx90a", "gfx942")
TVM_LLVM_MAJOR = 22             # the LLVM bundled in apache-tvm 0.27 (tvm.target.codegen.llvm_version_major())
ROCM_PATH = os.environ.get("ROCM_PATH", "/opt/rocm")               # ROCm's own convention
BITCODE_DIRS = [f"{ROCM_PATH}/amdgcn/bitcode", *sorted(glob.glob("/usr/lib/*/amdgcn/bitcode"))]  # ROCm, Debian
# One variant of each oclc control library (each defines one constant that ocml's code branches on).
# Correct-by-default: keep denormals, IEEE sqrt, no finite-only / unsafe-math shortcuts.
OCLC_OPTIONS = ("daz_opt_off", "correctly_rounded_sqrt_on", "finite_only_off", "unsafe_math_off",
                "wavefrontsize64_on", "abi_version_500")    # CDNA runs 64-wide waves
# LLVM 22 defaults to code object v6, which only recent ROCm runtimes load; v5 loads on ROCm 5.x and 6.x.
# TVM's rocm target has no LLVM option passthrough, so this module flag travels as one more "bitcode"
# file that TVM links into every kernel module (TVM parses .ll text as well as .bc).
CODE_OBJECT_V5 = """!llvm.module.flags = !{!0}
!0 = !{i32 1, !"amdhsa_code_object_version", i32 500}
"""


def find_lld() -> str | None:
    for name in (f"ld.lld-{TVM_LLVM_MAJOR}", "ld.lld", f"/usr/lib/llvm-{TVM_LLVM_MAJOR}/bin/ld.lld",
                 f"{ROCM_PATH}/llvm/bin/ld.lld"):
        if path := shutil.which(name):
            return path
    return None


def find_bitcode_dir() -> Path | None:
    for d in BITCODE_DIRS:
        if (Path(d) / "ocml.bc").exists():
            return Path(d)
    return None


def missing_tools() -> list[str]:
    """What this machine lacks to build a ROCm code object (empty when it can)."""
    missing = []
    if find_lld() is None:
        missing.append(f"ld.lld (Debian: apt-get install lld-{TVM_LLVM_MAJOR})")
    if find_bitcode_dir() is None:
        missing.append("the ROCm device bitcode ocml.bc (Debian: apt-get install rocm-device-libs; "
                       f"or a ROCm install at $ROCM_PATH, now {ROCM_PATH})")
    return missing


def require_tools() -> None:
    if missing := missing_tools():
        raise KilnError("cannot build a ROCm code object: missing " + "; ".join(missing)
                        + " (`make rocm-deps` installs both)")


def bitcode_files(arch: str, bitcode_dir: Path) -> list[str]:
    """ocml plus the oclc libraries that fix its options and ISA version for `arch`."""
    files = [bitcode_dir / "ocml.bc"] + [bitcode_dir / f"oclc_{o}.bc" for o in OCLC_OPTIONS]
    # Older device libs lack the newest ISA files (Debian's 5.2 has 940, not 942): take the
    # nearest lower version of the same family; ocml only compares it against thresholds.
    want = arch.removeprefix("gfx")
    have = sorted((p.stem.removeprefix("oclc_isa_version_") for p in bitcode_dir.glob("oclc_isa_version_*.bc")),
                  key=lambda v: (len(v), v))
    same_family = [v for v in have if len(v) == len(want) and v[0] == want[0] and v <= want]
    if not same_family:
        raise KilnError(f"{bitcode_dir} has no oclc_isa_version file usable for {arch}")
    files.append(bitcode_dir / f"oclc_isa_version_{same_family[-1]}.bc")
    for f in files:
        if not f.exists():
            raise KilnError(f"ROCm device bitcode {f} is missing (a newer rocm-device-libs provides it)")
    return [str(f) for f in files]


def link_code_object(obj: bytes, lld: str) -> bytes:
    """Relocatable AMDGPU object -> HSA code object (a shared ELF), as the ROCm runtime loads it."""
    with tempfile.TemporaryDirectory(prefix="kiln-rocm-") as tmp:
        src, out = Path(tmp) / "kernels.o", Path(tmp) / "kernels.co"
        src.write_bytes(obj)
        # --no-undefined: an unresolved device function would otherwise surface only at load time on the GPU.
        proc = subprocess.run([lld, "--no-undefined", "-shared", str(src), "-o", str(out)],
                              check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            raise KilnError(f"linking the ROCm code object with {lld} failed:\n{proc.stdout}{proc.stderr}")
        return out.read_bytes()


@contextmanager
def tvm_callbacks(**funcs):
    """Register TVM's named callbacks for one build, then put back the ones they replaced."""
    import tvm_ffi
    saved = {name: tvm_ffi.get_global_func(name, allow_missing=True) for name in funcs}
    for name, f in funcs.items():
        tvm_ffi.register_global_func(name, f, override=True)
    try:
        yield
    finally:
        for name, f in saved.items():
            if f is not None:
                tvm_ffi.register_global_func(name, f, override=True)


@dataclass
class ROCmTarget(GPUTarget):
    name: str = "rocm"
    arch: str | None = "gfx942"
    device: str = "rocm"
    # the device sampler's float64 exp has no AMDGPU lowering in this LLVM: logits go to the host
    device_sampling: bool = False

    ARCHS = ARCHS

    def __post_init__(self):
        super().__post_init__()
        self.note = (f"kernels are an HSA code object (AMDGPU ELF, code object v5) for {self.arch}; "
                     "loading it needs a TVM runtime built with ROCm (USE_ROCM=ON)")

    def tvm_target(self):
        import tvm
        # CDNA: 64-wide wavefronts, 64 KiB LDS. The hardware allows 1024 work-items per group, but
        # without a GPU to ask, TVM's codegen marks every kernel amdgpu-flat-work-group-size 1..256,
        # so schedules must not use more than 256 threads.
        return tvm.target.Target({"kind": "rocm", "mcpu": self.arch, "mtriple": "amdgcn-amd-amdhsa-hcc",
                                  "thread_warp_size": 64, "max_shared_memory_per_block": 65536,
                                  "max_threads_per_block": 256, "host": {"kind": "llvm"}})

    def build(self, mod):
        require_tools()
        lld, bitcode = find_lld(), bitcode_files(self.arch, find_bitcode_dir())
        with tempfile.TemporaryDirectory(prefix="kiln-rocm-") as tmp:
            cov5 = Path(tmp) / "code_object_v5.ll"
            cov5.write_text(CODE_OBJECT_V5)
            # TVM's codegen calls these by name (the first with no arguments, so the arch is bound
            # here); kiln's replace TVM's /opt/rocm lookups (tvm.support.rocm) for this build.
            with tvm_callbacks(tvm_callback_rocm_bitcode_path=lambda *_: bitcode + [str(cov5)],
                               tvm_callback_rocm_link=lambda obj: link_code_object(bytes(obj), lld)):
                return super().build(mod)


TARGET_CLASS = ROCmTarget


def make_target(arch: str | None) -> ROCmTarget:
    target = ROCmTarget(arch=arch or "gfx942")
    require_tools()            # fail before the import and codegen phases, not after
    return target
