"""A GGUF file's tensors under the Hugging Face names kiln's graph asks for, undoing what llama.cpp's
converter did to them:
  - names: gguf's own table (TensorNameMap) maps each HF name to the file's; experts stored one by one
    in HF (experts.{j}.w1 ...) are slice j of the file's stacked tensor (ffn_gate_exps ...);
  - llama's q and k rows were permuted into interleaved rope pairs: permuted back (rows only, so a
    quantised tensor's blocks move whole and stay exact);
  - Gemma's norm weights were stored plus one: one is taken off.
A quantised tensor is handed out as `GGUFBlocks`: the file's blocks, which a quantiser may repack
into kiln's format (Q4_0 -> q4, Q8_0 -> q8g, Q4_1 -> q4a, Q4_K -> q4k, groups of 32) or dequantise with
llama.cpp's own dequantiser (`gguf.quants`). Each tensor's treatment is recorded for the manifest and `kiln inspect`."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import ml_dtypes
import numpy as np

from kiln.errors import KilnError

from .gguf_file import GGUFFile

EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                    r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
EXPERT_TENSORS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# HF tensors the converter splits in two: Granite-MoE's gate and up experts (one [E, 2F, H] tensor), and
# DeepSeek's kv_b_proj ([heads · (nope + v), kv_lora] as attn_k_b [heads, kv_lora, nope], transposed for
# llama.cpp's absorbed MLA, and attn_v_b [heads, v, kv_lora]; older files keep attn_kv_b whole)
GRANITE_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.input_linear\.weight$")
MLA_KV_B = re.compile(r"^model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight$")
# HF tensors under a name gguf's table lacks
RENAMED = {re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$"): "blk.{}.exp_probs_b.bias"}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
BLOCK = 32                         # Q4_0's and Q8_0's inputs per scale


@dataclass
class GGUFBlocks:
    """A quantised tensor's blocks as the file stores them: raw [..., rows, bytes per row]."""
    name: str                      # the file's tensor name
    qtype: object                  # gguf.GGMLQuantizationType
    raw: np.ndarray
    record: dict                   # the checkpoint's treatments: (name, what was done) -> True
    release: Callable[[], None] = lambda: None      # drop the file's pages (gguf_file.Tensor.release)

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def ndim(self) -> int:
        return self.raw.ndim

    def __len__(self) -> int:       # rows (of a matrix)
        return len(self.raw)

    def __iter__(self):            # a stacked expert tensor, one expert at a time
        return (replace(self, name=f"{self.name}[{j}]", raw=part) for j, part in enumerate(self.raw))

    @property
    def row_values(self) -> int:
        """Values a row of the matrix holds."""
        from gguf import GGML_QUANT_SIZES
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.raw.shape[-1] // type_size * block

    def rows(self, start: int, stop: int) -> GGUFBlocks:
        """Rows start .. stop of a matrix's blocks (a quantiser works through a large table by parts)."""
        return replace(self, raw=self.raw[start:stop])

    def dequantize(self, then: str = "") -> np.ndarray:
        """float32 values as llama.cpp's dequantiser gives them; `then` says what becomes of them."""
        from gguf.quants import dequantize
        self.record[self.name, f"{self.type_name} dequantised" + (f", {then}" if then else "")] = True
        return dequantize(np.asarray(self.raw), self.qtype)

    def __array__(self, dtype=None, copy=None):
        values = self.dequantize("to float")
        return values if dtype is None else values.astype(dtype)

    def exact_parts(self, scheme: str, group_size: int = 0) -> dict[str, np.ndarray] | None:
        """The file's numbers in kiln's `scheme` where that scheme holds them, repacked: Q4_0 is kiln's q4 in
        groups of 32 (the same nibbles, level + 8, and float16 scales), Q8_0 q8g (the same int8 levels
        and float16 scales), Q4_1 q4a (the same nibbles and float16 scales and minimums), Q4_K q4k (the
        same nibbles, 6-bit sub-scales and mins, and float16 factors). Where a Q4_K matrix is asked for
        as q4a, its sub-blocks of 32 become q4a's groups, each scale and minimum (a 6-bit sub-scale times
        the super-block's float16 factor) rounded to float16: within 2^-11 of its own."""
        if group_size != BLOCK or (self.type_name, scheme) not in REPACKS:
            return None
        rows = np.asarray(self.raw)
        blocks = rows.reshape(rows.shape[0], -1, BLOCK_BYTES[self.type_name])
        how = "nearly (scales and minimums rounded to float16)" if (self.type_name, scheme) == ("Q4_K", "q4a") \
            else "exactly"
        self.record[self.name, f"{self.type_name} kept {how} ({scheme} in groups of {BLOCK})"] = True
        return REPACKS[self.type_name, scheme](blocks)


BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34, "Q4_1": 20, "Q4_K": 144}


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field of each block at byte `start`: [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def _interleaved_nibbles(qs: np.ndarray) -> np.ndarray:
    """A block of 32 stored as GGUF does (element j in the low nibble of byte j, j + 16 in its high
    one) into kiln's order (even element low): [rows, blocks, 16] -> [rows, 16 · blocks]."""
    nibbles = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(qs.shape[0], -1)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def _q4_0_as_q4(blocks):
    return {"q": _interleaved_nibbles(blocks[..., 2:]), "scale": np.ascontiguousarray(_halves(blocks, 0).T)}


def _q8_0_as_q8g(blocks):
    levels = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(blocks.shape[0], -1)
    return {"q": levels, "scale": np.ascontiguousarray(_halves(blocks, 0).T)}


def _q4_1_as_q4a(blocks):
    from kiln.ir.quant import q4a_scale_table
    return {"q": _interleaved_nibbles(blocks[..., 4:]),
            "scale": q4a_scale_table(_halves(blocks, 0), _halves(blocks, 2))}


def _q4_k_fields(blocks):
    """Q4_K super-blocks of 256: float16 d and dmin, 12 bytes of 6-bit sub-scales and mins for its
    eight sub-blocks of 32, then 128 bytes: sub-blocks 2c and 2c + 1 in the low and high nibbles of
    bytes 32c .. 32c + 31, element l of each at byte l. W = d · scale_s · nibble - dmin · min_s.
    Returns kiln's nibbles (even input low), d and dmin [rows, supers] (float16), and the sub-scales
    and mins [rows, supers, 8] (uint8)."""
    rows, supers = blocks.shape[:2]
    packed = blocks[..., 4:16].astype(np.uint8)
    low, high = packed[..., 0:4], packed[..., 8:12]                        # scales[0:4], scales[8:12]
    sub_scale = np.concatenate([low & 63, (high & 15) | ((low >> 6) << 4)], axis=-1)
    mins_low = packed[..., 4:8]
    sub_min = np.concatenate([mins_low & 63, (high >> 4) | ((mins_low >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, supers, 4, 32)
    levels = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1)       # [rows, 256 · supers] in order
    return levels[:, 0::2] | (levels[:, 1::2] << 4), _halves(blocks, 0), _halves(blocks, 2), sub_scale, sub_min


def _q4_k_as_q4k(blocks):
    from kiln.ir.quant import q4k_scale_table
    nibbles, d, dmin, sub_scale, sub_min = _q4_k_fields(blocks)
    return {"q": nibbles, "scale": q4k_scale_table(d, -dmin, sub_scale, sub_min)}


def _q4_k_as_q4a(blocks):
    """Each sub-block's scale and minimum, d · scale_s and -dmin · min_s, rounded to float16."""
    from kiln.ir.quant import q4a_scale_table
    nibbles, d, dmin, sub_scale, sub_min = _q4_k_fields(blocks)
    rows = nibbles.shape[0]
    scale = (d.astype(np.float32)[..., None] * sub_scale).reshape(rows, -1)
    minimum = -(dmin.astype(np.float32)[..., None] * sub_min).reshape(rows, -1)
    return {"q": nibbles, "scale": q4a_scale_table(scale.astype(np.float16), minimum.astype(np.float16))}


REPACKS = {("Q4_0", "q4"): _q4_0_as_q4, ("Q8_0", "q8g"): _q8_0_as_q8g, ("Q4_1", "q4a"): _q4_1_as_q4a,
           ("Q4_K", "q4a"): _q4_k_as_q4a, ("Q4_K", "q4k"): _q4_k_as_q4k}


class GGUFCheckpoint:
    """The checkpoint interface kiln's weight writer reads (frontend/checkpoint.py), over a GGUF file."""

    def __init__(self, gguf: GGUFFile, permute_heads: tuple[int, int] | None, norm_offset: float):
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
        self.gguf = gguf
        self.permute_heads, self.norm_offset = permute_heads, norm_offset
        arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == gguf.architecture), None)
        layers = int(gguf.metadata.get(f"{gguf.architecture}.block_count", 0))
        self.names = get_tensor_name_map(arch, layers)
        self.record: dict[tuple[str, str], bool] = {}      # (tensor, what became of it): a tensor may serve twice

    def joined(self, name: str) -> list[str] | None:
        """The two file tensors HF tensor `name` was split into (GRANITE_EXPERTS, MLA_KV_B), or None."""
        m = GRANITE_EXPERTS.match(name)
        if m:
            return [f"blk.{m[1]}.ffn_gate_exps.weight", f"blk.{m[1]}.ffn_up_exps.weight"]
        m = MLA_KV_B.match(name)
        if m and f"blk.{m[1]}.attn_kv_b.weight" not in self.gguf.tensors:
            return [f"blk.{m[1]}.attn_k_b.weight", f"blk.{m[1]}.attn_v_b.weight"]
        return None

    def file_name(self, name: str) -> tuple[str, int | None]:
        """The file's tensor holding HF tensor `name`, and the expert it is a slice of (None: all of it)."""
        if self.joined(name):
            return self.joined(name)[0], None
        for pattern, renamed in RENAMED.items():
            if pattern.match(name):
                return renamed.format(*pattern.match(name).groups()), None
        m = EXPERT.match(name)
        if m:
            return f"blk.{m[1]}.ffn_{EXPERT_TENSORS[m[3]]}_exps.weight", int(m[2])
        mapped = self.names.get_name(name, try_suffixes=(".weight", ".bias"))
        return (mapped or name), None

    def __contains__(self, name: str) -> bool:
        return all(part in self.gguf.tensors for part in self.joined(name) or [self.file_name(name)[0]])

    def read_ahead(self, order: list[str]) -> None:
        """The file is mapped: the OS reads ahead."""

    def shape(self, name: str) -> tuple[int, ...]:
        if self.joined(name):
            first, second = (self.tensor(name, part).shape for part in self.joined(name))
            if MLA_KV_B.match(name):                   # k_b [heads, kv_lora, nope], v_b [heads, v, kv_lora]
                return (first[0] * (first[2] + second[1]), first[1])
            return (first[0], first[1] + second[1], *first[2:])
        file_name, expert = self.file_name(name)
        shape = self.tensor(name, file_name).shape
        return shape[1:] if expert is not None else shape

    def tensor(self, name: str, file_name: str):
        if file_name not in self.gguf.tensors:
            raise KilnError(f"{self.gguf.path}: no tensor {file_name!r} (kiln's {name})")
        return self.gguf.tensors[file_name]

    def get(self, name: str) -> np.ndarray | GGUFBlocks:
        """HF tensor `name`: a float array as stored, or a quantised tensor's GGUFBlocks."""
        if self.joined(name):
            return self._joined(name)
        file_name, expert = self.file_name(name)
        t = self.tensor(name, file_name)
        data = t.data if expert is None else t.data[expert]
        label = file_name if expert is None else f"{file_name}[{expert}]"
        if t.type_name in FLOAT_TYPES:
            arr = np.asarray(data).view(FLOAT_TYPES[t.type_name])
            self.record[label, f"{t.type_name} as stored"] = True
            return self._undo(name, arr)
        return GGUFBlocks(label, t.qtype, self._undo(name, np.asarray(data)), self.record, t.release)

    def _joined(self, name: str) -> np.ndarray | GGUFBlocks:
        """The two tensors joined again: Granite's experts row-wise (blocks stay blocks where both are of
        one type), DeepSeek's k_b (transposed back) and v_b head by head, in float."""
        parts = [self.tensor(name, part) for part in self.joined(name)]
        kv_b = MLA_KV_B.match(name)
        if not kv_b and len({t.type_name for t in parts}) == 1 and parts[0].type_name not in FLOAT_TYPES:
            def release():
                for t in parts:
                    t.release()
            return GGUFBlocks(" + ".join(t.name for t in parts), parts[0].qtype,
                              np.concatenate([np.asarray(t.data) for t in parts], axis=1), self.record, release)
        values = [self._values(t).reshape(t.shape) for t in parts]
        if kv_b:
            k_b, v_b = values
            return np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])
        return np.concatenate(values, axis=1)

    def _values(self, t) -> np.ndarray:
        """A whole file tensor's values, as stored or dequantised (and recorded so)."""
        if t.type_name in FLOAT_TYPES:
            self.record[t.name, f"{t.type_name} as stored"] = True
            return np.asarray(t.data).view(FLOAT_TYPES[t.type_name])
        from gguf.quants import dequantize
        self.record[t.name, f"{t.type_name} dequantised"] = True
        return dequantize(np.asarray(t.data), t.qtype)

    def _undo(self, name: str, arr: np.ndarray) -> np.ndarray:
        """Undo the converter's rewrites: llama's q/k row permutation, Gemma's norm offset."""
        if self.permute_heads and re.search(r"self_attn\.[qk]_proj\.(weight|bias)$", name):
            heads = self.permute_heads[0] if ".q_proj." in name else self.permute_heads[1]
            rows = arr.shape[0]
            arr = arr.reshape(heads, rows // heads // 2, 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)
        if self.norm_offset and name.endswith("norm.weight"):
            arr = (arr.astype(np.float32) - np.float32(self.norm_offset)).astype(arr.dtype)
        return arr

    def tensor_types(self) -> dict[str, int]:
        return dict(Counter(t.type_name for t in self.gguf.tensors.values()).most_common())
