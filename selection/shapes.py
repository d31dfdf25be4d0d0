"""What each of kiln's own linear kernels takes: activations, stored weights and shapes, as plain
predicates. The kernel records (selection/linear.py, experts.py) ask them before a kernel is chosen;
codegen's kernels (codegen/kernels/cpu, gpu) import them to refuse what they cannot run, so the two
never disagree."""
from __future__ import annotations

from kiln.ir.quant import SCHEMES

from .formats import WeightFormat

# -- CUDA -------------------------------------------------------------------------------------------
MMA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")      # mma.sync for bf16 and fp16
HOPPER_ARCHS = ("sm_90", "sm_90a")                              # wgmma and TMA (built for sm_90a)
HOPPER_TILE_K = 64                  # every Hopper GEMM tile's inputs (selection/tiles.py HOPPER_CANDIDATES)
HALF_DTYPES = ("bfloat16", "float16")                           # the activations kiln's CUDA linears take
# the stored weight each format's kernels read (WeightFormat kinds; "float": the activations' dtype)
STORED = {"q8": "int8", "fp8": "float8_e4m3fn", "q4": "uint8", "q4a": "uint8", "q4k": "uint8"}
WEIGHT_BITS = {"float": 16, "q8": 8, "fp8": 8, "q4": 4, "q4a": 4, "q4k": 4}      # bits a stored input takes
NIBBLE_FORMATS = ("q4", "q4a", "q4k")                            # nibbles in groups (q4a, q4k: with minimums)
CHUNK_BYTES = 16                                                # the GEMV's loads: 16 bytes of a weight row


def stored_dtype(weight: str, dtype: str) -> str:
    return STORED.get(weight, dtype)


def inputs_per_chunk(weight: str) -> int:
    """Inputs one 16-byte load of a stored weight row covers: 8 (float), 16 (q8, fp8), 32 (4-bit)."""
    return CHUNK_BYTES * 8 // WEIGHT_BITS[weight]


def mma_takes(arch: str | None, dtype: str, weight_dtype: str, n_out: int, n_in: int, tiles,
              weight: str = "float", group_size: int = 0) -> bool:
    """Whether the tensor-core kernel (codegen/kernels/gpu/mma_gemm.py) takes this linear in `tiles`
    ((rows, TileConfig) pairs, selection/tiles.py): bf16/fp16 activations on sm_80+ with weights of
    their dtype, or int8 / e4m3 levels with a scale per output, or nibbles (q4, q4a, q4k) in groups of a
    multiple of 16 inputs; every output tile whole and the inputs a whole number of input tiles."""
    return (arch in MMA_ARCHS and dtype in HALF_DTYPES and weight_dtype == stored_dtype(weight, dtype)
            and _groups_take(weight, group_size, 16, n_in)
            and all(n_out % t.bn == 0 and n_in % t.bk == 0 for _, t in tiles))


def wgmma_takes(arch: str | None, dtype: str, weight_dtype: str, n_out: int, n_in: int,
                weight: str = "float", group_size: int = 0) -> bool:
    """Whether the Hopper GEMM (codegen/kernels/gpu/hopper_gemm.cu) takes this linear: bf16/fp16
    activations on sm_90 with weights of their dtype, or q4 in groups of a multiple of its K tile
    (CUTLASS's mixed-input main loop loads a group's scales once per K tile); its rows (inputs) and
    outputs whole 16-byte lines, which TMA moves."""
    line = CHUNK_BYTES // 2
    form = weight == "float" or weight == "q4" and group_size % HOPPER_TILE_K == 0 and n_in % group_size == 0
    return (arch in HOPPER_ARCHS and dtype in HALF_DTYPES and form and weight_dtype == stored_dtype(weight, dtype)
            and n_in % line == 0 and n_out % line == 0)


def gemv_takes(dtype: str, weight_dtype: str, n_out: int, n_in: int, weight: str = "float", group_size: int = 0,
               activation: str | None = None) -> bool:
    """Whether the streaming GEMV (codegen/kernels/gpu/gemv.py) takes this linear: bf16/fp16
    activations, weights of their dtype or q8, fp8, nibbles (q4, q4a, q4k) in groups of a multiple of 32
    (a chunk in one group); rows whole 16-byte chunks; a gated one's outputs in pairs."""
    return (dtype in HALF_DTYPES and weight_dtype == stored_dtype(weight, dtype) and n_in % inputs_per_chunk(weight) == 0
            and _groups_take(weight, group_size, 32, n_in) and (not activation or n_out % 2 == 0))


def _groups_take(weight: str, group_size: int, multiple: int, n_in: int) -> bool:
    """A nibble format's groups (and super-blocks) a multiple of `multiple` inputs and whole in n_in."""
    return weight not in NIBBLE_FORMATS or group_size % multiple == 0 and SCHEMES[weight].holds(n_in, group_size)


# -- x86 CPUs ---------------------------------------------------------------------------------------
VNNI_LANES = 16          # int32 lanes of a 512-bit register: the VNNI kernel's 16 output columns
QUAD = 4                 # stored bytes per column in a row of the VNNI layout (vpdpbusd's quads)
INT8_GEMV_GROUP = 16     # the int8 GEMV's output columns per step: 16 int16 lanes (q4), two pair dots (q8)
TILE_BF16_INPUTS = 32    # inputs one AMX tdpbf16ps reduces over (a tile row of 32 bf16)
TILE_INT8_BLOCKS = (32, 64)   # activation blocks one AMX tdpbssd takes: a tile row of at most 64 bytes


def tile_int8_takes(fmt: WeightFormat) -> bool:
    """Whether the VNNI kernel's tiles (codegen/kernels/cpu/vnni_linear.py) take a format: int8 activation
    blocks of a tile row's bytes."""
    return fmt.int8_levels and fmt.act_block in TILE_INT8_BLOCKS


def tile_bf16_takes(n_in: int, nb: int) -> bool:
    """Whether the bf16 kernel with AMX tiles (codegen/kernels/cpu/bf16_linear.py) takes panels of nb
    columns (whole 16-column tiles) over n_in inputs (whole tile rows)."""
    return nb % VNNI_LANES == 0 and n_in % TILE_BF16_INPUTS == 0


def vnni_takes(n_out: int, n_in: int, nb: int, fmt: WeightFormat) -> bool:
    """Whether the VNNI kernel (codegen/kernels/cpu/vnni_linear.py) takes q8/q4 weights in panels of
    `nb` columns with int8 activations in `fmt.act_block`s: blocks of whole stored rows."""
    paired = 2 if fmt.nibbles else 1                 # blocks whose inputs share stored bytes
    return (fmt.int8_levels and fmt.act_block % QUAD == 0 and n_in % (paired * fmt.act_block) == 0
            and nb % VNNI_LANES == 0)


def int8_gemv_takes(n_out: int, n_in: int, nb: int, fmt: WeightFormat) -> bool:
    """Whether the AVX2 int8 GEMV (codegen/kernels/cpu/int8_gemv.py) takes this linear (else the int8
    GEMM serves decode steps too)."""
    run = 4 if fmt.nibbles else 2
    return nb % INT8_GEMV_GROUP == 0 and fmt.act_block % run == 0 and fmt.int8_levels
