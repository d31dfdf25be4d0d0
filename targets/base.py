"""What a target is: its TVM target, page size, dtypes, schedules, kernel order and how it builds.

Adding a target is adding one small file with a subclass of Target.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.selection.order import CPU_KERNELS, GPU_KERNELS, KernelOrder


@dataclass
class Target:
    name: str = ""
    arch: str | None = None
    device: str = "cpu"              # the runtime device kind the artifact runs on
    thread_blocks: bool = False      # kernels bind thread blocks and threads (GPUs), not loops over cores
    page_size: int = 16              # rows per KV page (TVM's paged attention kernels are tuned for 16)
    default_dtype: str = "float32"
    dtypes: tuple[str, ...] = ("float32",)
    runs_here: bool = True           # False where this machine cannot execute the artifact
    note: str = ""                   # what the manifest should tell about where/how the artifact runs
    kernels: KernelOrder = CPU_KERNELS      # its kernels in order of preference (selection/order.py)
    kv_dtypes: tuple[str, ...] = ()  # quantised KV caches its attention kernel reads (ir/quant.py KV_SCHEMES)
    graph_batches: tuple[int, ...] = ()   # decode batch buckets replayed as CUDA graphs (none: no graphs)
    link_options: tuple[str, ...] = ()    # the library's link: what linked external objects call (FlashInfer's: cudart)
    device_sampling: bool = False    # compile the sampler into the artifact (codegen/lowering/sampling.py)
    # MLA prefill steps whose every sequence brings at least this many new tokens run the expanded
    # form (passes/specialize_mla.py); 0: the absorbed form in every step
    mla_expanded_from: int = 0
    # where packed linears run the GEMM in steps that bring chunks and the GEMV in decode steps (the
    # "decode" entry): decode steps of at least this many sequences run the mixed entry (its GEMMs
    # beat the GEMV from there); 0: every decode step runs the decode entry
    decode_gemm_from: int = 0
    # decode steps of at least this many sequences run the linears of steps that bring chunks (on
    # CUDA: tensor cores), in a "decode_wide" entry; 0: decode steps keep the GEMV
    decode_mma_from: int = 0
    # > 0: q8/q4 linears quantise their input rows to int8 in blocks of this many inputs and
    # multiply in integer dot products (codegen/kernels/cpu/int8_gemm.py); 0: float activations
    activation_block: int = 0
    # the matrix tiles a CPU's kernels may use: "amx" (Intel AMX, asked of the OS at run time), "emulated"
    # (tests: the same kernels with each tile instruction a scalar function), "" none
    tiles: str = ""

    @classmethod
    def as_planned(cls, arch: str | None, activation_block: int):
        """This target with a manifest's arch and activation block (targets/__init__.py: planned_target)."""
        return cls(arch=arch, activation_block=activation_block)

    def tvm_target(self):
        raise NotImplementedError

    @property
    def library_name(self) -> str:
        return f"model.{self.name}.so"

    def check_dtype(self, dtype: str) -> None:
        if dtype not in self.dtypes:
            raise KilnError(f"dtype {dtype} is not supported on target {self.name} (supported: {', '.join(self.dtypes)})")

    def weight_quants(self) -> tuple[str, ...]:
        """Weight quantisation schemes (ir/quant.py SCHEMES) this target's linear kernels read."""
        return ("q8", "q4")

    def check_quant(self, quant: str | None, kv_dtype: str | None) -> None:
        if quant and quant not in self.weight_quants():
            raise KilnError(f"--quant {quant} is not supported on target {self.name}"
                            f"{f' ({self.arch})' if self.arch else ''} (supported: {', '.join(self.weight_quants())})")
        if kv_dtype and kv_dtype not in self.kv_dtypes:
            supported = ", ".join(self.kv_dtypes) or "none: its attention kernel reads only unquantised pages"
            raise KilnError(f"--kv-dtype {kv_dtype} is not supported on target {self.name} (supported: {supported})")

    # -- lowering to machine code ------------------------------------------------------------
    def relax_pipeline(self):
        raise NotImplementedError

    def pass_config(self) -> dict:
        """TVM PassContext settings the Relax pipeline runs under."""
        return {}

    def build(self, mod):
        """Compile a module whose Relax pipeline has already run into a VM executable."""
        import tvm
        target = self.tvm_target()
        with target:
            return tvm.compile(mod, target=target, relax_pipeline=None)

    def export_library(self, executable, path: str) -> None:
        """Write the built library (host code + device code) as one shared library at `path`, linked
        with `link_options` (the libraries external objects call)."""
        if self.link_options:
            executable.export_library(path, options=list(self.link_options))
        else:
            executable.export_library(path)


@dataclass
class GPUTarget(Target):
    """What every GPU target shares: half-precision default, dlight-scheduled TE kernels with weights
    as transformers stores them, TVM's paged attention kernels (selection/order.py GPU_KERNELS), and
    an arch check."""
    default_dtype: str = "float16"
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")
    runs_here: bool = False
    thread_blocks: bool = True
    device_sampling: bool = True     # the logits stay where they are made; only token ids come back
    kernels: KernelOrder = GPU_KERNELS
    ARCHS = ()                       # the --arch values this GPU kind accepts (a class attribute)

    def __post_init__(self):
        if self.arch not in self.ARCHS:
            raise KilnError(f"{self.name} arch {self.arch!r} is not supported "
                            f"(supported: {', '.join(self.ARCHS)})")

    def relax_pipeline(self):
        from tvm import relax
        return relax.get_default_pipeline(self.tvm_target())
