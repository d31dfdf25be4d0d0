"""Contracts between what kiln compiles and what its runtime calls, in a leaf both import (so neither
imports the other):
  - how each layer's KV cache is stored (KVSpec) and the graph inputs that hold it;
  - the step's inputs (STEP_INPUTS), the kinds of step, the entries compile may build for them, and
    which steps run the prefill entry (is_prefill_step);
  - the compiled sampler's functions, by the name the runtime looks each up with;
  - the artifact's manifest (Manifest), which compile writes and the runtime, `kiln inspect`,
    `attach-weights` and `fill-weights` read. manifest.json is its `to_json()`.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import asdict, dataclass, field, replace

from kiln.dtypes import numpy_dtype
from kiln.errors import KilnError

# 2: the manifest's kv lists a KVSpec per layer. An artifact of another version is refused.
INTERFACE_VERSION = 2


# -- the KV cache -------------------------------------------------------------------------------
# KVSpec: how one layer's KV cache is stored, declared once by the model builder. Passes
# (quantize_kv), codegen, the manifest, `kiln inspect` and the runtime's page allocation all read the
# graph's specs (`Graph.kv_specs`, layer -> KVSpec) instead of each rebuilding the layout. A layer's
# pages are the graph inputs `kv_pages{layer}` (and `kv_scales{layer}` for a quantised cache).
#
# Every layer's pages share one page pool: a sequence has one page table, and page p of it is page p
# of every layer's tensor, each tensor sized from its own layer's spec. One table keeps the scheduler,
# copy-on-write and the prefix cache the same for every model; layers with a sliding window mask keys
# outside it, and a page is freed once it lies outside every layer's window (a model with any
# full-attention layer keeps all its pages, as it must).
#
# A "latent" layer (Multi-head Latent Attention, DeepSeek-V2/V3) stores one row per token: the
# normalised compressed KV (kv_lora_rank values) followed by the roped shared key (qk_rope_head_dim),
# k_head_dim wide; its first v_head_dim (= kv_lora_rank) values are also the values. Its pages are
# [pages, 1, 1, page_size, k_head_dim], a quantised row has one scale.
KV_KINDS = ("full", "sliding", "latent")
KV_SCALES = ("none", "row")


def pages_name(layer: int) -> str:
    return f"kv_pages{layer}"


def scales_name(layer: int) -> str:
    return f"kv_scales{layer}"


@dataclass(frozen=True)
class KVSpec:
    kind: str                   # "full", or "sliding": each query sees the last `window` positions
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: str                  # the stored rows' dtype
    page_size: int
    window: int | None = None   # sliding only: keys at positions > query position - window
    scales: str = "none"        # "row": each stored row (token, head, k or v) has a float32 scale

    def __post_init__(self):
        if self.kind not in KV_KINDS:
            raise KilnError(f"KV spec kind {self.kind!r} is not one of {', '.join(KV_KINDS)}")
        if (self.kind == "sliding") != (self.window is not None) or (self.window is not None and self.window < 1):
            raise KilnError(f"a {self.kind} KV spec {'needs a positive' if self.kind == 'sliding' else 'has no'} "
                            f"window, got {self.window}")
        if self.scales not in KV_SCALES:
            raise KilnError(f"KV spec scales {self.scales!r} is not one of {', '.join(KV_SCALES)}")
        if self.kind == "latent":
            if self.kv_heads != 1 or not 0 < self.v_head_dim < self.k_head_dim:
                raise KilnError(f"a latent KV spec has one row per token (kv_heads 1, got {self.kv_heads}) whose "
                                f"values are a prefix of its keys (v {self.v_head_dim} < k {self.k_head_dim})")
        elif self.k_head_dim != self.v_head_dim:
            raise KilnError(f"K head dim {self.k_head_dim} differs from V head dim {self.v_head_dim}: kiln's "
                            f"pages hold K and V rows of one width")

    @property
    def head_dim(self) -> int:
        return self.k_head_dim

    @property
    def rows(self) -> int:
        """Stored rows per token and KV head: K and V apart, or one latent row holding both."""
        return 1 if self.kind == "latent" else 2

    def page_shape(self, num_pages) -> tuple:
        """[pages, rows (k, v; or the latent row), kv_heads, page_size, head_dim]; the scales drop the
        last axis."""
        return (num_pages, self.rows, self.kv_heads, self.page_size, self.head_dim)

    def tensors(self, layer: int, num_pages) -> dict[str, tuple[tuple, str]]:
        """The tensors holding this layer's cache, by graph input name: (shape, dtype) of its pages and,
        quantised, of their row scales."""
        shape = self.page_shape(num_pages)
        tensors = {pages_name(layer): (shape, self.dtype)}
        if self.scales == "row":
            tensors[scales_name(layer)] = (shape[:4], "float32")
        return tensors

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer: K and V rows of every KV head (or its latent row), with
        their scales."""
        row = self.head_dim * numpy_dtype(self.dtype).itemsize + (4 if self.scales == "row" else 0)
        return self.rows * self.kv_heads * row

    def quantized(self, storage_dtype: str) -> KVSpec:
        return replace(self, dtype=storage_dtype, scales="row")

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> KVSpec:
        return cls(**d)

    def describe(self) -> str:
        if self.kind == "latent":
            heads = f"one row × {self.k_head_dim} (values its first {self.v_head_dim})"
        else:
            heads = (f"{self.kv_heads} kv heads × {self.head_dim}" if self.k_head_dim == self.v_head_dim
                     else f"{self.kv_heads} kv heads × k {self.k_head_dim} / v {self.v_head_dim}")
        kind = f"sliding window {self.window}" if self.kind == "sliding" else self.kind
        scales = ", a float32 scale per row" if self.scales == "row" else ""
        return f"{kind}, {heads}, {self.dtype}{scales}, pages of {self.page_size}, {self.bytes_per_token} B/token"


# -- one step -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepInput:
    """One int32 vector of a step's inputs, by name and symbolic length."""
    name: str
    length: str        # tokens, seqs, seqs1 (seqs + 1), nnz_pages or rows
    meaning: str


# A step is the new tokens of several sequences flattened in order (runtime/step.py builds it).
STEP_INPUTS = (
    StepInput("tokens", "tokens", "the new tokens"),
    StepInput("positions", "tokens", "each new token's position in its sequence"),
    StepInput("q_indptr", "seqs1", "where each sequence's new tokens start (CSR)"),
    StepInput("page_indptr", "seqs1", "where each sequence's pages start in page_values (CSR)"),
    StepInput("page_values", "nnz_pages", "each sequence's pages in order; -1 for one outside every window"),
    StepInput("last_page_len", "seqs", "the rows used in each sequence's last page"),
    StepInput("slot_mapping", "tokens", "each new token's KV slot (page * page_size + row)"),
    StepInput("logit_rows", "rows", "the rows whose logits come back"),
)

# The kinds of step a graph may have a form for (ir/step_forms.py): "mixed" runs any step; "decode"
# one new token per sequence; "prefill" steps whose every sequence brings many (MLA's expanded form).
STEP_KINDS = ("mixed", "decode", "prefill")
# The CUDA graph entries a manifest may name: decode steps of up to the largest batch bucket, and
# those from decode_mma_from sequences (tensor-core linears).
GRAPH_ENTRY, WIDE_GRAPH_ENTRY = "decode_graph", "decode_wide_graph"
GRAPH_ENTRIES = (GRAPH_ENTRY, WIDE_GRAPH_ENTRY)


def is_prefill_step(q_indptr, min_tokens: int) -> bool:
    """Whether a step whose sequences bring diff(q_indptr) new tokens runs the prefill entry: every
    sequence brings at least `min_tokens` (the graph's step_choice forms, ir/step_forms.py)."""
    starts = [int(i) for i in q_indptr]
    return min((end - start for start, end in zip(starts, starts[1:])), default=0) >= min_tokens


# -- the sampler ----------------------------------------------------------------------------------
# what the runtime asks for -> the function codegen/lowering/sampling.py compiles into the artifact
SAMPLER_FUNCTIONS = {"penalties": "apply_penalties", "greedy": "sample_greedy", "plain": "sample_plain",
                     "sorted": "sample_sorted", "logprobs": "token_logprobs", "mask": "apply_token_mask"}
OPTIONAL_SAMPLER_FUNCTIONS = ("mask",)      # artifacts compiled before structured output lack it
MAX_LOGPROBS = 20       # the most alternatives SamplingParams.logprobs may ask for (the compiled top-k's k)


# -- the manifest -----------------------------------------------------------------------------------
# Its records mirror manifest.json's objects field by field; `None` fields are left out of the file.
@dataclass(frozen=True)
class StoredWeight:
    """One tensor of an artifact's weights file, in the order the compiled functions take them."""
    name: str          # name in the weights file
    param: str         # the IR param it is made from
    layout: str        # codegen.layouts name
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModelRecord:
    architecture: str
    config: dict           # the DecoderConfig's fields (frontend/decoder.py to_json)
    source: str            # the model directory the weights came from


@dataclass(frozen=True)
class TargetRecord:
    name: str
    device: str
    arch: str | None = None
    tvm_target: str = ""
    runs_here: bool = True
    note: str | None = None
    cpu_features: tuple[str, ...] | None = None      # the instruction sets a CPU artifact's kernels use
    tiles: str | None = None         # "amx": some kernels use AMX tiles where the OS grants them (kiln/cpu_tiles.py)


@dataclass(frozen=True)
class Quantization:
    weights: str = "none"
    lm_head: bool = False
    embedding: str = "none"
    embedding_shared_with_lm_head: bool = False
    kv_cache: str = "none"
    group_size: int | None = None                    # q4's
    activation_block: int = 0                        # int8 activations' block (0: float activations)
    lm_head_format: str | None = None                # the LM head's scheme where it is not `weights`
    tensor_formats: dict | None = None               # weight -> scheme, where not `weights` (a GGUF file's mix)
    tensor_classes: dict | None = None               # --tensor-quant: class -> scheme or "none"
    class_formats: dict | None = None                # weight kind (qkv, down, ...) -> its formats, in words
    more_bits: str | None = None                     # 4-bit: the format of v and down in more_bits_layers
    calibration: dict | None = None                  # --calibrate: the text's file, tokens, and the artifact's
    #                                                  file of input importances the quantisers weighed by
    scale_dtype: str | None = None                   # "float32": group scales in float32 (an ONNX file's); else f16


@dataclass(frozen=True)
class KVLayout:
    page_size: int
    layers: tuple[dict, ...]          # KVSpec.to_json() per layer


LORA_SLOTS = "lora_slots"        # the step input i32[tokens]: each row's adapter slot (-1: the base model)


def lora_input_names(module: str) -> tuple[str, str]:
    """The graph inputs holding the stacked adapters of the projection `module` (checkpoint-named, without
    '.weight'; a fused one's name): A [slots, rank rows, in] and B [slots, rank rows, out]."""
    return f"lora_a.{module}", f"lora_b.{module}"


@dataclass(frozen=True)
class LoRASite:
    """One projection adapters reach (a lora op after its linear: ir/lora_ops.py): its stacked inputs,
    and the checkpoint modules (PEFT's names) whose output rows it holds, in order, with their counts."""
    a: str
    b: str
    modules: tuple[str, ...]
    rows: tuple[int, ...]
    inputs: int


@dataclass(frozen=True)
class LoRALayout:
    """Adapter slots compiled in (`kiln compile --max-loras N --max-lora-rank R`)."""
    max_loras: int
    max_rank: int
    dtype: str
    sites: tuple[LoRASite, ...]


WEIGHTS_SOURCES = ("checkpoint", "absent", "generated")
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """manifest.json. The runtime reads the fields above `kernels`; those from `kernels` on describe
    what compile chose, for `kiln inspect` and for tests."""
    model: ModelRecord
    target: TargetRecord
    dtype: str
    quantization: Quantization
    kv: KVLayout
    vocab_size: int
    max_context: int
    library: str
    entry: str = "forward"
    entries: dict[str, str] = field(default_factory=dict)       # step kind or graph entry -> function
    prefill_min_tokens: int | None = None
    decode_gemm_from: int | None = None
    decode_mma_from: int | None = None
    inputs: tuple[str, ...] = ()                 # the compiled functions' inputs before the weights
    weights: tuple[StoredWeight, ...] = ()
    weights_source: str = "checkpoint"           # WEIGHTS_SOURCES
    graph_batches: tuple[int, ...] = ()
    sampling: str = "host"                       # "device": the sampler's functions are compiled in
    lora: LoRALayout | None = None               # adapter slots and the projections they reach
    kernels: tuple[str, ...] = ()
    attention_variants: tuple[str, ...] = ()
    attention_kernels: dict = field(default_factory=dict)
    attention_layers: tuple[dict, ...] = ()
    launches_per_step: dict = field(default_factory=dict)
    linear_kernels: dict = field(default_factory=dict)         # step kind -> the kernels its linears run
    expert_kernels: dict = field(default_factory=dict)         # step kind -> its moe_experts' grouped GEMMs
    flashinfer: dict | None = None     # FlashInfer's build and what the runtime plans (codegen/lowering/flashinfer.py)
    hopper_gemms: dict | None = None   # CUTLASS's Hopper GEMMs linked in (codegen/kernels/gpu/hopper_gemm.py)
    passes: tuple[dict, ...] = ()
    compile_seconds: dict = field(default_factory=dict)
    tokenizer_files: tuple[str, ...] = ()
    source: dict | None = None         # the model file's format and what each tensor became (GGUF files)
    kiln_version: str = ""
    interface_version: int = INTERFACE_VERSION
    files: dict[str, dict] = field(default_factory=dict)        # file -> blake3 (or sha256), bytes, …

    def __post_init__(self):
        if self.weights_source not in WEIGHTS_SOURCES:
            raise KilnError(f"manifest records weights_source {self.weights_source!r} "
                            f"(known: {', '.join(WEIGHTS_SOURCES)})")

    @property
    def step_entries(self) -> dict[str, str]:
        """Step kind or graph entry -> compiled function (an artifact from before `entries`: forward)."""
        return self.entries or {"mixed": self.entry}

    def replace(self, **changes) -> Manifest:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        if not isinstance(data, dict):
            raise KilnError("manifest.json does not hold an object")
        if "weights_source" not in data:           # written before the field: the weights file says
            data = {**data, "weights_source": "checkpoint" if WEIGHTS in data.get("files", {})
                    else "absent"}
        return _from_json(cls, data, "manifest")


def _to_json(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return value


def _from_json(cls, data: dict, where: str):
    """`cls` from its JSON object: nested records and tuples converted by the field's type; a field
    the object lacks takes its default, and one without a default is an error that names it."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            values[f.name] = _convert(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise KilnError(f"{where} lacks the field {f.name!r}: the artifact is damaged or not kiln's")
    return cls(**values)


def _convert(hint, value, where: str):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):     # X | None: X's conversion
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if value is None:
        return None
    if dataclasses.is_dataclass(hint):
        return _from_json(hint, value, where)
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return tuple(_convert(item, v, where) for v in value)
    return value
