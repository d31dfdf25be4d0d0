"""The compiled cpu artifact against transformers: prefill, decode, ragged batches, chunks, greedy generation."""
from __future__ import annotations

import numpy as np
import pytest
from paging import make_step_inputs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference import hf_greedy, hf_last_logits  # noqa: E402
from reference import random_prompt as prompt

from kiln.options import CompileOptions

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

TOL = 1e-4
NUM_PAGES = 32


@pytest.fixture(scope="module")
def llama(llama_cpu):
    """(artifact dir, HF model) for the tiny GQA Llama (tests/conftest.py)."""
    return llama_cpu


@pytest.fixture
def compiled(llama):
    from kiln.runtime.model import CompiledModel
    model = CompiledModel(llama[0])
    model.allocate_kv(NUM_PAGES * model.bytes_per_page)
    return model


def test_prefill_then_decode_matches_transformers(llama, compiled):
    hf = llama[1]
    assert compiled.page_size < 37
    pages = [9, 3, 17, 4]                       # not contiguous, not in order: 37 + 16 tokens need 4 pages
    ids = prompt(37, seed=1)
    logits = compiled.forward(make_step_inputs([(ids, 0, pages)], compiled.page_size))
    np.testing.assert_allclose(logits[0], hf_last_logits(hf, ids), atol=TOL, rtol=0)
    for _ in range(16):
        nxt = int(np.argmax(logits[0]))
        logits = compiled.forward(make_step_inputs([([nxt], len(ids), pages)], compiled.page_size))
        ids.append(nxt)
        np.testing.assert_allclose(logits[0], hf_last_logits(hf, ids), atol=TOL, rtol=0)


def test_ragged_batch_of_three_sequences(llama, compiled):
    hf = llama[1]
    seqs = [prompt(5, 2), prompt(23, 3), prompt(40, 4)]
    pages = [[0], [5, 1], [2, 7, 3]]
    logits = compiled.forward(make_step_inputs([(s, 0, p) for s, p in zip(seqs, pages)], compiled.page_size))
    assert logits.shape == (3, hf.config.vocab_size)
    for row, s in enumerate(seqs):
        np.testing.assert_allclose(logits[row], hf_last_logits(hf, s), atol=TOL, rtol=0)


def test_prefill_in_two_chunks(llama, compiled):
    hf = llama[1]
    ids, pages = prompt(45, 5), [6, 2, 11]
    compiled.forward(make_step_inputs([(ids[:20], 0, pages)], compiled.page_size))
    logits = compiled.forward(make_step_inputs([(ids[20:], 20, pages)], compiled.page_size))
    np.testing.assert_allclose(logits[0], hf_last_logits(hf, ids), atol=TOL, rtol=0)


def test_decode_and_prefill_in_one_step(llama, compiled):
    """A decode token of one sequence and the prompt of another share a step."""
    hf = llama[1]
    a, b = prompt(30, 6), prompt(12, 7)
    first = compiled.forward(make_step_inputs([(a, 0, [1, 2])], compiled.page_size))
    nxt = int(np.argmax(first[0]))
    logits = compiled.forward(make_step_inputs([([nxt], 30, [1, 2]), (b, 0, [8])], compiled.page_size))
    np.testing.assert_allclose(logits[0], hf_last_logits(hf, a + [nxt]), atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[1], hf_last_logits(hf, b), atol=TOL, rtol=0)


def test_greedy_generation_equals_transformers(llama):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    artifact, hf = llama
    llm = LLM(artifact, kv_memory="16MiB")
    ids = prompt(11, 8)
    [req] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert req.outputs[0].token_ids == hf_greedy(hf, ids, 32)


def test_batched_greedy_equals_each_alone(llama):
    """Several prompts generated together give exactly the tokens each gives alone."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(llama[0], kv_memory="16MiB", max_batched_tokens=24)   # a small budget forces chunked prefill
    prompts = [prompt(n, 20 + n) for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_seeded_sampling_is_reproducible(llama):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(llama[0], kv_memory="16MiB")
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    first = llm.generate([prompt(7, 9)], params)[0].outputs[0].token_ids
    second = llm.generate([prompt(7, 9), prompt(19, 10)], params)[0].outputs[0].token_ids
    assert first == second
    other = llm.generate([prompt(7, 9)], SamplingParams(**{**params.__dict__, "seed": 99}))[0].outputs[0].token_ids
    assert other != first


TORCHLESS = """
import importlib.abc, sys, traceback
attempts = []

class NoTorch(importlib.abc.MetaPathFinder):
    # a machine without torch or transformers: importing either fails, and who asked is noted
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            frames = [f.filename for f in traceback.extract_stack() if "importlib" not in f.filename]
            attempts.append((name, frames[-2] if len(frames) > 1 else "?"))
            raise ImportError(f"no {name} on this machine")
        return None

sys.meta_path.insert(0, NoTorch())
import kiln.runtime.engine, kiln.runtime.async_engine, kiln.runtime.sampler, kiln.runtime.tokenizer
from kiln.runtime.llm import LLM
from kiln.runtime.sampler import SamplingParams
llm = LLM(ARTIFACT, kv_memory="8MiB")
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
assert len(out.outputs[0].token_ids) == 3
print(repr(attempts))
"""


def test_the_runtime_runs_an_artifact_without_torch_or_transformers(llama_cpu):
    """On a machine where torch and transformers cannot be imported, every runtime module imports and
    an artifact generates; and no kiln module so much as tries to import either (a library below,
    tvm_ffi, may try: it takes torch where it is installed, and does without)."""
    import ast
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", TORCHLESS.replace("ARTIFACT", repr(str(llama_cpu[0])))],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    ours = [(name, where) for name, where in attempts if "site-packages" not in where]
    assert not ours, f"kiln code imports torch or transformers at run time: {ours}"


def test_an_artifact_built_for_a_cpu_with_more_instruction_sets_is_refused(llama_cpu, tmp_path):
    """A CPU artifact records the instruction sets of the CPU it was compiled on; loaded on a CPU
    lacking one of them it is refused with the missing ones named, rather than stopping with
    SIGILL in the first step. This machine's own artifacts load."""
    import json
    import shutil
    from kiln.errors import KilnError
    from kiln.host_cpu import host_cpu_features, missing_cpu_features
    from kiln.runtime.model import CompiledModel
    manifest = json.loads((llama_cpu[0] / "manifest.json").read_text())
    assert manifest["target"]["cpu_features"] == host_cpu_features() and host_cpu_features()
    assert missing_cpu_features(manifest["target"]["cpu_features"]) == []
    artifact = shutil.copytree(llama_cpu[0], tmp_path / "elsewhere")
    manifest["target"]["cpu_features"] += ["avx-kiln-test"]           # an instruction set no CPU has
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KilnError) as e:
        CompiledModel(artifact)
    assert "avx-kiln-test" in str(e.value) and "compile it on this machine" in str(e.value)


def test_built_for_an_older_cpu_model_it_runs_here_and_generates_as_transformers(make_model, llama, tmp_path):
    """--arch x86-64-v3 (AVX2, no AVX-512): the manifest records that model's instruction sets, the
    q8 linears take AVX2's integer dot (vpmaddwd) rather than VNNI's, and greedy generation is
    transformers'."""
    from click.testing import CliRunner
    from kiln.artifact import read_manifest
    from kiln.cli import main
    from kiln.host_cpu import missing_cpu_features, named_cpu_features
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.targets.cpu import CPUTarget
    if missing_cpu_features(named_cpu_features("x86-64-v3")):
        pytest.skip("this CPU has not every x86-64-v3 instruction set")
    assert CPUTarget(arch="x86-64-v3").int8_dot == "avx2"
    out = tmp_path / "v3"
    result = CliRunner().invoke(main, ["compile", str(make_model("llama")), "--arch", "x86-64-v3", "--quant", "q8",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    target = read_manifest(out).target
    assert list(target.cpu_features) == named_cpu_features("x86-64-v3") and "avx2" in target.cpu_features
    assert not any(f.startswith("avx512") for f in target.cpu_features) and target.runs_here
    ids = prompt(20, 4)
    [got] = LLM(out, kv_memory="8MiB").generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                                use_tqdm=False)
    assert got.outputs[0].token_ids == hf_greedy(llama[1], ids, 8)


@pytest.mark.build
def test_built_for_a_cpu_model_this_one_is_not_it_is_refused_here_with_its_instruction_sets_named(make_model,
                                                                                                 tmp_path):
    from kiln.compiler import compile_model
    from kiln.errors import KilnError
    from kiln.host_cpu import missing_cpu_features, named_cpu_features
    from kiln.inspect import summary
    from kiln.runtime.model import CompiledModel
    from kiln.targets.cpu import make_target
    with pytest.raises(KilnError, match="LLVM knows no CPU named 'zen-kiln-test' .*sapphirerapids"):
        make_target("zen-kiln-test")
    lacking = missing_cpu_features(named_cpu_features("sapphirerapids"))
    if not lacking:
        pytest.skip("this CPU has every Sapphire Rapids instruction set")
    out = tmp_path / "spr"
    manifest = compile_model(make_model("llama"), out, CompileOptions(target="cpu", arch="sapphirerapids"), show=None)
    assert not manifest.target.runs_here and "amx-tile" in manifest.target.cpu_features
    assert f"this machine's CPU lacks {', '.join(lacking)}" in summary(out)
    with pytest.raises(KilnError, match=f"compiled for a CPU with {', '.join(lacking)}, which this CPU lacks"):
        CompiledModel(out)


def test_the_cpu_target_uses_exactly_the_instruction_sets_cpuid_reports():
    """kiln compiles for LLVM's name of the CPU with each instruction set switched on or off as
    CPUID reports it, so a VM that hides one the CPU model implies gets no kernel that needs it."""
    import tvm
    from kiln.host_cpu import cpu_target, host_cpu_features
    from kiln.targets.cpu import host_cpu_target
    has = tvm.target.codegen.llvm_cpu_has_features
    # a Sapphire Rapids VM that hides AMX and AVX-512 FP16: the model alone implies both
    hidden = {"amx-int8": False, "amx-tile": False, "avx512fp16": False, "avx2": True, "avx512f": True}
    assert has(["amx-int8"], tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"}))
    target = cpu_target("sapphirerapids", hidden)
    assert not any(has([name], target) for name in ("amx-int8", "amx-tile", "avx512fp16"))
    assert has(["avx2", "avx512f"], target)
    # this machine: every instruction set CPUID reports, and none it does not
    here = host_cpu_target()
    reported = dict(tvm.get_global_func("tvm.codegen.llvm.GetHostCPUFeatures")().items())
    absent = [name for name, present in reported.items() if not present and name.startswith(("avx", "amx"))]
    assert host_cpu_features() and all(has([name], here) for name in host_cpu_features())
    assert not any(has([name], here) for name in absent), absent


def test_proc_cpuinfo_answers_as_llvm_does():
    """Where TVM has only its runtime (no LLVM to ask), /proc/cpuinfo's flags decide which of an
    artifact's instruction sets this CPU lacks: here they agree with LLVM's CPUID reading on every
    instruction set kiln records, present or absent (AMX's, which no artifact needs, apart)."""
    import os
    import tvm
    from kiln.cpu_features import ISA_PREFIXES, LLVM_HOST_FEATURES, cpuinfo_features, missing_in_cpuinfo
    from kiln.cpu_tiles import TILE_ISA
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo on this system")
    reported = {name: on for name, on in tvm.get_global_func(LLVM_HOST_FEATURES)().items()
                if name.startswith(ISA_PREFIXES)}
    absent = sorted(name for name, on in reported.items() if not on and not name.startswith(TILE_ISA))
    assert len(reported) > len(absent) > 0
    assert missing_in_cpuinfo(sorted(reported), cpuinfo_features()) == absent
