"""A transformers decoder exported by torch.onnx.export (dynamo) as ONNX decoders take it: token ids, attention
mask and positions, each layer's past keys and values as inputs, the logits and present keys and values as
outputs; batch, new tokens, past and total dynamic.

    python -m kiln.testing.onnx_export HF_MODEL_DIR OUT_DIR [OPSET]

writes OUT_DIR/model.onnx (+ model.onnx.data) and copies config.json and the tokenizer files beside it. OPSET:
the exporter's default (18) spells attention, RMSNorm and rotary embeddings out; 23 writes ONNX's Attention,
RMSNormalization and RotaryEmbedding ops. Run in a process of its own: the export holds torch's exporter state."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

BESIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def export_decoder(source: Path, out: Path, opset: int | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    config, layers = model.config, model.config.num_hidden_layers

    class Decoder(torch.nn.Module):          # flat past/present tensors
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])

    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    names = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    b, s, p, t = (torch.export.Dim(n, min=1) for n in ("batch", "seq", "past", "total"))
    example = (torch.randint(0, config.vocab_size, (1, 3)), torch.ones(1, 8, dtype=torch.int64),
               torch.arange(5, 8)[None], *[torch.randn(1, heads, 5, dim) for _ in names])
    out.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(Decoder(), example, str(out / "model.onnx"), dynamo=True, external_data=True, optimize=True,
                      opset_version=opset,
                      input_names=["input_ids", "attention_mask", "position_ids", *names],
                      output_names=["logits", *[n.replace("past_key_values", "present") for n in names]],
                      dynamic_shapes={"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: t},
                                      "position_ids": {0: b, 1: s}, "past": tuple({0: b, 2: p} for _ in names)})
    for name in BESIDE:
        if (source / name).exists():
            shutil.copy(source / name, out / name)


if __name__ == "__main__":
    export_decoder(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
