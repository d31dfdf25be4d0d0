"""Speculative decoding on compiled CPU artifacts: greedy outputs identical to plain decoding for
several families (windows, MLA, MoE) and quantisation modes, with n-gram guesses and a draft model;
with structured output; and its surfaces (`kiln run --speculative`, `kiln serve` metrics and the
per-request opt-out)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from kiln.runtime.llm import LLM
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig
from reference import random_prompt
from serving import KEY, running_server

pytestmark = pytest.mark.build


def repetitive_prompts():
    """Prompts that repeat a stretch of themselves, so that an n-gram lookup has guesses to make."""
    out = []
    for seed in (1, 2, 3):
        head = random_prompt(10, seed)
        out.append(head + head[:7] + random_prompt(3, seed + 10) + head)
    return out


def greedy_outputs(artifact, speculative=None, prompts=None, max_tokens=20, **kw):
    llm = LLM(artifact, kv_memory="16MiB", max_batched_tokens=64, speculative=speculative, **kw)
    outs = llm.generate(prompts or repetitive_prompts(), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                        ignore_eos=True), use_tqdm=False)
    stats = llm.engine.speculator.stats if llm.engine.speculator is not None else None
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("family, options", [
    ("llama", {}), ("gemma2", {}), ("qwen2_window", {}), ("deepseek_v2", {}), ("mixtral", {}),
    ("llama", dict(quant="q8", int8_activations=False)), ("llama", dict(quant="q4", int8_activations=False)),
    ("mixtral", dict(quant="q8", int8_activations=False)),
])
def test_ngram_speculation_gives_the_plain_greedy_tokens(compiled_family, family, options):
    artifact = compiled_family(family, **options)
    plain, _ = greedy_outputs(artifact)
    # one-token matches too, so that every model (whatever its weights repeat) makes guesses
    spec, stats = greedy_outputs(artifact, SpeculativeConfig("ngram", 4, ngram_min=1))
    assert spec == plain
    assert stats.draft_tokens > 0


def test_draft_model_speculation_gives_the_plain_greedy_tokens(compiled_family):
    """A q4 target with its float32 self as the draft (most guesses taken), and with another
    family's model of the same tokenizer as the draft (most missed)."""
    target = compiled_family("llama", quant="q4", int8_activations=False)
    plain, _ = greedy_outputs(target)
    for draft in (compiled_family("llama"), compiled_family("qwen3")):
        spec, stats = greedy_outputs(target, f"draft:{draft}", num_speculative_tokens=3)
        assert spec == plain
        assert stats.draft_tokens > 0
    assert stats.accepted_tokens < stats.draft_tokens


def test_a_draft_with_another_tokenizer_is_refused(compiled_family, tmp_path):
    import shutil
    from kiln.errors import KilnError
    draft = tmp_path / "draft"
    shutil.copytree(compiled_family("llama"), draft)
    vocab = json.loads((draft / "tokenizer.json").read_text())
    first = next(iter(vocab["model"]["vocab"]))
    vocab["model"]["vocab"][first + "x"] = vocab["model"]["vocab"].pop(first)
    (draft / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(KilnError, match="another tokenizer"):
        LLM(compiled_family("llama"), kv_memory="8MiB", speculative=f"draft:{draft}", verify=False)


def test_structured_output_with_speculation(compiled_family):
    pytest.importorskip("xgrammar")
    from kiln.runtime.grammar import GrammarSpec
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
              "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}}}
    spec = GrammarSpec("json_schema", json.dumps(schema), "response_format")
    artifact = compiled_family("llama")
    outs = {}
    for speculative in (None, "ngram", f"draft:{artifact}"):
        llm = LLM(artifact, kv_memory="16MiB", speculative=speculative)
        params = [SamplingParams(temperature=0.0, max_tokens=60, structured=spec),
                  SamplingParams(temperature=0.8, seed=3, max_tokens=60, structured=spec)]
        got = llm.generate(["{\"name\": \"ab\", \"n\": 1} {\"name\": \"ab\""] * 2, params, use_tqdm=False)
        for out in got:
            value = json.loads(out.outputs[0].text)
            assert set(value) == {"name", "n"} and 0 <= value["n"] <= 99
        outs[speculative] = got[0].outputs[0].token_ids
    assert outs["ngram"] == outs[None] == outs[f"draft:{artifact}"]


def test_run_reports_speculation(llama_cpu):
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "run", str(llama_cpu[0]), "--prompt",
                           "a b c a b c a b c a b", "--max-tokens", "24", "--json", "--speculative", "ngram",
                           "--num-speculative-tokens", "3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    spec = out["speculative"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    assert spec["drafts"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    plain = subprocess.run([sys.executable, "-m", "kiln.cli", "run", str(llama_cpu[0]), "--prompt",
                            "a b c a b c a b c a b", "--max-tokens", "24", "--json"],
                           capture_output=True, text=True, timeout=600)
    assert json.loads(plain.stdout)["output_token_ids"] == out["output_token_ids"]
    bad = subprocess.run([sys.executable, "-m", "kiln.cli", "run", str(llama_cpu[0]), "--prompt", "x",
                          "--speculative", "medusa"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "not one of ngram, draft" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_speculates_counts_it_and_lets_a_request_opt_out(llama_cpu, tmp_path):
    with running_server(llama_cpu[0], tmp_path / "log", "--kv-memory", "32MiB", "--speculative", "ngram",
                        "--num-speculative-tokens", "3") as (url, _):
        headers = {"Authorization": f"Bearer {KEY}"}

        def drafts():
            text = httpx.get(f"{url}/metrics").text
            assert re.search(r'^vllm:spec_decode_num_accepted_tokens_total\{model_name="[^"]+"\} ', text, re.M)
            return float(re.search(r"^kiln_spec_decode_num_drafts_total (\S+)$", text, re.M).group(1))
        body = {"prompt": "a b c a b c a b c a b", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        before = drafts()
        r = httpx.post(f"{url}/v1/completions", json={**body, "speculative": False}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert drafts() == before
        r2 = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r2.status_code == 200 and drafts() > before
        assert r2.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=60)
        pieces = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(pieces) == r.json()["choices"][0]["text"]
        bad = httpx.post(f"{url}/v1/completions", json={**body, "speculative": "maybe"}, headers=headers, timeout=60)
        assert bad.status_code == 400
