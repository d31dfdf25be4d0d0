"""Artifacts compiled without weights, and seeded random weights drawn later from the manifest.

- `compile --no-weights` writes all but the weights file and says so in the manifest; the runtime
  refuses such an artifact with one line naming `kiln fill-weights`; checksums still verify.
- fill-weights writes one tensor per manifest weight with its shape and dtype (rope's frequencies
  computed as compile does); the filled artifact runs to finite logits (float32, q8, q4, fp8).
- At Llama-3.1-8B's widths every kind of stored tensor is finite and dequantises to std ~0.02 (norms
  ~1), so a projection of a unit-RMS vector keeps a sane size.
- The bytes depend on the seed alone (not on the thread count); another seed gives others.
- Weights from a checkpoint, or a file fill-weights did not write, are never replaced; generated
  ones only with force; an interrupted fill leaves the artifact as it was. inspect says which.
- Drawing needs neither TVM nor torch.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from paging import make_step_inputs

from kiln.artifact import MANIFEST, WEIGHTS, file_digest, read_manifest, start_verify, verify_files
from kiln.errors import KilnError
from kiln.interface import Manifest
from kiln.options import CompileOptions
from kiln.weights.generated import fill_weights

MODES = {"float32": {}, "q8": {"quant": "q8"}, "q4": {"quant": "q4"}, "fp8": {"quant": "fp8"}}


def _manifest(artifact) -> dict:
    return json.loads((artifact / MANIFEST).read_text())


def _copy(artifact, tmp_path, name="copy"):
    return shutil.copytree(artifact, tmp_path / name)


@pytest.fixture(scope="module")
def no_weights(make_model):
    """mode -> the tiny Llama compiled for the CPU with --no-weights (float32 through the CLI, which
    must exit 0). Read only."""
    from artifact_cache import cli_artifact, cpu_artifact
    model = make_model("llama")
    return {mode: cli_artifact(model, "--no-weights") if mode == "float32" else
            cpu_artifact(model, weights=False, **options) for mode, options in MODES.items()}


@pytest.fixture(scope="module")
def with_weights(llama_cpu):
    """The same float32 artifact compiled with its checkpoint's weights (tests/conftest.py). Read only."""
    return llama_cpu[0]


@pytest.fixture(scope="module")
def filled(no_weights, tmp_path_factory):
    """mode -> a copy of the no-weights artifact filled with seed 0. Read only."""
    root = tmp_path_factory.mktemp("filled")
    out = {}
    for mode, artifact in no_weights.items():
        out[mode] = shutil.copytree(artifact, root / mode)
        fill_weights(out[mode], seed=0)
    return out


@pytest.mark.build
def test_no_weights_artifact_holds_all_but_the_weights(no_weights, with_weights):
    art = no_weights["float32"]
    m, full = _manifest(art), _manifest(with_weights)
    assert not (art / WEIGHTS).exists() and WEIGHTS not in m["files"]
    assert m["weights_source"] == "absent" and full["weights_source"] == "checkpoint"
    assert set(m["files"]) == set(full["files"]) - {WEIGHTS}
    varies = {"files", "weights_source", "compile_seconds", "passes"}     # timings, and what differs on purpose
    assert {k: v for k, v in m.items() if k not in varies} == {k: v for k, v in full.items() if k not in varies}
    verify_files(art, Manifest.from_json(m))
    start_verify(art, Manifest.from_json(m))()


@pytest.mark.build
def test_runtime_refuses_an_artifact_without_weights(no_weights):
    from kiln.runtime.model import CompiledModel
    art = no_weights["q8"]
    with pytest.raises(KilnError) as e:
        CompiledModel(art)
    message = str(e.value)
    assert "\n" not in message and "--no-weights" in message
    assert f"kiln fill-weights {art} --seed N" in message


@pytest.mark.build
@pytest.mark.parametrize("mode", MODES)
def test_filled_weights_have_the_manifests_shapes_and_dtypes(filled, mode):
    from safetensors import safe_open
    from kiln.frontend.rope import inv_freq
    from kiln.safetensors_io import read_header
    art = filled[mode]
    m = read_manifest(art, verify=True).to_json()  # the recorded digest and size are the file's
    assert m["weights_source"] == "generated" and m["files"][WEIGHTS]["generated"] == {"seed": 0}
    with safe_open(str(art / WEIGHTS), framework="numpy") as f:
        stored = {name: f.get_tensor(name) for name in f.keys() if not name.startswith("__pad.")}
    assert set(stored) == {w["name"] for w in m["weights"]}                 # every weight, none else
    entries, _ = read_header(art / WEIGHTS)
    assert sorted(entries, key=lambda name: entries[name].begin) == [w["name"] for w in m["weights"]]
    for w in m["weights"]:
        arr = stored[w["name"]]
        assert list(arr.shape) == w["shape"]
        assert arr.dtype.name == ("uint8" if w["dtype"].startswith("float8") else w["dtype"]), w
        if w["dtype"] == "float8_e4m3fn":
            assert not np.isin(arr, [0x7F, 0xFF]).any(), "float8 e4m3 NaN codes"
        if arr.dtype.kind == "f":
            assert np.isfinite(arr).all() and arr.std() > 0, w["name"]
    c = m["model"]["config"]
    np.testing.assert_array_equal(stored["rope.inv_freq"], inv_freq(c["head_dim"], c["rope_theta"], c["rope_scaling"]))


@pytest.mark.build
@pytest.mark.parametrize("mode", MODES)
def test_filled_artifact_runs_to_finite_logits(filled, mode):
    from paging import make_step_inputs
    from kiln.runtime.model import CompiledModel
    model = CompiledModel(filled[mode])
    model.allocate_kv(8 * model.bytes_per_page)
    ids = [3, 17, 42, 99, 7, 250, 11, 64, 5, 300]
    logits = model.forward(make_step_inputs([(ids, 0, [2, 5])], model.page_size))
    nxt = int(np.argmax(logits[0]))
    logits = np.concatenate([logits, model.forward(make_step_inputs([([nxt], len(ids), [2, 5])], model.page_size))])
    assert logits.shape == (2, model.vocab_size)
    assert np.isfinite(logits).all() and (logits.std(axis=1) > 1e-3).all()


def _fake_artifact(path, weights: list[dict]):
    """A directory whose manifest lists `weights` and nothing a fill does not read."""
    from kiln.interface import INTERFACE_VERSION
    path.mkdir()
    (path / MANIFEST).write_text(json.dumps({
        "kiln_version": "test", "interface_version": INTERFACE_VERSION, "weights": weights, "files": {},
        "weights_source": "absent", "model": {"architecture": "none", "config": {}, "source": ""},
        "target": {"name": "cpu", "device": "cpu"}, "dtype": "float32", "quantization": {},
        "kv": {"page_size": 16, "layers": []}, "vocab_size": 0, "max_context": 0, "library": "none"}))
    return path


def _stored(param, shape, dtype, layout="nk"):
    return {"name": param if layout == "nk" else f"{param}@{layout}", "param": param, "layout": layout,
            "shape": list(shape), "dtype": dtype}


def _unpack(arr, layout):
    """[n / NB, k, NB] -> [n, k] (selection/layouts.py's packing, undone)."""
    return arr if layout == "nk" else arr.transpose(0, 2, 1).reshape(-1, arr.shape[1])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "q8", "q4", "fp8", "q4a", "q4k"])
def test_stored_tensors_are_sane_at_llama_8b_widths(tmp_path, dtype, quant):
    """Rows of down_proj (14336 inputs) and o_proj (4096), a norm; every code and scale (or q4a's and
    q4k's tables) as stored."""
    import ml_dtypes
    from kiln.ir.quant import SCHEMES
    rows, layout = 128, "packed64"
    weights = [_stored("model.norm.weight", [4096], dtype)]
    for k in (14336, 4096):
        param = f"w{k}"
        if quant is None:
            weights.append(_stored(param, [rows // 64, k, 64], dtype, layout))
            continue
        s = SCHEMES[quant]
        q_shape, scale_shape = s.part_shapes(rows, k, 32).values()
        weights += [_stored(f"{param}.{quant}", [rows // 64, q_shape[1], 64], s.weight_dtype, layout),
                    _stored(f"{param}.{quant}_scale", scale_shape, s.scale_dtype)]
    art = _fake_artifact(tmp_path / "art", weights)
    fill_weights(art, seed=3)
    from kiln.safetensors_io import read_header, read_tensor
    entries, _ = read_header(art / WEIGHTS)
    get = {w["param"]: read_tensor(art / WEIGHTS, entries[w["name"]]) for w in weights}
    norm = get["model.norm.weight"].astype(np.float32)
    assert (norm >= 1).all() and (norm < 1.07).all() and norm.std() > 0
    x = np.random.default_rng(0)
    for k in (14336, 4096):
        if quant is None:
            w = _unpack(get[f"w{k}"], layout).astype(np.float32)
        else:
            codes = _unpack(get[f"w{k}.{quant}"], layout)
            if quant == "fp8":
                codes = codes.view(ml_dtypes.float8_e4m3fn)
            options = {"group_size": 32} if SCHEMES[quant].grouped else {}
            w = SCHEMES[quant].dequantize({"q": codes, "scale": get[f"w{k}.{quant}_scale"]}, **options)
        assert w.shape == (rows, k) and np.isfinite(w).all()
        assert 0.016 < w.std() < 0.024 and abs(w.mean()) < 1e-3, (k, w.std(), w.mean())
        y = w @ (x.standard_normal(k).astype(np.float32))                 # a unit-RMS input
        assert 0.016 * np.sqrt(k) < y.std() < 0.024 * np.sqrt(k) * 1.3


@pytest.mark.build
def test_the_bytes_depend_on_the_seed_alone(no_weights, tmp_path, monkeypatch):
    import kiln.weights.generated as generated
    monkeypatch.setattr(generated, "CHUNK_BYTES", 4096)         # several chunks per tensor
    digests = {}
    for name, seed, cores in [("a", 7, 1), ("b", 7, 3), ("c", 8, 3)]:
        monkeypatch.setattr(generated, "_usable_cores", lambda: cores)
        art = _copy(no_weights["q4"], tmp_path, name)
        digests[name] = fill_weights(art, seed=seed).files[WEIGHTS]["blake3"]
        assert digests[name] == file_digest(art / WEIGHTS)
    assert digests["a"] == digests["b"] != digests["c"]


@pytest.mark.build
def test_checkpoint_weights_are_never_replaced(with_weights, tmp_path):
    art = _copy(with_weights, tmp_path)
    before = file_digest(art / WEIGHTS)
    for force in (False, True):
        with pytest.raises(KilnError, match="from a checkpoint"):
            fill_weights(art, force=force)
    legacy = _manifest(art)                         # a manifest from before weights_source
    del legacy["weights_source"]
    (art / MANIFEST).write_text(json.dumps(legacy))
    with pytest.raises(KilnError, match="from a checkpoint"):
        fill_weights(art, force=True)
    assert file_digest(art / WEIGHTS) == before


@pytest.mark.build
def test_generated_weights_are_redrawn_only_with_force(no_weights, tmp_path):
    art = _copy(no_weights["float32"], tmp_path)
    fill_weights(art, seed=0)
    with pytest.raises(KilnError, match="--force"):
        fill_weights(art, seed=1)
    assert _manifest(art)["files"][WEIGHTS]["generated"] == {"seed": 0}
    m = fill_weights(art, seed=1, force=True)
    assert m.files[WEIGHTS]["generated"] == {"seed": 1} and _manifest(art) == m.to_json()
    verify_files(art, m)
    assert sorted(p.name for p in art.iterdir()) == sorted([MANIFEST, *m.files])     # no partial file left


@pytest.mark.build
def test_a_weights_file_not_written_here_is_not_overwritten(no_weights, tmp_path):
    art = _copy(no_weights["float32"], tmp_path)
    (art / WEIGHTS).write_bytes(b"someone else's weights")
    for force in (False, True):
        with pytest.raises(KilnError, match="not written by kiln fill-weights"):
            fill_weights(art, force=force)
    assert (art / WEIGHTS).read_bytes() == b"someone else's weights"


@pytest.mark.build
@pytest.mark.parametrize("already_filled", [False, True])
def test_an_interrupted_fill_leaves_the_artifact_as_it_was(no_weights, tmp_path, monkeypatch, already_filled):
    import kiln.weights.generated as generated
    art = _copy(no_weights["q8"], tmp_path)
    if already_filled:
        fill_weights(art, seed=0)
    files = {p.name: p.read_bytes() for p in art.iterdir()}
    real = generated._fill_chunk

    def interrupted(fill, seed, tensor, chunk, out):
        if tensor == 6:          # o_proj codes, mid-file
            raise KeyboardInterrupt
        real(fill, seed, tensor, chunk, out)
    monkeypatch.setattr(generated, "_fill_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fill_weights(art, seed=1, force=True)
    assert {p.name: p.read_bytes() for p in art.iterdir()} == files


@pytest.mark.build
def test_inspect_says_where_the_weights_came_from(no_weights, with_weights, filled, tmp_path):
    from click.testing import CliRunner
    from kiln.cli import main
    from kiln.inspect import summary
    assert "generated (seeded random, seed 0): not a trained model" in summary(filled["q4"])
    assert "absent (compiled with --no-weights" in summary(no_weights["q4"])
    assert "from the checkpoint" in summary(with_weights)
    art = _copy(no_weights["float32"], tmp_path)
    result = CliRunner().invoke(main, ["fill-weights", str(art), "--seed", "5"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["inspect", str(art), "--verify"])
    assert result.exit_code == 0, result.output
    assert "seeded random, seed 5" in result.output and "every checksum matches" in result.output


@pytest.mark.build
def test_drawing_needs_neither_tvm_nor_torch(no_weights, tmp_path):
    art = _copy(no_weights["fp8"], tmp_path)
    script = ("import sys\n"
              "for name in ('tvm', 'tvm_ffi', 'torch', 'transformers'):\n"
              "    sys.modules[name] = None       # any import of them fails\n"
              "from kiln.weights.generated import fill_weights\n"
              f"fill_weights({str(art)!r}, seed=2)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _manifest(art)["files"][WEIGHTS]["generated"] == {"seed": 2}


@pytest.mark.build
def test_a_config_only_model_compiles_without_weights_and_runs_once_filled(tmp_path):
    """What bench/gpu_kit.py does for the 1B/8B shapes: no checkpoint at all, an artifact compiled
    from the config alone, weights drawn afterwards; its tensors are those of a real compile."""
    from kiln.compiler import compile_model
    from kiln.runtime.model import CompiledModel
    from kiln.testing.tiny import make_config_only_model
    from kiln.weights.generated import fill_weights
    model_dir = make_config_only_model(tmp_path / "model", "llama", num_hidden_layers=1)
    assert not list(model_dir.glob("*.safetensors"))
    with pytest.raises(Exception, match="missing from the checkpoint"):
        compile_model(model_dir, tmp_path / "refused", show=None)           # weights are needed for a real one
    m = compile_model(model_dir, tmp_path / "art", CompileOptions(weights=False), show=None)
    # embedding, norms (2 + final), qkv, rope frequencies, o, gate_up, down, LM head
    assert m.weights_source == "absent" and len(m.weights) == 10
    fill_weights(tmp_path / "art", seed=3)
    model = CompiledModel(tmp_path / "art")
    model.allocate_kv(8 * model.bytes_per_page)
    logits = model.forward(make_step_inputs([([5, 6, 7], 0, [0])], model.page_size))
    assert logits.shape == (1, model.vocab_size) and np.isfinite(logits).all()
