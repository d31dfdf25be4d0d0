"""ONNX decoders for the importer's tests, made here from tiny transformers models: by ONNX Runtime GenAI's
model builder (fp32 and int4) and by torch.onnx.export; and onnxruntime's answers on them (the reference).

Both are cached like the test artifacts (tests/artifact_cache.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from artifact_cache import entry

# The builder takes any Linear with vocab_size outputs for the LM head, so the MLP must be wider or narrower than
# the vocabulary (kiln's tiny models have 512 of each). Its Phi-3 is the 4k one: max_position_embeddings equal to
# original_max_position_embeddings, and plain rope (with transformers 5's rope_parameters it reads no LongRoPE).
# "tied": a Llama whose LM head is its embedding table (the builder gathers from the head's weight).
SHAPE = {"intermediate_size": 640}
# the exporters' processes on one thread: the other test worker may be starting a Ray cluster meanwhile
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MODELS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}),
          "phi3": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                            "original_max_position_embeddings": 4096, "max_position_embeddings": 4096}),
          "tied": ("llama", {"tie_word_embeddings": True}),
          # LongRoPE: the builder writes short and long tables and an If choosing by the sequence's length
          "phi3_longrope": ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                         "short_factor": [1.0 + 0.1 * i for i in range(16)],
                                                         "long_factor": [2.0 + 0.2 * i for i in range(16)]},
                                     "original_max_position_embeddings": 64, "max_position_embeddings": 256})}


def hf_model(family: str, seed: int = 0) -> Path:
    def build(folder: Path) -> None:
        from kiln.testing.tiny import make_tiny_model
        import json
        name, overrides = MODELS[family]
        make_tiny_model(folder / "model", name, seed=seed, **SHAPE, **overrides)
        config = json.loads((folder / "model" / "config.json").read_text())
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type") == "longrope":         # the builder reads the older key
            config["rope_parameters"] = {**rope, "type": "longrope"}
            (folder / "model" / "config.json").write_text(json.dumps(config, indent=1))
    return entry("onnx", f"hf-{family}-seed{seed}", build) / "model"


def genai_model(family: str, precision: str = "fp32", *extra_options: str, provider: str = "cpu") -> Path:
    """The folder the builder writes (model.onnx, model.onnx.data, genai_config.json, tokenizer files);
    `extra_options` as its --extra_options takes them (block_size=128, is_symmetric=false); `provider` the
    execution provider the file is built for (cuda: float16 or bfloat16 activations, GQA rotating q and k)."""
    source = hf_model(family)

    def build(folder: Path) -> None:
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o",
                   str(folder / "model"), "-p", precision, "-e", provider, "-c", str(folder / "cache")]
        if extra_options:
            command += ["--extra_options", *extra_options]
        done = subprocess.run(command, capture_output=True, text=True, env=ONE_THREAD)
        if done.returncode:
            raise RuntimeError(f"the builder failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        shutil.rmtree(folder / "cache", ignore_errors=True)
    key = ["genai", family, precision, *extra_options] + ([provider] if provider != "cpu" else [])
    return entry("onnx", "-".join(key), build) / "model"




def torch_export(family: str, opset: int | None = None) -> Path:
    """The folder torch.onnx.export (dynamo) writes for a tiny `family` model, with its past keys and values as
    inputs and present ones as outputs; config.json and the tokenizer files beside it, as a user keeps them.
    `opset` 23: ONNX's Attention, RMSNormalization and RotaryEmbedding ops (the exporter's default spells them out)."""
    source = hf_model(family)

    def build(folder: Path) -> None:
        out = folder / "model"
        done = subprocess.run([sys.executable, "-m", "kiln.testing.onnx_export", str(source), str(out),
                               *([str(opset)] if opset else [])], capture_output=True, text=True, env=ONE_THREAD)
        if done.returncode:
            raise RuntimeError(f"torch.onnx.export failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return entry("onnx", f"torch-{family}" + (f"-opset{opset}" if opset else ""), build) / "model"


class ORTDecoder:
    """onnxruntime on a decoder file with past/present inputs: one sequence, its KV cache carried between calls."""

    def __init__(self, folder: Path, optimized: bool = True):
        import json

        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1    # beside the other test worker's Ray
        if not optimized:      # onnxruntime 1.32 fails on the builder's float16 CPU files where the casts it inserts
            options.enable_mem_reuse = options.enable_mem_pattern = False      # around float16 ops reuse a buffer
        config = Path(folder) / "genai_config.json"
        self.head_size = json.loads(config.read_text())["model"]["decoder"]["head_size"] if config.exists() else None
        self.session = ort.InferenceSession(str(Path(folder) / "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.reset()

    def reset(self) -> None:
        self.past = {}
        for name, info in self.inputs.items():
            if name.startswith("past"):
                heads, dim = info.shape[1], info.shape[3] if isinstance(info.shape[3], int) else self.head_size
                dtype = np.float16 if info.type == "tensor(float16)" else np.float32
                self.past[name] = np.zeros((1, heads, 0, dim), dtype)
        self.length = 0

    def step(self, ids: list[int]) -> np.ndarray:
        """The logits of every new token, after those already fed."""
        self.length += len(ids)
        feed = {"input_ids": np.asarray([ids], np.int64), **self.past}
        if "attention_mask" in self.inputs:
            feed["attention_mask"] = np.ones((1, self.length), np.int64)
        if "position_ids" in self.inputs:
            feed["position_ids"] = np.arange(self.length - len(ids), self.length, dtype=np.int64)[None]
        out = dict(zip(self.outputs, self.session.run(None, feed)))
        for name in self.past:
            self.past[name] = out[name.replace("past_key_values", "present")]
        return out["logits"][0].astype(np.float32)

    def greedy(self, ids: list[int], new_tokens: int) -> list[int]:
        self.reset()
        out = [int(self.step(list(ids))[-1].argmax())]
        while len(out) < new_tokens:
            out.append(int(self.step([out[-1]])[-1].argmax()))
        return out
