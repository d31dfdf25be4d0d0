"""KVSpec: how one layer's KV cache is stored, declared once by the model builder.

Passes (quantize_kv), codegen, the manifest, `kiln inspect` and the runtime's page allocation all
read the graph's specs (`Graph.kv_specs`, layer -> KVSpec) instead of each rebuilding the layout.
A layer's pages are the graph inputs `kv_pages{layer}` (and `kv_scales{layer}` for a quantised
cache), typed from the spec by `input_types`.

Every layer's pages share one page pool: a sequence has one page table, and page p of it is page
p of every layer's tensor, each tensor sized from its own layer's spec. One table keeps the
scheduler, copy-on-write and the prefix cache the same for every model; layers with a sliding
window mask keys outside it, and a page is freed once it lies outside every layer's window (a model
with any full-attention layer keeps all its pages, as it must).

A "latent" layer (Multi-head Latent Attention, DeepSeek-V2/V3) stores one row per token: the
normalised compressed KV (kv_lora_rank values) followed by the roped shared key (qk_rope_head_dim),
k_head_dim wide; its first v_head_dim (= kv_lora_rank) values are also the values. Its pages are
[pages, 1, 1, page_size, k_head_dim], a quantised row has one scale.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .types import IRError, TensorType, numpy_dtype

KINDS = ("full", "sliding", "latent")
SCALES = ("none", "row")


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
        if self.kind not in KINDS:
            raise IRError(f"KV spec kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == "sliding") != (self.window is not None) or (self.window is not None and self.window < 1):
            raise IRError(f"a {self.kind} KV spec {'needs a positive' if self.kind == 'sliding' else 'has no'} "
                          f"window, got {self.window}")
        if self.scales not in SCALES:
            raise IRError(f"KV spec scales {self.scales!r} is not one of {', '.join(SCALES)}")
        if self.kind == "latent":
            if self.kv_heads != 1 or not 0 < self.v_head_dim < self.k_head_dim:
                raise IRError(f"a latent KV spec has one row per token (kv_heads 1, got {self.kv_heads}) whose "
                              f"values are a prefix of its keys (v {self.v_head_dim} < k {self.k_head_dim})")
        elif self.k_head_dim != self.v_head_dim:
            raise IRError(f"K head dim {self.k_head_dim} differs from V head dim {self.v_head_dim}: kiln's "
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

    def input_types(self, layer: int) -> dict[str, TensorType]:
        """The graph inputs holding this layer's cache, with symbolic page count."""
        shape = self.page_shape("pages")
        types = {pages_name(layer): TensorType(shape, self.dtype)}
        if self.scales == "row":
            types[scales_name(layer)] = TensorType(shape[:4], "float32")
        return types

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

