"""Small random-weight Hugging Face models and a locally trained tokenizer.

No model hub is reachable, so tests, `make demo` and the benchmarks build
their models here: a byte-level BPE tokenizer trained on Python's own
docstrings (offline and deterministic), and a transformers model of a
supported family saved with `save_pretrained`, exactly like a real checkpoint.

transformers' random init (std 0.02) gives nearly flat logits, on which greedy
decoding flips with every rounding difference; the weights are re-drawn with a
wider spread so that the top logits are well separated.

    python -m kiln.testing.tiny OUT_DIR [--family llama] [--preset tiny|llama-3.2-1b]

Needs torch and transformers (the `import` extra); the runtime never imports it.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import shutil
import sys
import warnings
from pathlib import Path

SPECIAL_TOKENS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
BOS, EOS, END_OF_TURN = "<s>", "</s>", "<|end|>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# The training text: docstrings of these stdlib modules and their public members
# (not `inspect`: torch patches inspect.getfile on import).
CORPUS_MODULES = (
    "abc", "argparse", "array", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html", "io", "ipaddress", "itertools", "json", "logging", "math",
    "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shlex", "shutil", "socket",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time",
    "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)

def _llama3_rope(factor: float) -> dict:
    """Llama 3.1/3.2's long-context rope fields; they differ only in the scaling factor."""
    return {"rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


# head_dim as real DeepSeek configs imply it: the rope part (transformers 5 sizes its rope by it)
_DEEPSEEK_MLA = {"num_key_value_heads": 8, "head_dim": 8, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                 "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                 "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2}

# family -> (transformers config/model class names, config fields that make the family what it is)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama32": ("LlamaConfig", "LlamaForCausalLM", {**_llama3_rope(32.0), "tie_word_embeddings": True}),
    "llama31": ("LlamaConfig", "LlamaForCausalLM", {**_llama3_rope(8.0), "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),          # Qwen2 has q/k/v bias by construction
    # sliding windows shorter than a 16-token page: every layer (Mistral), or layer 1 of 2 (Qwen2)
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 7}),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 12,
                                                         "max_window_layers": 1}),
    # YaRN: frequencies ramped between interpolation and extrapolation, cos/sin scaled by mscale
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                        "original_max_position_embeddings": 1024}}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),              # per-head q/k RMSNorm before rope
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),              # post-norm blocks, q/k norm over all heads
    # qkv_proj and gate_up_proj stored fused, LongRoPE (short factors, mscale from 4x the original
    # context), rope on the first 3/4 of each head (Phi-4-mini)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "pad_token_id": 0, "max_position_embeddings": 16384, "original_max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0 + i / 40 for i in range(12)],
                            "long_factor": [1.0 + i for i in range(12)]}}),
    # GeGLU, (1 + w) norms around attention and the MLP, scaled embeddings, soft-capped scores and
    # logits (caps small enough to bite at these sizes), layer 0 windowed (6), layer 1 global
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 6, "query_pre_attn_scalar": 24, "tie_word_embeddings": True,
                                                     "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # Gemma 2's blocks with q/k norm, 3 layers of which layer 2 is global, a local rope base of its
    # own and linear rope scaling on the global layer only
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 3, "sliding_window": 5, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}}),
    # mixtures of experts: 8 experts, 2 (or 3) per token
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                                        "intermediate_size": 128, "sliding_window": None}),
    # a dense layer 0 (mlp_only_layers), a sigmoid-gated shared expert, top-k weights not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 96, "mlp_only_layers": [0],
        "shared_expert_intermediate_size": 192, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                           "moe_intermediate_size": 128, "norm_topk_prob": True}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                  "intermediate_size": 128, "norm_topk_prob": False}),
    # experts stored stacked, softmax over the top-k logits, and Granite's four multipliers
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 128,
        "embedding_multiplier": 2.0, "attention_multiplier": 0.15, "residual_multiplier": 0.5,
        "logits_scaling": 2.0}),
    # Multi-head Latent Attention + experts: q LoRA, YaRN whose mscale and mscale_all_dim differ
    # (rope × their ratio, scores × mscale_all_dim's squared), a dense layer 0, group-limited
    # softmax routing, two ungated shared experts
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_DEEPSEEK_MLA, "q_lora_rank": 64, "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5,
        "n_shared_experts": 2,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                            "mscale_all_dim": 0.8, "original_max_position_embeddings": 1024}}),
    # a plain q_proj, sigmoid routing with the score-correction bias, renormalised and scaled
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_DEEPSEEK_MLA, "q_lora_rank": None, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "n_shared_experts": 1}),
}

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False)

# preset -> (family, config overrides)
PRESETS = {
    "tiny": (None, {}),
    "llama-3.2-1b": ("llama32", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                     vocab_size=128256)),
    # Streamed: written tensor by tensor in bfloat16 (make_streamed_model), as it would not fit in memory.
    "llama-3.1-8b": ("llama31", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     vocab_size=128256)),
    # issue 12's CPU benchmark shapes (bfloat16 checkpoints written tensor by tensor)
    "gemma-2-2b": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                                  sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                  final_logit_softcapping=30.0, tie_word_embeddings=True,
                                  max_position_embeddings=8192)),
    # the same shape with windows and soft-capping removed: every layer full attention, TVM's kernels on GPUs
    "gemma-2-2b-full": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                                       layer_types=["full_attention"] * 26, query_pre_attn_scalar=256,
                                       attn_logit_softcapping=None, final_logit_softcapping=None,
                                       tie_word_embeddings=True, max_position_embeddings=8192)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960)),
    # issue 13's MoE/MLA benchmark shapes: DeepSeek-V2-Lite with 4 of its 27 layers (1 dense, 3 with
    # 64 experts) and, unlike Lite, V2's q LoRA (rank 1536): llama.cpp takes a DeepSeek-2 model for
    # Lite (no q LoRA) only at 26 or 27 layers; and a small Mixtral
    "deepseek-v2-lite-4l": ("deepseek_v2", dict(
        hidden_size=2048, intermediate_size=10944, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0, n_group=1,
        topk_group=1, vocab_size=102400, rms_norm_eps=1e-6, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 4096})),
    "mixtral-small": ("mixtral", dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                                      max_position_embeddings=32768, rope_theta=1000000.0)),
    # Mixtral 8x7B's layer shape (8 experts of 4096 x 14336, top 2) in 4 of its 32 layers: a GPU's
    # MoE benchmark that fits one device (issue 29)
    "mixtral-8x7b-4l": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                                        max_position_embeddings=32768, rope_theta=1000000.0)),
}
STREAMED = {"llama-3.1-8b", "gemma-2-2b", "qwen3-1.7b", "deepseek-v2-lite-4l", "mixtral-small", "mixtral-8x7b-4l"}

LOGIT_STD = 4.0   # target std of the logits of a normalised hidden state


def corpus() -> list[str]:
    """Docstrings of CORPUS_MODULES, deduplicated and sorted: the same list on every run.

    Only stdlib-defined objects count, and submodules are skipped: other
    packages patch stdlib classes (transformers adds methods to
    logging.Logger), and whether `unittest.mock` is an attribute of `unittest`
    depends on what else the process has imported.
    """
    def stdlib(obj) -> bool:
        owner = getattr(obj, "__module__", None)
        return not isinstance(owner, str) or owner.split(".")[0] in sys.stdlib_module_names

    docs: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # typing.io and friends warn when touched
        for mod_name in CORPUS_MODULES:
            mod = importlib.import_module(mod_name)
            objs = [mod] + [getattr(mod, n) for n in sorted(dir(mod)) if not n.startswith("_")]
            for obj in objs:
                if inspect.ismodule(obj) and obj is not mod:
                    continue
                members = [obj] + ([vars(obj)[n] for n in sorted(vars(obj)) if not n.startswith("_")]
                                   if inspect.isclass(obj) else [])
                for m in filter(stdlib, members):
                    doc = inspect.getdoc(m)
                    if doc:
                        docs.add(doc)
    return sorted(docs)


def train_tokenizer(out_dir, vocab_size: int = 512, texts=None) -> None:
    """Train a byte-level BPE on `texts` (default `corpus()`); write tokenizer.json and the
    transformers configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus() if texts is None else texts, trainer)
    # Like Llama 3: plain encodes start with <s>; the chat template writes its own.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))]),
    ])
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
              "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS, EOS)],
              "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def _init_rule(name: str, shape: tuple[int, ...], hidden: int, tied: bool) -> tuple[float, float, float]:
    """(std, shift, scale): parameter `name` is drawn from N(0, std), then shifted, then scaled, so
    that logits are a few units apart (see module docstring).

    Logits are head @ (final_norm_weight * unit-rms hidden), so their std is
    head_std * sqrt(hidden) * final_norm_scale. Untied: the head carries the
    spread. Tied: the head is the embedding, which also enters the residual
    stream; a large one would make each token predict itself, so it stays at
    1/sqrt(hidden) and the final norm's scale carries the spread.
    """
    if len(shape) == 1 and name.endswith("bias"):
        return 0.1, 0.0, 1.0
    if len(shape) == 1:                                # rms norm scales
        return 0.1, 1.0, LOGIT_STD if tied and name == "model.norm.weight" else 1.0
    if name.endswith("embed_tokens.weight"):
        return 1.0 / math.sqrt(hidden) if tied else 1.0, 0.0, 1.0
    if name.endswith("lm_head.weight"):
        return LOGIT_STD / math.sqrt(hidden), 0.0, 1.0
    if len(shape) in (2, 3):                           # linear [out, in] or experts [E, out, in]: unit-variance outputs
        return 1.0 / math.sqrt(shape[-1]), 0.0, 1.0
    raise ValueError(f"no init rule for parameter {name} of shape {tuple(shape)}")


def _spread_weights(model, seed: int, hidden: int, tied: bool) -> None:
    """Re-draw every parameter in place by `_init_rule`."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():     # a tied lm_head is listed once, as embed_tokens
            std, shift, scale = _init_rule(name, tuple(p.shape), hidden, tied)
            p.normal_(0.0, std, generator=gen).add_(shift).mul_(scale)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's router bias: zero would test nothing
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1, generator=gen)


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights      # transformers >= 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights      # transformers 4.x
    return no_init_weights()


def _configure(out: Path, family: str, overrides: dict):
    """Train the tokenizer into `out`; return the transformers config, its generation config, and
    whether the head is tied."""
    import transformers
    from tokenizers import Tokenizer

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    train_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    config_name, _, family_fields = FAMILIES[family]
    fields = {**TINY, **family_fields, "vocab_size": tok.get_vocab_size(),
              "bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS), **overrides}
    if fields["vocab_size"] < tok.get_vocab_size():
        raise ValueError(f"vocab_size {fields['vocab_size']} is smaller than the tokenizer's {tok.get_vocab_size()}")
    generation = transformers.GenerationConfig(
        bos_token_id=fields["bos_token_id"],
        eos_token_id=[fields["eos_token_id"], tok.token_to_id(END_OF_TURN)],   # stop at end of turn too
        do_sample=False)
    return getattr(transformers, config_name)(**fields), generation, bool(fields["tie_word_embeddings"])


def make_tiny_model(out_dir, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Train the tokenizer into `out_dir`, then build and save a random `family` model there (float32)."""
    import torch
    import transformers

    out = Path(out_dir)
    config, generation, tied = _configure(out, family, overrides)
    model_name = FAMILIES[family][1]
    torch.manual_seed(seed)
    with _no_init_weights():     # every parameter is drawn by _spread_weights; skip transformers' init
        model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.tie_weights()          # skipped with the init
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"{model_name}: tie_word_embeddings is set but lm_head is not tied")
    _spread_weights(model, seed, config.hidden_size, tied)
    model.generation_config = generation
    model.save_pretrained(out)
    return out


SHARD_BYTES = 5 << 30        # transformers' default max_shard_size


def make_streamed_model(out_dir, family: str = "llama", seed: int = 0, dtype: str = "bfloat16",
                        **overrides) -> Path:
    """make_tiny_model for models too big to hold in memory: each tensor is drawn with NumPy by the
    same rules, converted to `dtype` and written on its own, into safetensors shards with an index
    (transformers' layout). Peak memory is one tensor in float32 and in `dtype`."""
    import numpy as np
    import torch
    import transformers
    from kiln.ir.types import numpy_dtype
    from kiln.safetensors_io import TensorSpec, write_safetensors

    out = Path(out_dir)
    config, generation, tied = _configure(out, family, overrides)
    with torch.device("meta"):                   # names and shapes only: no memory
        model = getattr(transformers, FAMILIES[family][1])(config)
    if tied:
        model.tie_weights()
    specs = _per_expert([TensorSpec(name, tuple(p.shape), dtype) for name, p in model.named_parameters()],
                        config, FAMILIES[family][1])
    shards: list[list[TensorSpec]] = [[]]
    for spec in specs:
        if shards[-1] and sum(s.nbytes for s in shards[-1]) + spec.nbytes > SHARD_BYTES:
            shards.append([])
        shards[-1].append(spec)
    index = {name: i for i, spec_list in enumerate(shards) for name in (s.name for s in spec_list)}
    order = {spec.name: i for i, spec in enumerate(specs)}

    def draw(spec: TensorSpec):
        std, shift, scale = _init_rule(spec.name, spec.shape, config.hidden_size, tied)
        rng = np.random.default_rng([seed, order[spec.name]])
        x = rng.standard_normal(spec.shape, dtype=np.float32)
        x *= np.float32(std)
        x += np.float32(shift)
        x *= np.float32(scale)
        return x.astype(numpy_dtype(dtype))

    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, spec_list in zip(names, shards):
        write_safetensors(out / name, spec_list, draw, metadata={"format": "pt"}, align=False,
                          progress=lambda i, spec: print(f"  {spec.name}", file=sys.stderr, flush=True))
    config.architectures = [FAMILIES[family][1]]       # what save_pretrained of a model records
    (out / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(s.nbytes for s in specs)},
        "weight_map": {name: names[index[name]] for name in index}}, indent=2))
    config.save_pretrained(out)
    generation.save_pretrained(out)
    return out


def _per_expert(specs: list, config, architecture: str) -> list:
    """transformers 5 holds a layer's experts as 3-D params (mlp.experts.gate_up_proj [E, 2F, H],
    down_proj [E, H, F]) and its router as mlp.gate; checkpoints, and save_pretrained, store each
    expert's weights apart under the family's names (kiln's frontend/moe.py LAYOUTS)."""
    from kiln.frontend.families import parse_config
    from kiln.frontend.moe import LAYOUTS
    from kiln.safetensors_io import TensorSpec
    moe = parse_config({**config.to_dict(), "architectures": [architecture]}).moe
    if moe is None or len(LAYOUTS[moe.layout][2]) != 3:
        return specs
    block, router, (gate, up, down) = LAYOUTS[moe.layout]
    out = []
    for spec in specs:
        layer, _, rest = spec.name.partition(".mlp.")
        if rest == "gate.weight":
            out.append(TensorSpec(f"{layer}.{block}.{router}", spec.shape, spec.dtype))
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):
            experts, rows, cols = spec.shape
            parts = [(gate, rows // 2), (up, rows // 2)] if rest.endswith("gate_up_proj") else [(down, rows)]
            out += [TensorSpec(f"{layer}.{block}.{name.format(j=j)}", (n, cols), spec.dtype)
                    for j in range(experts) for name, n in parts]
        else:
            out.append(spec)
    return out


def make_config_only_model(out_dir, family: str = "llama", **overrides) -> Path:
    """A model directory with the tokenizer and config of make_tiny_model but no weights: an empty
    safetensors index. Enough for `kiln compile --no-weights` (and for transformers' from_config)."""
    out = Path(out_dir)
    config, generation, _ = _configure(out, family, overrides)
    config.architectures = [FAMILIES[family][1]]
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                  "weight_map": {}}, indent=2))
    config.save_pretrained(out)
    generation.save_pretrained(out)
    return out


def preset_model(preset: str, out_dir) -> Path:
    """The model of a PRESETS entry at `out_dir`, made there first if it is not yet (benchmarks)."""
    family, overrides = PRESETS[preset]
    out = Path(out_dir)
    if not (out / "config.json").exists():
        make = make_streamed_model if preset in STREAMED else make_tiny_model
        make(out, family or "llama", seed=0, **overrides)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kiln.testing.tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--family", choices=sorted(FAMILIES), default=None, help="default: llama (tiny preset)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    preset_family, overrides = PRESETS[args.preset]
    if preset_family and args.family not in (None, preset_family):
        ap.error(f"preset {args.preset} is a {preset_family} model, not {args.family}")
    family = preset_family or args.family or "llama"
    out: Path = args.out_dir
    if not (out / "config.json").exists():
        if out.exists() and any(out.iterdir()):
            ap.error(f"{out} exists, is not empty and holds no config.json")
        # Build beside it and rename, so that an interrupted run never leaves a half model behind.
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        make = make_streamed_model if args.preset in STREAMED else make_tiny_model
        make(partial, family, seed=args.seed, **overrides)
        if out.exists():
            out.rmdir()
        partial.rename(out)
    print(out)


if __name__ == "__main__":
    main()
