"""KV export and import (runtime/kv_transfer.py): a sequence prefilled on one engine and handed, with
its pages, to another generates what one engine alone generates. On the fake runner (whose logits
read the whole history back through the pages, so a page written in the wrong place changes the
tokens) and on compiled artifacts of each KV format: full attention, sliding windows, MLA's latent
rows and an int8 cache with its row scales."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import KilnError, ParamError
from kiln.runtime.engine import Engine
from kiln.runtime.sampler import SamplingParams

from fake_runner import FakeRunner, reference_greedy


def prefill_then_decode(prefill: Engine, decode: Engine, prompt: list[int], params: SamplingParams):
    """The tokens of `prompt` prefilled (and its first token drawn) on `prefill`, the rest drawn on
    `decode` from the exported pages; and the snapshot that crossed."""
    first = SamplingParams(**{**params.__dict__, "max_tokens": 1})
    req = prefill.add_request(prompt, first, export_kv=True)
    out = prefill.run_to_completion()[req.request_id]
    assert out.kv is not None and out.outputs[0].finish_reason == "length"
    imported = decode.import_kv(out.kv, params)
    final = decode.run_to_completion()[imported.request_id]
    return final, out.kv


@pytest.mark.parametrize("window", [None, 6])
def test_fake_runner_round_trip_gives_the_one_engine_tokens(window):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]          # 14 tokens: 3 full pages and part of one
    params = SamplingParams(max_tokens=9, temperature=0.0, logprobs=2)
    prefill = Engine(FakeRunner(32, kv_window=window), 32)
    # the decode engine's pool is busy elsewhere first, so the pages land at other ids
    decode = Engine(FakeRunner(32, kv_window=window), 32)
    decode.add_request([7, 7, 7, 7, 7], SamplingParams(max_tokens=2, temperature=0.0))
    decode.run_to_completion()
    final, kv = prefill_then_decode(prefill, decode, prompt, params)
    assert final.outputs[0].token_ids == reference_greedy(prompt, 9, 50, window=window)
    assert len(final.outputs[0].logprobs) == 9 and final.outputs[0].logprobs[0] is not None
    assert kv.num_computed == len(prompt) and kv.token_ids[:len(prompt)] == prompt
    if window:       # the pages outside the window were not carried
        assert kv.first_page == (len(prompt) - window + 1) // 4 > 0
        assert kv.num_pages == -(-len(prompt) // 4) - kv.first_page
    for engine in (prefill, decode):
        assert not engine.has_unfinished()
        engine.pool.check([])


def test_seeded_sampling_goes_on_where_the_prefill_left_its_generator():
    prompt = list(range(1, 12))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
    alone = Engine(FakeRunner(32), 32).generate([prompt], params)[0].outputs[0].token_ids
    final, _ = prefill_then_decode(Engine(FakeRunner(32), 32), Engine(FakeRunner(32), 32), prompt, params)
    assert final.outputs[0].token_ids == alone


def test_imported_pages_are_found_by_the_prefix_cache():
    prompt = list(range(1, 18))
    decode = Engine(FakeRunner(32), 32)
    prefill_then_decode(Engine(FakeRunner(32), 32), decode, prompt, SamplingParams(max_tokens=3, temperature=0.0))
    again = decode.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0))
    out = decode.run_to_completion()[again.request_id]
    assert out.num_cached_tokens == 16
    assert out.outputs[0].token_ids == reference_greedy(prompt, 3, 50)


def test_bad_imports_are_refused_and_change_nothing():
    prefill = Engine(FakeRunner(32), 32)
    req = prefill.add_request(list(range(1, 10)), SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    kv = prefill.run_to_completion()[req.request_id].kv
    other = Engine(FakeRunner(32, page_size=8), 32)
    with pytest.raises(KilnError, match="page layout"):
        other.import_kv(kv, SamplingParams(max_tokens=4))
    decode = Engine(FakeRunner(32), 32)
    with pytest.raises(ParamError, match="max_tokens"):
        decode.import_kv(kv, SamplingParams(max_tokens=1))
    with pytest.raises(ParamError, match="n = 1"):
        decode.import_kv(kv, SamplingParams(max_tokens=4, n=2))
    tiny = Engine(FakeRunner(2), 2)           # 2 pages cannot hold 9 tokens and 4 more
    with pytest.raises(ParamError):
        tiny.import_kv(kv, SamplingParams(max_tokens=4))
    for engine in (decode, tiny):
        assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.num_pages


KV_FORMATS = {                      # one artifact per KV format: family, compile options
    "full": ("llama", {}),
    "sliding": ("mistral_window", {}),
    "latent-mla": ("deepseek_v2", {"dtype": "float32"}),
    "int8-full": ("llama", {"kv_dtype": "int8"}),
    "int8-latent-mla": ("deepseek_v2", {"dtype": "float32", "kv_dtype": "int8"}),
}


@pytest.mark.parametrize("kv_format", sorted(KV_FORMATS))
def test_compiled_prefill_on_one_engine_decode_on_another_gives_the_same_tokens(compiled_family, kv_format):
    from kiln.runtime.llm import LLM
    from reference import random_prompt
    family, options = KV_FORMATS[kv_format]
    artifact = compiled_family(family, **options)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [random_prompt(n, seed=40 + n) for n in (37, 9)]
    alone = [o.outputs[0].token_ids for o in LLM(artifact, kv_memory="8MiB").generate(prompts, params, use_tqdm=False)]
    prefill, decode = (LLM(artifact, kv_memory="8MiB") for _ in range(2))
    decode.generate([random_prompt(20, seed=3)], SamplingParams(max_tokens=3), use_tqdm=False)   # other pages in use
    snapshots = []
    for prompt, expected in zip(prompts, alone):
        final, kv = prefill_then_decode(prefill.engine, decode.engine, prompt, params)
        assert final.outputs[0].token_ids == expected, kv_format
        assert kv.layout == decode.model.kv_layout and set(kv.pages) == set(decode.model.kv_tensors)
        snapshots.append(kv)
    if "int8" in kv_format:          # the row scales travel with the rows
        assert any("scale" in name for name in snapshots[0].pages), sorted(snapshots[0].pages)
    if kv_format == "sliding":
        assert snapshots[0].first_page > 0     # the long prompt's pages outside the window stayed behind
    decode.engine.pool.check([])


def test_an_import_checks_the_prompt_it_is_given_against_the_snapshots():
    prefill = Engine(FakeRunner(32), 32)
    req = prefill.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    kv = prefill.run_to_completion()[req.request_id].kv
    decode = Engine(FakeRunner(32), 32)
    with pytest.raises(ParamError, match="another prompt"):
        decode.check_import(kv, SamplingParams(max_tokens=4), prompt_ids=[5, 6, 7, 8, 1])
    assert decode.check_import(kv, SamplingParams(max_tokens=4), prompt_ids=[5, 6, 7, 8, 9]).prompt_ids == [5, 6, 7, 8, 9]
