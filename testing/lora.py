"""Random LoRA adapters in PEFT's file format (adapter_config.json + adapter_model.safetensors), written
with NumPy for a model's config: for benchmarks and for tests where peft is not installed (a GPU machine)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: str | Path, config: dict, rank: int, seed: int, modules=MODULES,
                         b_scale: float = 0.01) -> Path:
    """A rank-`rank` adapter of every layer's `modules` of the model whose config.json is `config`: A with
    unit-variance outputs on unit inputs, B times `b_scale`, lora_alpha 2·rank."""
    from safetensors.numpy import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            out, inp = shapes[module]
            where = "self_attn" if module[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}.lora_{{}}.weight"
            tensors[key.format("A")] = (rng.standard_normal((rank, inp)) / np.sqrt(inp)).astype(np.float32)
            tensors[key.format("B")] = (rng.standard_normal((out, rank)) * b_scale).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(modules)}))
    return folder
