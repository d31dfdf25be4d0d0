"""Weights streamed to disk one tensor at a time and mapped back without copies.

- The streamed file holds, tensor for tensor, the bytes the earlier writer stored: every weight
  made at once with ir/quant.py's NumPy quantisers and saved by `safetensors.numpy.save_file`.
- The q4 TVM quantiser gives the NumPy reference's bytes.
- The runtime's CPU weights are views of one memory map of the file; a tampered file is refused.
- An artifact from before (SHA-256 checksums, unaligned safetensors) still loads and runs.
- An interrupted weights stream leaves nothing at the output path.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kiln.errors import KilnError
from kiln.options import CompileOptions

MODES = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
         "q8": dict(dtype="float32", quant="q8"), "q4": dict(dtype="float32", quant="q4"),
         "q4-g128-float-embedding": dict(dtype="float32", quant="q4", group_size=128, quant_embedding=False),
         "fp8": dict(dtype="float32", quant="fp8")}


def _lowered(model_dir, dtype, quant=None, group_size=32, quant_embedding=True):
    from kiln.codegen import lower_graph
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    from kiln.targets import get_target
    target = get_target("cpu", None)
    model = load_hf_model(model_dir)
    options = CompileOptions(quant=quant, quant_lm_head=True, group_size=group_size, quant_embedding=quant_embedding)
    graph, _ = run_pipeline(model.build_graph(dtype, target.page_size), "cpu", options=options)
    return model, graph, lower_graph(graph, target).weights


def _recipe_value(graph, model, name, dtype):
    """A param's array by the recipes' plain meaning, written here apart from ir/weights.py: parts
    converted to the graph dtype, concatenated, then quantised by ir/quant.py's reference."""
    from kiln.ir.quant import SCHEMES
    recipe = graph.params[name].recipe if name in graph.params else None
    if recipe is None:
        return model.weight(name, dtype)
    if "concat" in recipe:
        return np.concatenate([_recipe_value(graph, model, p, dtype) for p in recipe["concat"]], axis=recipe["axis"])
    options = {"group_size": recipe["group_size"]} if "group_size" in recipe else {}
    return SCHEMES[recipe["quantize"]].quantize(_recipe_value(graph, model, recipe["of"], dtype),
                                                **options)[recipe["part"]]


def _old_writer(model, graph, stored, dtype, path):
    """What compile wrote before streaming: every tensor in memory (reference quantisers), one save_file."""
    from safetensors.numpy import save_file
    from kiln.selection.layouts import apply_layout
    tensors = {w.name: apply_layout(w.layout, _recipe_value(graph, model, w.param, dtype)) for w in stored}
    save_file({k: v.view(np.uint8) if v.dtype.name.startswith("float8") else v for k, v in tensors.items()},
              str(path))


@pytest.fixture(scope="module")
def bf16_checkpoint(make_model, tmp_path_factory):
    """The tiny Llama with its weights stored in bfloat16 (as most checkpoints are)."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file
    source, out = make_model("llama"), tmp_path_factory.mktemp("bf16-checkpoint")
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.build
@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_streamed_weights_hold_the_old_writers_bytes(make_model, bf16_checkpoint, tmp_path, mode, checkpoint):
    from safetensors import safe_open
    from kiln.weights.convert import write_weights
    options = MODES[mode]
    model_dir = make_model("llama") if checkpoint == "float32" else bf16_checkpoint
    model, graph, stored = _lowered(model_dir, **options)
    write_weights(model, graph, stored, options["dtype"], tmp_path / "new.safetensors")
    _old_writer(model, graph, stored, options["dtype"], tmp_path / "old.safetensors")
    with safe_open(str(tmp_path / "new.safetensors"), "numpy") as new, \
            safe_open(str(tmp_path / "old.safetensors"), "numpy") as old:
        assert set(old.keys()) == {w.name for w in stored}
        assert {k for k in new.keys() if not k.startswith("__pad.")} == set(old.keys())
        for name in old.keys():
            a, b = new.get_tensor(name), old.get_tensor(name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tobytes() == b.tobytes(), name


def test_read_ahead_gives_what_plain_reads_give(make_model):
    """Tensors read ahead in the announced order, asked for in that order and out of it, are the
    checkpoint's (safetensors' own reader)."""
    from safetensors import safe_open
    from kiln.frontend.checkpoint import Checkpoint
    model_dir = make_model("llama")
    with safe_open(str(model_dir / "model.safetensors"), "numpy") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(want)
    checkpoint = Checkpoint(model_dir)
    checkpoint.read_ahead(names)
    asked = names[:3] + names[4:] + names[3:4]          # one asked for late
    for name in asked:
        assert np.array_equal(checkpoint.get(name), want[name]), name


@pytest.mark.build
def test_streamed_file_is_aligned_for_tvm(make_model, tmp_path):
    from kiln.safetensors_io import ALIGNMENT, read_header
    from kiln.weights.convert import write_weights
    model, graph, stored = _lowered(make_model("llama"), dtype="float32", quant="q4")
    write_weights(model, graph, stored, "float32", tmp_path / "w.safetensors")
    entries, metadata = read_header(tmp_path / "w.safetensors")
    assert metadata["alignment"] == str(ALIGNMENT)
    assert sorted(entries) == sorted(w.name for w in stored)
    assert all(e.begin % ALIGNMENT == 0 for e in entries.values())


def _q4_inputs():
    rng = np.random.default_rng(7)
    normal = rng.standard_normal((96, 512)).astype(np.float32) * 0.02
    heavy = (rng.standard_t(2, (64, 256)) * 0.01).astype(np.float32)
    edge = rng.standard_normal((8, 96)).astype(np.float32)       # 3 groups: vectors of 1 group
    edge[0] = 0                                                   # all-zero groups
    edge[1, :32] = 1e-9                                           # scales that underflow float16
    edge[2, :32] = np.float32(0.5) * np.arange(32) - 8            # values on rounding ties
    edge[3, :32] = 3.0                                            # a constant group
    edge[4, :32] = -edge[4, :32].max()                            # peak magnitudes tied between signs
    return [normal, heavy, edge]


@pytest.mark.build
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("weighted", [False, True])
def test_q4_kernel_gives_the_reference_bytes(group_size, weighted):
    """Without and with calibration's importances (some inputs silent: the floor's 1e-4)."""
    from kiln.codegen.quantizers import quantize_q4
    from kiln.ir.quant import SCHEMES
    rng = np.random.default_rng(5)
    for w in _q4_inputs():
        if w.shape[1] % group_size:
            continue
        importance = None
        if weighted:
            importance = rng.lognormal(0, 2, w.shape[1]).astype(np.float32)
            importance[::7] = 1e-4
        ref = SCHEMES["q4"].quantize(w, group_size=group_size, importance=importance)
        fast = quantize_q4(w, group_size=group_size, importance=importance)
        for part in ("q", "scale"):
            assert fast[part].dtype == ref[part].dtype and fast[part].shape == ref[part].shape
            assert np.array_equal(fast[part].view(np.uint8), ref[part].view(np.uint8)), (w.shape, part)


@pytest.mark.build
@pytest.mark.parametrize("scheme", ["q4", "q8", "fp8", "q4a", "q4k"])
def test_compile_quantizers_in_row_chunks(monkeypatch, scheme):
    """Tensors larger than one block go through in blocks of rows (on every core, for all but q4):
    the reference's bytes."""
    import kiln.codegen.quantizers as quantizers
    from kiln.ir.quant import SCHEMES
    w = np.random.default_rng(3).standard_normal((37, 256)).astype(np.float32)
    monkeypatch.setattr(quantizers, "CHUNK_ELEMENTS", 256 * 5)
    ref, fast = SCHEMES[scheme].quantize(w), quantizers.fast_quantizers()[scheme](w)
    assert ref.keys() == fast.keys()
    for part in ref:
        assert fast[part].dtype == ref[part].dtype and fast[part].shape == ref[part].shape
        assert np.array_equal(fast[part].view(np.uint8), ref[part].view(np.uint8)), part


def test_cpu_weights_are_views_of_one_map(llama_cpu):
    """Every CPU weight lies in the file's memory map at its offset in the file: nothing was copied."""
    from kiln.runtime.model import CompiledModel
    from kiln.safetensors_io import read_header
    artifact, _ = llama_cpu
    model = CompiledModel(artifact)
    entries, _ = read_header(artifact / "weights.safetensors")
    first = model.manifest.weights[0].name
    base = model.weights[0].data_ptr() - entries[first].begin
    raw = np.fromfile(artifact / "weights.safetensors", np.uint8)
    for w, tensor in zip(model.manifest.weights, model.weights):
        entry = entries[w.name]
        assert tensor.data_ptr() == base + entry.begin, w.name
        assert tensor.numpy().view(np.uint8).tobytes() == raw[entry.begin:entry.end].tobytes(), w.name


def test_uploaded_weights_equal_the_mapped_ones(llama_cpu, monkeypatch):
    """The path a GPU artifact takes (a device tensor per weight, copied from the map) run on the CPU:
    fresh buffers, not the map, holding the same bytes."""
    from kiln.runtime.model import CompiledModel
    artifact, _ = llama_cpu
    mapped = CompiledModel(artifact)
    monkeypatch.setattr(CompiledModel, "maps_weights", lambda self: False)
    uploaded = CompiledModel(artifact)
    for w, a, b in zip(mapped.manifest.weights, mapped.weights, uploaded.weights):
        assert a.data_ptr() != b.data_ptr(), w.name
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.numpy().tobytes() == b.numpy().tobytes(), w.name


def _tampered_copy(artifact, out, name, change):
    """A copy of `artifact` whose file `name` is changed by `change(bytearray)`. (Each case gets its own
    copy: a file a failed load still has mapped, or a library it loaded, is never rewritten in place.)"""
    shutil.copytree(artifact, out)
    data = bytearray((out / name).read_bytes())
    change(data)
    (out / name).write_bytes(bytes(data))
    return out


def _flip_middle_bit(data: bytearray) -> None:
    data[len(data) // 2] ^= 0x01


def test_tampered_weights_are_refused_at_load_and_by_inspect_verify(llama_cpu, tmp_path):
    from kiln.runtime.model import CompiledModel
    artifact, _ = llama_cpu
    broken = _tampered_copy(artifact, tmp_path / "weights", "weights.safetensors", _flip_middle_bit)
    with pytest.raises(KilnError, match="checksum mismatch for weights.safetensors"):
        CompiledModel(broken)
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(broken), "--verify"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "checksum mismatch for weights.safetensors" in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(artifact), "--verify"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "every checksum matches" in ok.stdout


def test_a_tampered_library_is_refused_before_it_is_loaded(llama_cpu, tmp_path):
    from kiln.runtime.model import CompiledModel
    artifact, _ = llama_cpu
    library = next(p.name for p in artifact.iterdir() if p.suffix == ".so")
    broken = _tampered_copy(artifact, tmp_path / "library", library, _flip_middle_bit)
    with pytest.raises(KilnError, match=f"checksum mismatch for {library}"):
        CompiledModel(broken)


def test_a_longer_weights_file_is_named_without_hashing(llama_cpu, tmp_path):
    from kiln.runtime.model import CompiledModel
    artifact, _ = llama_cpu
    broken = _tampered_copy(artifact, tmp_path / "longer", "weights.safetensors", lambda data: data.append(0))
    with pytest.raises(KilnError, match="weights.safetensors has .* bytes, the manifest says"):
        CompiledModel(broken)


def test_an_artifact_from_before_still_loads(llama_cpu, tmp_path):
    """SHA-256 checksums and a safetensors file with unaligned tensors (save_file's) still load, and
    generate what the streamed artifact generates."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.safetensors_io import ALIGNMENT, read_header
    artifact, _ = llama_cpu
    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    with safe_open(str(artifact / "weights.safetensors"), "numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("__pad.")}
    for note in range(1, 64):                  # metadata of some length puts the data off the alignment
        save_file(tensors, str(old / "weights.safetensors"), metadata={"note": "x" * note})
        if any(e.begin % ALIGNMENT for e in read_header(old / "weights.safetensors")[0].values()):
            break
    assert any(e.begin % ALIGNMENT for e in read_header(old / "weights.safetensors")[0].values())
    manifest = json.loads((old / "manifest.json").read_text())
    for name, info in manifest["files"].items():
        data = (old / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (old / "manifest.json").write_text(json.dumps(manifest))
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = [1, 5, 9, 13, 17]
    want = LLM(artifact, kv_memory="4MiB").generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    got = LLM(old, kv_memory="4MiB").generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


@pytest.mark.build
def test_an_interrupted_weights_stream_leaves_nothing(make_model, tmp_path, monkeypatch):
    """Ctrl-C half way through the weights: no OUT, no partial directory beside it."""
    import kiln.safetensors_io
    from kiln.compiler import compile_model
    real = kiln.safetensors_io.write_safetensors

    def interrupted(path, specs, produce, **kw):
        specs = list(specs)

        def produce_then_stop(spec):
            if spec is specs[len(specs) // 2]:
                raise KeyboardInterrupt
            return produce(spec)
        return real(path, specs, produce_then_stop, **kw)
    monkeypatch.setattr(kiln.safetensors_io, "write_safetensors", interrupted)
    out = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        compile_model(make_model("llama"), out, CompileOptions(target="cpu"), show=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_run_sizes_the_kv_cache_for_the_request(llama_cpu):
    """`kiln run` holds the prompt and --max-tokens, not the model's whole context; --kv-memory caps it."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.tokenizer import Tokenizer
    artifact, _ = llama_cpu
    want_tokens = len(Tokenizer(artifact).encode("hello there")) + 40
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "run", str(artifact), "--prompt", "hello there",
                           "--max-tokens", "40"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    page = json.loads((artifact / "manifest.json").read_text())["kv"]["page_size"]
    pages = -(-want_tokens // page)
    assert f"KV cache: {pages} pages of {page} tokens" in proc.stderr
    assert f"sized for {want_tokens} tokens" in proc.stderr
    one_page = LLM(artifact, max_num_seqs=1, size_kv_for=1)
    capped = LLM(artifact, max_num_seqs=1, kv_memory=one_page.model.bytes_per_page, size_kv_for=want_tokens)
    assert one_page.engine.pool.num_pages == 1
    assert capped.engine.pool.num_pages == 1 and f"{want_tokens} tokens asked for" in capped.describe_kv()
