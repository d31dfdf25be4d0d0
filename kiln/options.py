"""CompileOptions: what `kiln compile` is asked for, checked once, from the CLI (or a caller of
kiln.compiler.compile_model) through the pass pipeline (passes/pipeline.py) to the manifest. A leaf:
the CLI, the compiler, the passes and `kiln attach-weights` (which plans the same pipeline from a
manifest) all read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.errors import KilnError

DTYPES = ("float32", "float16", "bfloat16")
WEIGHT_QUANTS = ("q8", "q4", "fp8", "q8g", "q4a", "q4k")   # ir/quant.py SCHEMES
KV_DTYPES = ("int8", "fp8")                  # ir/quant.py KV_SCHEMES
GROUP_SIZES = (32, 128)                      # q4's, q8g's and q4a's input channels per scale (q4k: 32)
FOUR_BIT = ("q4", "q4a", "q4k")              # weight formats whose LM head and embedding default to q8
TABLE_FORMATS = ("q8", "q4", "fp8")          # the formats an embedding lookup reads
# --tensor-quant's tensor classes: the embedding table, the LM head, the attention projections and
# the dense MLP's (shared experts included) as a whole or one projection at a time, MoE experts
TENSOR_CLASSES = ("embedding", "lm_head", "attention", "mlp", "experts", "q", "k", "v", "o", "gate", "up", "down")
ATTENTION_CHOICES = ("builtin", "flashinfer")
MAX_LORA_RANK = 256
LORA_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    target: object = "cpu"                   # a target's name, or a Target (tests and benchmarks give one)
    arch: str | None = None                  # the target's --arch (None: its default)
    dtype: str | None = None                 # weights and activations (None: the target's default)
    quant: str | None = None                 # weight quantisation: q8, q4, fp8; None: as the model stores
    #                                          its weights (a GGUF file's format), "none": the dtype's
    group_size: int = 32                     # q4's input channels per scale
    scale_dtype: str = ""                    # linears' group scales (q4, q8g, q4a): float16, or float32 (cpu; an
    #                                          ONNX file's float32 MatMulNBits scales kept); "": the importer's choice
    quant_lm_head: bool = True
    quant_embedding: bool = True             # with quant: the embedding table in the same scheme
    lm_head_quant: str | None = None         # the LM head's scheme where it is not quant's (GGUF files' own)
    embedding_quant: str | None = None       # the embedding table's likewise
    tensor_quant: tuple[tuple[str, str], ...] = ()   # (weight, scheme) where it is not quant's (a GGUF file's
    #                                          tensors of another type); a fused weight takes its parts' finest
    tensor_classes: tuple[tuple[str, str], ...] = ()   # (TENSOR_CLASSES entry, format or "none"): the user's
    #                                          --tensor-quant, before every other choice of that tensor's format
    calibrate: str | None = None             # a text file: weight quantisers weigh each input by its mean square
    more_bits: bool = True                   # 4-bit: v and down at 8 bits in some layers (passes/tensor_classes.py;
    #                                          off for a GGUF file's own types)
    kv_dtype: str | None = None              # the KV cache stored as int8 or fp8 (None: the dtype)
    int8_activations: bool | None = None     # q8/q4 linears on int8 activations (None: where the target has them)
    float_activations: tuple[str, ...] = ()  # weights whose linears keep float activations: --calibrate measured
    #                                          int8's error too large there (a fused weight: any of its parts)
    mla_expanded_from: int | None = None     # MLA prefill steps of this many tokens a sequence and up run the
    #                                          expanded form (None: the target's; 0: never)
    disable_passes: frozenset[str] = field(default_factory=frozenset)
    attention: str = "builtin"               # flashinfer: FlashInfer's prefill linked in (cuda; selection/order.py)
    weights: bool = True                     # False: no weights file (attach-weights or fill-weights write it)
    max_loras: int = 0                       # LoRA adapter slots compiled in (0: none; passes/add_lora.py)
    max_lora_rank: int = 16                  # the largest adapter rank the slots hold
    lora_dtype: str | None = None            # the slots' dtype (None: bfloat16 beside quantised CPU weights, else
    #                                          the model's; passes/pipeline.py)

    def __post_init__(self):
        for name, value, known in (("dtype", self.dtype, DTYPES), ("quant", self.quant, (*WEIGHT_QUANTS, "none")),
                                   ("kv-dtype", self.kv_dtype, KV_DTYPES)):
            if value is not None and value not in known:
                raise KilnError(f"--{name} {value} is not one of {', '.join(known)}")
        if self.attention not in ATTENTION_CHOICES:
            raise KilnError(f"--attention {self.attention} is not one of {', '.join(ATTENTION_CHOICES)}")
        if self.attention == "flashinfer" and self.target_name != "cuda":
            raise KilnError(f"--attention flashinfer is for --target cuda, not {self.target_name}")
        if self.lora_dtype is not None and self.lora_dtype not in LORA_DTYPES:
            raise KilnError(f"--lora-dtype {self.lora_dtype} is not one of {', '.join(LORA_DTYPES)}")
        if self.max_loras < 0 or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise KilnError(f"--max-loras {self.max_loras} must be 0 or more and --max-lora-rank "
                            f"{self.max_lora_rank} within 1..{MAX_LORA_RANK}")
        if self.scale_dtype not in ("", "float16", "float32"):
            raise KilnError(f"--group-scales {self.scale_dtype} is not float16 or float32")
        if self.scale_dtype == "float32" and self.target_name != "cpu":
            raise KilnError(f"--group-scales float32 is for --target cpu (the {self.target_name} kernels read "
                            "float16 scales)")
        if self.group_size not in GROUP_SIZES:
            raise KilnError(f"--group-size {self.group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
        if self.mla_expanded_from is not None and self.mla_expanded_from < 0:
            raise KilnError(f"--mla-expanded-from {self.mla_expanded_from} is negative")
        if self.int8_activations and self.quant not in ("q8", "q4", "q8g", "q4a", "q4k"):
            raise KilnError("--activations int8 needs --quant q8, q8g, q4, q4a or q4k (the integer dot products "
                            "read those weights)")
        if self.quant == "q4k" and self.group_size != 32:
            raise KilnError(f"--quant q4k has groups of 32 in super-blocks of 256 (GGUF's Q4_K), not "
                            f"--group-size {self.group_size}")
        for cls, fmt in self.tensor_classes:
            if cls not in TENSOR_CLASSES:
                raise KilnError(f"--tensor-quant {cls}={fmt}: {cls} is not one of {', '.join(TENSOR_CLASSES)}")
            if fmt not in (*WEIGHT_QUANTS, "none"):
                raise KilnError(f"--tensor-quant {cls}={fmt}: {fmt} is not one of {', '.join(WEIGHT_QUANTS)}, none")
            if cls == "embedding" and fmt not in (*TABLE_FORMATS, "none"):
                raise KilnError(f"--tensor-quant embedding={fmt}: the embedding lookup reads "
                                f"{', '.join(TABLE_FORMATS)} or none, not {fmt}")
        if (self.tensor_classes or self.calibrate) and self.quant in (None, "none"):
            flag = "--tensor-quant" if self.tensor_classes else "--calibrate"
            raise KilnError(f"{flag} needs --quant (it chooses how weights are quantised)")
        object.__setattr__(self, "disable_passes", frozenset(self.disable_passes))

    @property
    def target_name(self) -> str:
        return self.target if isinstance(self.target, str) else self.target.name

    def class_format(self, cls: str) -> str | None:
        """The format --tensor-quant gives a tensor class (None: not given)."""
        return dict(self.tensor_classes).get(cls)

    def head_format(self) -> str | None:
        """The LM head's format (None: float): --tensor-quant lm_head=, else float with
        --no-quant-lm-head, else a GGUF file's own, else q8 under a 4-bit --quant, else --quant's."""
        chosen = self.class_format("lm_head")
        if self.quant in (None, "none") or chosen == "none" or not (chosen or self.quant_lm_head):
            return None
        return chosen or self.lm_head_quant or ("q8" if self.quant in FOUR_BIT else self.quant)

    def more_bits_format(self) -> str | None:
        """The format of the v and down projections that a 4-bit model keeps at 8 bits (None: none)."""
        return "q8" if self.more_bits and self.quant in FOUR_BIT else None

    def table_format(self) -> str | None:
        """The embedding table's format (None: float), chosen as head_format's; a table the lookup cannot
        read in --quant's format or the file's (q8g, q4a, q4k) is q8."""
        chosen = self.class_format("embedding")
        if self.quant in (None, "none") or chosen == "none" or not (chosen or self.quant_embedding):
            return None
        table = chosen or self.embedding_quant or ("q8" if self.quant in FOUR_BIT else self.quant)
        return table if table in TABLE_FORMATS else "q8"
