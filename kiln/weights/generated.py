"""`kiln fill-weights`: seeded random weights for an artifact compiled with `--no-weights`.

A benchmark machine may take only small transfers, so a multi-GB artifact travels without its
weights file and the weights are written there, from the manifest's list of stored weights alone
(name, param, shape, dtype): one tensor per entry, in manifest order, in the file format compile
writes (aligned safetensors, float8 as its bytes), hashed with BLAKE3 as it is written. This needs
only NumPy, blake3 and kiln's safetensors writer: no TVM, no torch, no checkpoint.

Values are random bits under a mask, not draws from a normal distribution, so that making them
costs little more than drawing random bits (about 2 GiB/s per core). Each kind of stored tensor
keeps a real model numerically sane:
- a float matrix or bias: random sign and mantissa, exponent one of two octaves, so
  |w| lies in [2^-7, 2^-5): mean 0, std 0.019;
- a norm weight (1-D, "norm" in its param's name): 1 + [0, 1/16);
- q8 codes: int8 uniform in [-127, 127]; q4 codes: each nibble a q in [-7, 7] (stored q + 8; a
  drawn -8 becomes 0, so the mean stays 0); fp8 codes: float8 e4m3 in ±[32, 128), never NaN;
- scales (what ir/quant.py calls a scheme's "scale" part): 0.02 / the codes' RMS, times a factor in
  [0.75, 1.25] per scale, so that dequantised weights have std about 0.02; q4a's and q4k's tables
  (levels 0..15 with a minimum per group) are set by row instead, each group's minimum -7.5 of its
  scale, so that every group is centred whichever chunk draws its rows;
- rope's inverse frequencies, which compile computes from the config: computed the same way;
- a tensor stored from the same param as another in a layout that computes it (q4's zeros for the
  Hopper GEMM: its scales times -8): computed from that tensor's draw.

Every tensor is cut into CHUNK_BYTES pieces, each drawn by its own generator seeded by (seed, tensor
index, chunk index): the file depends on the seed alone, not on the number of threads. The chunks
run on every core (NumPy's generators release the GIL) and the next tensor is drawn while this one
is written.

The manifest says where the weights came from: `weights_source` is "checkpoint" (compile),
"absent" (compile --no-weights) or "generated" (here; the weights file's entry in `files` then
carries `"generated": {"seed": N}`). Weights from a checkpoint are never replaced, generated ones
only when asked to (`force`), and a weights file not written here never.
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kiln.artifact import MANIFEST, WEIGHTS, new_hasher, read_manifest, save_manifest, write_in_place
from kiln.errors import KilnError
from kiln.interface import Manifest, StoredWeight
from kiln.ir.quant import SCHEMES
from kiln.ir.types import numpy_dtype
from kiln.safetensors_io import TensorSpec, read_header, write_safetensors
from kiln.selection.layouts import Q4_ZEROS, Q4_ZEROS_GATED, apply_layout

ZEROS_LAYOUTS = (Q4_ZEROS, Q4_ZEROS_GATED)      # computed from the param's drawn scales

GENERATOR = "kiln fill-weights"         # in the weights file's metadata: the mark of a file written here
CHUNK_BYTES = 8 << 20                   # fixed: the bytes depend on it (and not on the thread count)
WEIGHT_STD = 0.02
SCALE_JITTER = (0.75, 1.25)
PROGRESS_BYTES = 256 << 20              # weights smaller than this are written without progress reports

# fills one flat chunk of a tensor, given the flat index of its first element
Filler = Callable[[np.random.Generator, np.ndarray, int], None]


@dataclass(frozen=True)
class FloatFormat:
    """A binary float format, for building bit patterns: total bits, mantissa bits, exponent bias."""
    bits: int
    mantissa_bits: int
    bias: int

    def two_octaves(self, low_exponent: int) -> tuple[int, int]:
        """(mask, base) for ±[2^low, 2^(low + 2)): sign, lowest exponent bit and mantissa drawn."""
        if (self.bias + low_exponent) % 2:
            raise ValueError("the low octave's exponent field must be even")
        sign, mantissa = 1 << (self.bits - 1), (1 << self.mantissa_bits) - 1
        return sign | (1 << self.mantissa_bits) | mantissa, (self.bias + low_exponent) << self.mantissa_bits

    def near_one(self) -> tuple[int, int]:
        """(mask, base) for [1, 1 + 1/16): the mantissa's bits below 1/16 drawn."""
        return (1 << (self.mantissa_bits - 4)) - 1, self.bias << self.mantissa_bits


FORMATS = {"float32": FloatFormat(32, 23, 127), "float16": FloatFormat(16, 10, 15),
           "bfloat16": FloatFormat(16, 7, 127), "float8_e4m3fn": FloatFormat(8, 3, 7)}
WEIGHT_OCTAVE = -7          # floats in ±[2^-7, 2^-5)
FP8_OCTAVE = 5              # fp8 codes in ±[32, 128): the top exponent (NaN's) is never drawn


def two_octave_rms(low_exponent: int, mantissa_bits: int) -> float:
    """The RMS of `FloatFormat.two_octaves` values: each octave and mantissa equally likely."""
    steps = 2 ** mantissa_bits
    mean_square = np.mean((1 + np.arange(steps) / steps) ** 2) * (1 + 4) / 2
    return float(2.0 ** low_exponent * np.sqrt(mean_square))


# Each scheme's codes: how they are drawn and their RMS (the scale maps it to WEIGHT_STD).
CODE_RMS = {"q8": float(np.sqrt((2 * sum(k * k for k in range(128)) + 127 ** 2) / 256)),   # -128 drawn -> -127
            "q8g": float(np.sqrt((2 * sum(k * k for k in range(128)) + 127 ** 2) / 256)),
            "q4": float(np.sqrt(2 * sum(k * k for k in range(8)) / 16)),                   # -8 drawn -> 0
            "fp8": two_octave_rms(FP8_OCTAVE, FORMATS["float8_e4m3fn"].mantissa_bits)}


def _random_bits(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """`nbytes` random bytes (as uint8)."""
    words = rng.integers(np.iinfo(np.uint64).max, size=-(-nbytes // 8), dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:nbytes]


def bit_pattern(mask: int, base: int) -> Filler:
    """Random bits under `mask`, `base` in the others, in the chunk's own width."""
    def fill(rng, out, start=0):
        bits = out.view(f"uint{out.itemsize * 8}")
        np.bitwise_and(_random_bits(rng, out.nbytes).view(bits.dtype), mask, out=bits)
        np.bitwise_or(bits, base, out=bits)
    return fill


def q8_codes(rng, out, start=0) -> None:
    """int8 uniform in [-127, 127] (a drawn -128 becomes -127)."""
    out[:] = _random_bits(rng, out.nbytes).view(np.int8)
    np.maximum(out, -127, out=out)


def q4_codes(rng, out, start=0) -> None:
    """Two nibbles per byte, each q + 8 for q uniform in [-8, 7], a drawn -8 (nibble 0) made 0 (nibble 8)."""
    out[:] = _random_bits(rng, out.nbytes)
    empty = ~(out | (out >> 1) | (out >> 2) | (out >> 3)) & 0x11     # bit 0 of each nibble that is 0
    out |= empty << 3


def nibble_codes(rng, out, start=0) -> None:
    """Two nibbles per byte, each a level uniform in 0..15 (q4a, q4k: a group's minimum centres them)."""
    out[:] = _random_bits(rng, out.nbytes)


def scales(rms: float) -> Filler:
    """WEIGHT_STD / rms, times a factor drawn uniformly in SCALE_JITTER for each scale."""
    def fill(rng, out, start=0):
        out[:] = (WEIGHT_STD / rms) * rng.uniform(*SCALE_JITTER, size=out.size)
    return fill


CODES = {"q8": q8_codes, "q8g": q8_codes, "q4": q4_codes, "q4a": nibble_codes, "q4k": nibble_codes,
         "fp8": bit_pattern(*FORMATS["float8_e4m3fn"].two_octaves(FP8_OCTAVE))}
CENTRED_STEP = WEIGHT_STD / float(np.sqrt(np.mean((np.arange(16) - 7.5) ** 2)))   # q4a's and q4k's group scale


def by_row(shape: tuple[int, ...], value_of_row: Callable[[np.ndarray], np.ndarray]) -> Filler:
    """A scale table whose every entry is a function of its row ([rows, out], or [panels, rows, nb]
    stored by panel), so that a group's scale and minimum agree wherever the chunks fall."""
    def fill(rng, out, start=0):
        flat = start + np.arange(out.size)
        out[:] = value_of_row(flat // shape[-1] % shape[-2])
    return fill


def _q4a_table(rows: np.ndarray) -> np.ndarray:
    """Each group's scale CENTRED_STEP and minimum -7.5 of them: levels 0..15 centred on 0."""
    return np.where(rows % 2 == 0, CENTRED_STEP, -7.5 * CENTRED_STEP)


def _q4k_table(rows: np.ndarray) -> np.ndarray:
    """Every 6-bit scale and depth 48, d = CENTRED_STEP / 48 and dmin 7.5 times it (ir/quant.py's rows)."""
    from kiln.ir.quant import Q4K_GROUPS, Q4K_ROWS
    factors = np.array([CENTRED_STEP / 48, -7.5 * CENTRED_STEP / 48], np.float16).view(np.uint8)
    within = rows % Q4K_ROWS
    return np.where(within < 2 * Q4K_GROUPS, 48, factors[np.clip(within - 2 * Q4K_GROUPS, 0, 3)])


TABLES = {"q4a": _q4a_table, "q4k": _q4k_table}       # grouped tables filled by row rather than drawn


def filler_for(weight: StoredWeight) -> Filler:
    """How to draw one manifest weight entry, from its param's name, dtype and shape."""
    param, dtype, shape = weight.param, weight.dtype, weight.shape
    part = param.rsplit(".", 1)[-1]                 # quantize names its params @w.q8 and @w.q8_scale
    scheme = SCHEMES.get(part.removesuffix("_scale"))
    if scheme is not None:
        is_scale = part.endswith("_scale")
        # a float16 scale table may be stored in float32 (an ONNX file's scales, kept)
        expected = ((scheme.scale_dtype, "float32") if scheme.scale_dtype == "float16" else (scheme.scale_dtype,)) \
            if is_scale else (scheme.weight_dtype,)
        if dtype not in expected or scheme.name not in CODES:
            raise KilnError(f"fill-weights cannot draw {weight.name}: {dtype}, scheme {scheme.name} "
                            f"(it knows {', '.join(CODES)} with codes and scales as ir/quant.py stores them)")
        if is_scale and scheme.name in TABLES:
            return by_row(shape, TABLES[scheme.name])
        return scales(CODE_RMS[scheme.name]) if is_scale else CODES[scheme.name]
    if dtype not in FORMATS or dtype.startswith("float8"):
        raise KilnError(f"fill-weights cannot draw {weight.name}: a {dtype} tensor that is no quantised part")
    if len(shape) == 1 and "norm" in param:
        return bit_pattern(*FORMATS[dtype].near_one())
    return bit_pattern(*FORMATS[dtype].two_octaves(WEIGHT_OCTAVE))


def computed_weight(weight: StoredWeight, config: dict) -> np.ndarray | None:
    """The value of a weight that compile computes from the model's config rather than reading it
    (rope's inverse frequencies), computed the same way; None for every weight drawn at random."""
    from kiln.frontend.decoder import COMPUTED_PARAMS, DecoderConfig
    if weight.param not in COMPUTED_PARAMS:
        return None
    value = DecoderConfig.from_json(config).computed_weights()[weight.param]()
    if tuple(value.shape) != weight.shape or value.dtype.name != weight.dtype:
        raise KilnError(f"{weight.name} is {weight.dtype}{list(weight.shape)} in the manifest, but the config "
                        f"gives {value.dtype.name}{list(value.shape)}")
    return value


def _storage_dtype(dtype: str) -> str:
    """The dtype a weight has in the file: float8 as its bytes, as compile writes it."""
    return "uint8" if dtype.startswith("float8") else dtype


def _fill_chunk(fill: Filler, seed: int, tensor: int, chunk: int, out: np.ndarray) -> None:
    start = chunk * max(1, CHUNK_BYTES // out.itemsize)              # _chunks' step
    fill(np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(seed, spawn_key=(tensor, chunk)))), out,
         start)


def _chunks(flat: np.ndarray):
    """(chunk index, view) of a flat tensor in CHUNK_BYTES pieces: each is drawn by its own generator."""
    step = max(1, CHUNK_BYTES // flat.itemsize)
    return enumerate(flat[begin:begin + step] for begin in range(0, flat.size, step))


class _Drawer:
    """Draws manifest weights on a thread pool, chunk by chunk, each tensor started one ahead of use.

    Tensors are drawn into two buffers in turn, each as large as the largest tensor: memory touched
    for the first time costs a page fault per page (slower than drawing it, and serialised between
    threads), so it is touched once, not once per tensor. Tensor i's buffer is drawn into again for
    tensor i + 2, which is started only when tensor i + 1 is asked for, after tensor i is written."""

    def __init__(self, pool: ThreadPoolExecutor, weights: tuple[StoredWeight, ...], config: dict, seed: int):
        self.pool, self.weights, self.config, self.seed = pool, weights, config, seed
        self.specs = [TensorSpec(w.name, w.shape, _storage_dtype(w.dtype)) for w in weights]
        self.buffers = [np.empty(max([s.nbytes for s in self.specs] or [0]), np.uint8) for _ in range(2)]
        self.started: dict[int, tuple[np.ndarray, list[Future]]] = {}

    def start(self, index: int) -> None:
        if index >= len(self.weights) or index in self.started:
            return
        w, spec = self.weights[index], self.specs[index]
        value = computed_weight(w, self.config)
        if w.layout in ZEROS_LAYOUTS:         # the scales as stored (gated or not), times -8
            value = apply_layout(Q4_ZEROS, self.draw(self._drawn_as(w)))
        if value is not None:
            self.started[index] = value, []
            return
        fill = filler_for(w)
        flat = self.buffers[index % 2][:spec.nbytes].view(numpy_dtype(spec.dtype))
        self.started[index] = flat.reshape(spec.shape), [
            self.pool.submit(_fill_chunk, fill, self.seed, index, i, chunk) for i, chunk in _chunks(flat)]

    def _drawn_as(self, derived: StoredWeight) -> int:
        """The entry a derived weight is computed from: its param's, in a layout that is drawn."""
        return next(i for i, w in enumerate(self.weights) if w.param == derived.param and w.layout not in ZEROS_LAYOUTS)

    def draw(self, index: int) -> np.ndarray:
        """Tensor `index` drawn again, into an array of its own (the same chunks, the same values)."""
        spec = self.specs[index]
        flat = np.empty(spec.nbytes, np.uint8).view(numpy_dtype(spec.dtype))
        for i, chunk in _chunks(flat):
            _fill_chunk(filler_for(self.weights[index]), self.seed, index, i, chunk)
        return flat.reshape(spec.shape)

    def take(self, index: int) -> np.ndarray:
        """Tensor `index`, drawn; tensor `index + 1` is started first, to be drawn while this one is
        written. The array is valid until `take(index + 1)` returns."""
        self.start(index)
        self.start(index + 1)
        out, chunks = self.started.pop(index)
        for chunk in chunks:
            chunk.result()
        return out


def _usable_cores() -> int:
    """The cores this process may run on (all of them where the OS cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _is_generated_file(path: Path) -> bool:
    """Whether `path` is a weights file this module wrote (its header says so)."""
    try:
        return read_header(path)[1].get("generator") == GENERATOR
    except KilnError:
        return False


def check_replaceable(artifact_dir: Path, manifest: Manifest, force: bool, command: str = "fill-weights") -> None:
    """Refuse to write weights where that would replace any not drawn here, or drawn ones unasked."""
    source, path = manifest.weights_source, artifact_dir / WEIGHTS
    if source == "checkpoint":
        raise KilnError(f"{artifact_dir} holds weights from a checkpoint; {command} never replaces them "
                        "(it fills artifacts compiled with --no-weights)")
    if source == "generated" and not force:
        seed = manifest.files.get(WEIGHTS, {}).get("generated", {}).get("seed")
        raise KilnError(f"{artifact_dir} already has generated weights (seed {seed}); give --force to replace them")
    if path.exists() and not _is_generated_file(path):
        raise KilnError(f"{path} was not written by kiln fill-weights and the manifest does not record it; "
                        "kiln will not overwrite it: move it away first")


def fill_weights(artifact_dir: str | Path, seed: int = 0, force: bool = False,
                 progress: Callable[[str, float], None] | None = None) -> Manifest:
    """Write seeded random weights for every manifest weight of `artifact_dir` and record them in its
    manifest; return the new manifest. `progress(text, fraction)` hears of each tensor before it is
    written. The file is written beside its place and renamed there, then the manifest likewise: an
    interrupted fill leaves the artifact as it was (a crash between the two renames leaves the new
    file under the old manifest: the checksum check refuses it, and a fill with force replaces it)."""
    artifact_dir = Path(artifact_dir)
    if seed < 0:
        raise KilnError(f"seed must be 0 or more, not {seed}")
    manifest = read_manifest(artifact_dir, verify=False)
    check_replaceable(artifact_dir, manifest, force)
    weights, config = manifest.weights, manifest.model.config
    for w in weights:                   # refuse an unknown kind of tensor before writing anything
        if computed_weight(w, config) is None:
            filler_for(w)
    pool = ThreadPoolExecutor(max_workers=_usable_cores(), thread_name_prefix="kiln-fill")
    drawer = _Drawer(pool, weights, config, seed)
    index = {spec.name: i for i, spec in enumerate(drawer.specs)}
    before = [0, *itertools.accumulate(spec.nbytes for spec in drawer.specs)]      # bytes written before each

    def step(i, spec):
        if progress and before[-1] >= PROGRESS_BYTES:
            progress(f"{i + 1}/{len(weights)} {spec.name} ({before[i] / 2**30:.1f}/{before[-1] / 2**30:.1f} GiB)",
                     before[i] / before[-1])

    hasher = new_hasher()
    try:
        write_in_place(artifact_dir / WEIGHTS, lambda partial: write_safetensors(
            partial, drawer.specs, lambda spec: drawer.take(index[spec.name]), hasher=hasher, progress=step,
            metadata={"format": "kiln", "generator": GENERATOR, "seed": str(seed)}))
    finally:
        pool.shutdown(cancel_futures=True)
    return record_weights(artifact_dir, manifest, "generated", hasher.hexdigest(), generated={"seed": seed})


def record_weights(artifact_dir: Path, manifest: Manifest, source: str, digest: str, **entry) -> Manifest:
    """Record the weights file just written (its digest, size and `entry`'s fields) and where its weights
    came from in the manifest, replaced in place; return the new manifest."""
    size = (artifact_dir / WEIGHTS).stat().st_size
    files = {**manifest.files, WEIGHTS: {"blake3": digest, "bytes": size, **entry}}
    manifest = manifest.replace(weights_source=source, files=dict(sorted(files.items())))
    write_in_place(artifact_dir / MANIFEST, lambda partial: save_manifest(partial, manifest))
    return manifest
