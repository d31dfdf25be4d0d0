"""`kiln attach-weights`: a checkpoint's weights written into an artifact compiled with --no-weights.

- The weights file has the bytes compile writes (the digest of the same compile with its weights):
  float32 through the CLI; and, on copies of compiled artifacts with their weights taken out, q4 in
  groups of 128 with int8 activations and a fusion pass disabled, q8 with float embedding and LM
  head, MoE q4, and MLA with an expanded-prefill threshold or an int8 latent cache.
- The attached artifact generates what transformers generates.
- With no TVM compiler (a GPU machine's runtime-only TVM) it imports no Relax, asks no
  LLVM, and writes the same bytes.
- A model of another config is refused with the differing fields named, before anything is written;
  a checkpoint's weights are never replaced, generated ones only with --force.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kiln.artifact import MANIFEST, WEIGHTS, read_manifest
from kiln.weights.attach import attach_weights
from kiln.cli import main
from kiln.errors import KilnError
from kiln.weights.generated import fill_weights

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

COMPILED = {        # id -> (family, compile options)
    "llama-q4-g128-int8act-no-gate-up-fusion": ("llama", dict(quant="q4", group_size=128,
                                                              disable_passes=frozenset({"fuse_gate_up"}))),
    "qwen2-q8-float-embedding-and-head": ("qwen2", dict(quant="q8", quant_embedding=False, quant_lm_head=False)),
    "mixtral-q4": ("mixtral", dict(quant="q4", int8_activations=False)),
    "deepseek_v2-mla-expanded-from-2": ("deepseek_v2", dict(dtype="float32", mla_expanded_from=2)),
    "deepseek_v2-mla-int8-kv": ("deepseek_v2", dict(dtype="float32", kv_dtype="int8")),
}


def weights_digest(artifact) -> str:
    return read_manifest(artifact, verify=False).files[WEIGHTS]["blake3"]


def without_weights(artifact, tmp_path):
    """A copy of `artifact` as `compile --no-weights` leaves it (tests/test_generated_weights.py checks
    that such a manifest differs from the full one in its files and weights_source alone)."""
    copy = shutil.copytree(artifact, tmp_path / "bare")
    (copy / WEIGHTS).unlink()
    manifest = json.loads((copy / MANIFEST).read_text())
    del manifest["files"][WEIGHTS]
    (copy / MANIFEST).write_text(json.dumps({**manifest, "weights_source": "absent"}))
    return copy


def test_cli_attaches_the_bytes_compile_writes_and_generation_equals_transformers(make_model, llama_cpu, tmp_path):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from reference import hf_greedy_uncached, random_prompt
    with_weights, hf = llama_cpu
    from artifact_cache import cli_artifact
    model = make_model("llama")
    bare = shutil.copytree(cli_artifact(model, "--no-weights"), tmp_path / "bare")   # compile must exit 0
    result = CliRunner().invoke(main, ["attach-weights", str(bare), str(model)])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(bare)                       # every checksum verified
    assert manifest.weights_source == "checkpoint" and weights_digest(bare) == weights_digest(with_weights)
    ids = random_prompt(20, 3)
    [out] = LLM(bare, kv_memory="8MiB").generate([ids], SamplingParams(temperature=0.0, max_tokens=8,
                                                                        ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy_uncached(hf, ids, 8)


@pytest.mark.parametrize("case", COMPILED)
def test_attached_weights_are_the_bytes_compile_wrote(make_model, compiled_family, tmp_path, case):
    family, options = COMPILED[case]
    artifact = compiled_family(family, **options)
    bare = without_weights(artifact, tmp_path)
    attach_weights(bare, make_model(family))
    assert weights_digest(bare) == weights_digest(artifact)
    read_manifest(bare)


def test_attaching_needs_no_llvm(make_model, compiled_family, tmp_path, monkeypatch):
    """As on a runtime-only TVM: nothing may ask LLVM about the CPU, and q4 runs the reference quantiser."""
    import kiln.host_cpu as host
    import kiln.targets.cpu as cpu
    family, options = COMPILED["llama-q4-g128-int8act-no-gate-up-fusion"]
    artifact = compiled_family(family, **options)
    bare = without_weights(artifact, tmp_path)

    def no_llvm(*_):
        raise AssertionError("LLVM was asked")
    monkeypatch.setattr(host, "has_llvm", lambda: False)
    for probe in ("reported_features", "host_llvm_target"):
        monkeypatch.setattr(host, probe, no_llvm)
    for probe in ("host_cpu_target", "_int8_dot", "_bf16_dot"):
        monkeypatch.setattr(cpu, probe, no_llvm)
    attach_weights(bare, make_model(family))
    assert weights_digest(bare) == weights_digest(artifact)


def test_a_model_of_another_config_is_refused_before_anything_is_written(make_model, llama_cpu, tmp_path):
    bare = without_weights(llama_cpu[0], tmp_path)
    before = sorted(p.name for p in bare.iterdir())
    with pytest.raises(KilnError, match=r"is not the model .* from: its config differs in architecture, .*qkv_bias"):
        attach_weights(bare, make_model("qwen2"))
    assert sorted(p.name for p in bare.iterdir()) == before
    assert read_manifest(bare, verify=False).weights_source == "absent"


def test_checkpoint_weights_are_never_replaced_and_generated_ones_only_with_force(make_model, llama_cpu, tmp_path):
    model = make_model("llama")
    with pytest.raises(KilnError, match="holds weights from a checkpoint; attach-weights never replaces them"):
        attach_weights(llama_cpu[0], model, force=True)
    bare = without_weights(llama_cpu[0], tmp_path)
    fill_weights(bare, seed=1)
    with pytest.raises(KilnError, match="already has generated weights .*--force"):
        attach_weights(bare, model)
    attach_weights(bare, model, force=True)
    assert weights_digest(bare) == weights_digest(llama_cpu[0])
    assert read_manifest(bare).weights_source == "checkpoint"


def test_attaching_imports_no_tvm_compiler_module(make_model, compiled_family, tmp_path):
    """A runtime-only TVM (a GPU machine's) cannot import Relax and has no LLVM: attaching needs neither."""
    family, options = COMPILED["mixtral-q4"]
    artifact = compiled_family(family, **options)
    bare = without_weights(artifact, tmp_path)
    script = ("import sys, tvm\n"
              "for name in [n for n in sys.modules if n.split('.')[:2] in (['tvm', 'relax'], ['tvm', 'dlight'])]:\n"
              "    sys.modules[name] = None       # a later import of them fails, as without the compiler\n"
              "del tvm.relax\n"
              "import kiln.host_cpu\n"
              "kiln.host_cpu.has_llvm = lambda: False\n"
              "from kiln.weights.attach import attach_weights\n"
              f"attach_weights({str(bare)!r}, {str(make_model(family))!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert weights_digest(bare) == weights_digest(artifact)


def test_a_calibrated_artifact_with_tensor_choices_attaches_the_same_bytes(make_model, compiled_family, tmp_path):
    """--calibrate and --tensor-quant: the importances travel in the artifact (calibration.safetensors), and
    attach-weights quantises with them to the bytes compile wrote; they changed the q4 weights (the digest
    differs from the same compile uncalibrated); inspect states each kind of weight's format and the text."""
    from kiln.calibrate import CALIBRATION_FILE
    from kiln.inspect import summary
    from kiln.testing.perplexity import calibration_text
    text = tmp_path / "calibration.txt"
    text.write_text(calibration_text(20_000))
    choices = (("o", "q8"), ("lm_head", "q4"))
    artifact = compiled_family("llama", quant="q4", calibrate=str(text), tensor_classes=choices)
    plain = compiled_family("llama", quant="q4", tensor_classes=choices)
    manifest = read_manifest(artifact)
    q = manifest.quantization
    assert CALIBRATION_FILE in manifest.files and q.calibration["tokens"] > 1000
    assert q.class_formats["o"] == "q8" and q.class_formats["lm_head"].startswith("q4 g32")
    assert q.class_formats["qkv"].startswith("q4 g32") and q.class_formats["embedding"] == "q8"
    assert weights_digest(artifact) != weights_digest(plain)
    bare = without_weights(artifact, tmp_path)
    attach_weights(bare, make_model("llama"))
    assert weights_digest(bare) == weights_digest(artifact)
    shown = summary(artifact)
    assert "calibrated on" in shown and "o q8" in shown and "--tensor-quant o=q8,lm_head=q4" in shown
