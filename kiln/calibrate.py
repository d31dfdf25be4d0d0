"""Calibration (`kiln compile --calibrate TEXT`): how much each input of each linear matters, measured
on a text by the float model, for the weight quantisers to weigh their errors by (llama.cpp's
importance matrix; AWQ and GPTQ start from the same statistic).

The text is tokenised with the model's own tokenizer and cut into chunks of CHUNK_TOKENS (at most
MAX_TOKENS in all). The model's float32 graph, as the frontend builds it, runs each batch of chunks as
one prefill step of several sequences through the reference interpreter, which holds one weight and
the live activations at a time (compile's bounded memory); every token's logits are computed, so that
the LM head sees every row. Each linear's importance is the mean over
all tokens of its input's square, one value per input, scaled to mean 1 and floored at FLOOR (an input
silent on this text keeps a little weight: a quantiser must not spend nothing on it). The result is
stored in the artifact (CALIBRATION_FILE), so that `kiln attach-weights` quantises the same way.

The same run measures what int8 activations cost each linear (the target's blocks of activation_block
inputs, as the q8/q4 kernels round them): on a sample of each step's rows, the root-mean-square change
of the linear's float output when its input is rounded so, relative to the output's own. A linear
above ACTIVATION_ERROR_BOUND keeps float activations (the compile records which); rounding errors of
well-behaved inputs are some 0.5-1 %, while an outlier channel that crushes its block's other inputs
to zero costs tens of percent."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

CHUNK_TOKENS = 512
MAX_TOKENS = 8192
STEP_SEQUENCES = 4
FLOOR = 1e-4
ACTIVATION_ERROR_BOUND = 0.05      # int8 activations' relative output error above which a linear keeps floats
SAMPLE_ROWS = 256                  # rows of each step whose int8 activations' error is measured
CALIBRATION_FILE = "calibration.safetensors"


def text_chunks(text_file: str | Path, tokenizer_json: Path, context: int) -> list[list[int]]:
    """The text's tokens in chunks of CHUNK_TOKENS (or the model's context), MAX_TOKENS at most."""
    from tokenizers import Tokenizer
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"--calibrate {text_file}: cannot read it as UTF-8 text ({e})") from None
    ids = Tokenizer.from_file(str(tokenizer_json)).encode(text, add_special_tokens=False).ids[:MAX_TOKENS]
    size = min(CHUNK_TOKENS, context)
    chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
    if not chunks or len(chunks[0]) < 16:
        raise KilnError(f"--calibrate {text_file}: {len(ids)} tokens are too few to calibrate on (at least 16)")
    return chunks


def _prefill_step(chunks: list[list[int]], page_size: int) -> dict[str, np.ndarray]:
    """The step inputs of one prefill of `chunks` from position 0, each sequence on pages of its own,
    every token's logits returned (as the runtime builds a step: kiln/runtime/step.py)."""
    from kiln.runtime.step import SeqChunk, context_rows, step_inputs
    seqs, next_page = [], 0
    for ids in chunks:
        pages = list(range(next_page, next_page - (-len(ids) // page_size)))
        next_page = pages[-1] + 1
        slots = [pages[t // page_size] * page_size + t % page_size for t in range(len(ids))]
        seqs.append(SeqChunk(ids, 0, pages, slots, all_rows=True))
    step = step_inputs(seqs, page_size)
    return {**step, **context_rows(step, page_size)}


def _rounding_error(x: np.ndarray, w: np.ndarray, block: int) -> tuple[float, float]:
    """(Σ (x·wᵀ - x̃·wᵀ)², Σ (x·wᵀ)²) over a sample of x's rows, x̃ the rows rounded to int8 in blocks."""
    from kiln.ir.quant import quantize_activations
    rows = x[::max(1, -(-x.shape[0] // SAMPLE_ROWS))].astype(np.float32)
    levels, scale = quantize_activations(rows, block)
    rounded = (levels * scale[..., None]).reshape(rows.shape)
    exact = rows.astype(np.float64) @ w.T.astype(np.float64)
    error = (rows - rounded).astype(np.float64) @ w.T.astype(np.float64)
    return float((error * error).sum()), float((exact * exact).sum())


def input_importance(model, chunks: list[list[int]], page_size: int, progress=None,
                     activation_block: int = 0) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """(plain linear weight -> float32 [inputs]: the mean square of each of its inputs over `chunks`,
    scaled to mean 1, floored at FLOOR; plain linear weight -> the relative error of its output on int8
    activations in blocks of `activation_block`, for linears whose inputs the blocks divide (none for 0))."""
    from kiln.interface import pages_name
    from kiln.ir import input_of, weight_loader
    from kiln.ir.interpreter import interpret

    graph = model.build_graph("float32", page_size)
    weights = weight_loader(graph, lambda name: model.weight(name, "float32"))
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    errors: dict[str, np.ndarray] = {}

    def observe(node, args) -> None:
        if node.op != "linear" or input_of(node, "weight") not in graph.params:
            return
        x = args[0].reshape(-1, args[0].shape[-1])
        name = input_of(node, "weight")
        sums[name] = sums.get(name, 0) + np.square(x, dtype=np.float64).sum(axis=0)
        counts[name] = counts.get(name, 0) + x.shape[0]
        if activation_block and x.shape[1] % activation_block == 0:
            errors[name] = errors.get(name, 0) + np.array(_rounding_error(x, args[1], activation_block))

    for start in range(0, len(chunks), STEP_SEQUENCES):
        batch = chunks[start:start + STEP_SEQUENCES]
        step = _prefill_step(batch, page_size)
        pages = {pages_name(layer): np.zeros(spec.page_shape(len(step["page_values"])), np.float32)
                 for layer, spec in graph.kv_specs.items()}
        interpret(graph, {**step, **pages}, weights, observe)
        if progress:
            progress(f"calibration: {min(start + STEP_SEQUENCES, len(chunks))}/{len(chunks)} chunks",
                     min(start + STEP_SEQUENCES, len(chunks)) / len(chunks))
    importance = {}
    for name, total in sums.items():
        mean_square = total / counts[name]
        scale = mean_square.mean()
        importance[name] = np.maximum(mean_square / scale if scale > 0 else np.ones_like(mean_square),
                                      FLOOR).astype(np.float32)
    relative = {name: float(np.sqrt(err / total)) if total > 0 else 0.0 for name, (err, total) in errors.items()}
    return importance, relative


def calibrate(model, text_file: str | Path, tokenizer_json: Path, page_size: int, out_dir: Path,
              progress=None, activation_block: int = 0) -> tuple[dict[str, np.ndarray], dict]:
    """Measure the importances on `text_file`, write them to out_dir/CALIBRATION_FILE; return them and
    the manifest's record of it, which names the linears whose int8 activations (in blocks of
    `activation_block`; 0: not measured) err more than ACTIVATION_ERROR_BOUND (`float_activations`)."""
    from kiln.safetensors_io import TensorSpec, write_safetensors
    chunks = text_chunks(text_file, tokenizer_json, model.config.max_context)
    importance, activation_error = input_importance(model, chunks, page_size, progress, activation_block)
    names = sorted(importance)
    write_safetensors(out_dir / CALIBRATION_FILE, [TensorSpec(n, importance[n].shape, "float32") for n in names],
                      lambda spec: importance[spec.name], metadata={"format": "kiln-calibration"}, align=False)
    digest = hashlib.sha256(Path(text_file).read_bytes()).hexdigest()
    record = {"file": CALIBRATION_FILE, "text": str(Path(text_file).resolve()), "text_sha256": digest,
              "tokens": sum(map(len, chunks)), "chunks": len(chunks), "linears": len(names)}
    if activation_error:
        worst = max(activation_error, key=activation_error.get)
        record["activations"] = {
            "block": activation_block, "bound": ACTIVATION_ERROR_BOUND, "measured": len(activation_error),
            "largest": [worst, round(activation_error[worst], 5)],
            "float": sorted(n for n, e in activation_error.items() if e > ACTIVATION_ERROR_BOUND)}
    return importance, record


def read_importance(artifact_dir: Path) -> dict[str, np.ndarray]:
    """The importances an artifact's compile measured (CALIBRATION_FILE)."""
    from kiln.safetensors_io import read_header, read_tensor
    path = Path(artifact_dir) / CALIBRATION_FILE
    entries, _ = read_header(path)
    return {name: np.array(read_tensor(path, entry), np.float32) for name, entry in entries.items()}
