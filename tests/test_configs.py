"""The typed configs between the layers: CompileOptions (the CLI to the pass pipeline), EngineConfig
(kiln run / serve and kiln.LLM to the engine), ServerConfig (the server and the Ray replicas), and
RequestLimits, whose one check the engine and the Ray ingress both make. No TVM."""
from __future__ import annotations

import pickle

import pytest

from fake_runner import FakeRunner
from kiln.errors import KilnError, ParamError
from kiln.ir.quant import KV_SCHEMES, SCHEMES
from kiln.options import KV_DTYPES, WEIGHT_QUANTS, CompileOptions
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import Engine
from kiln.runtime.grammar import GrammarSpec
from kiln.runtime.limits import RequestLimits
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig


@pytest.mark.parametrize("fields,words", [
    (dict(dtype="float64"), "--dtype float64 is not one of"),
    (dict(quant="q3"), "--quant q3 is not one of q8, q4, fp8"),
    (dict(kv_dtype="int4"), "--kv-dtype int4"),
    (dict(quant="q4", group_size=64), "--group-size 64 is not one of 32, 128"),
    (dict(mla_expanded_from=-1), "negative"),
    (dict(int8_activations=True), "--activations int8 needs --quant q8, q8g, q4, q4a or q4k"),
    (dict(quant="fp8", int8_activations=True), "--activations int8 needs --quant q8, q8g, q4, q4a or q4k"),
    (dict(quant="q4k", group_size=128), "--quant q4k has groups of 32 in super-blocks of 256"),
])
def test_compile_options_refuse_what_no_pass_can_do(fields, words):
    with pytest.raises(KilnError, match=words):
        CompileOptions(**fields)


def test_compile_options_name_the_irs_schemes_and_take_a_set_of_passes():
    assert set(WEIGHT_QUANTS) == set(SCHEMES) and set(KV_DTYPES) == set(KV_SCHEMES)
    options = CompileOptions(quant="q4", group_size=128, disable_passes={"fuse_qkv"})
    assert options.disable_passes == frozenset({"fuse_qkv"}) and options.target_name == "cpu"
    with pytest.raises(TypeError):
        CompileOptions("cpu")                  # by name only: no positional hand-off


@pytest.mark.parametrize("fields,words", [
    (dict(kv_memory="lots"), "cannot read a memory size"),
    (dict(kv_memory="1.5"), "neither a fraction"),
    (dict(kv_memory=0), "leaves no memory"),
    (dict(max_num_seqs=0), "max_num_seqs must be at least 1"),
    (dict(max_batched_tokens=0), "max_batched_tokens must be at least 1"),
    (dict(threads=0), "threads at least 1"),
    (dict(speculative="lookahead"), "speculative method 'lookahead'"),
    (dict(speculative="ngram", num_speculative_tokens=17), "1..16"),
])
def test_engine_config_refuses_bad_settings(fields, words):
    with pytest.raises(KilnError, match=words):
        EngineConfig(**fields)


def test_engine_config_reads_a_speculative_method_and_refuses_unknown_settings():
    config = EngineConfig(speculative="draft:small.kiln", num_speculative_tokens=3)
    assert config.speculative == SpeculativeConfig("draft", 3, "small.kiln")
    given = EngineConfig(speculative=SpeculativeConfig("ngram", 6))
    assert given.num_speculative_tokens == 6
    assert config.replace(max_num_seqs=8).max_num_seqs == 8 and config.max_num_seqs == 64
    with pytest.raises(KilnError, match="no engine setting named max_seqs"):
        config.replace(max_seqs=8)


def test_server_config_splits_flat_settings_between_the_server_and_the_engine():
    from kiln.serve.app import ServerConfig
    config = ServerConfig.of("some/model.kiln", api_key="k", tool_call_parser="hermes", kv_memory="8MiB",
                             max_num_seqs=4, max_waiting=9)
    assert config.api_key == "k" and config.tool_call_parser == "hermes" and config.model_name == "model.kiln"
    assert config.engine == EngineConfig(kv_memory="8MiB", max_num_seqs=4, max_waiting=9)
    with pytest.raises(KilnError, match="no engine setting named port"):
        ServerConfig.of("a", port=8000)
    with pytest.raises(TypeError):
        ServerConfig("a")                      # by name only


# ---------------------------------------------------------------------------- RequestLimits

def engine(num_pages=16, window=None, **config):
    return Engine(FakeRunner(num_pages, 4, 50, max_context=96, kv_window=window), num_pages, (),
                  EngineConfig(max_batched_tokens=8, **config))


BAD = [
    ([], SamplingParams(), "prompt", "the prompt is empty"),
    ([3, 50], SamplingParams(), "prompt", "outside the vocabulary"),
    (list(range(1, 50)) * 2, SamplingParams(), "prompt", "context is 96"),
    ([3] * 20, SamplingParams(max_tokens=60), "max_tokens", "needs 20 KV pages; the pool has 16"),
    ([3] * 70, SamplingParams(), "prompt", "the pool has 16"),
    ([3], SamplingParams(stop=["x"]), "stop", "stop strings need a tokenizer"),
    ([3], SamplingParams(structured=GrammarSpec("json_object", "", "response_format")), "response_format",
     "needs the model's tokenizer"),
]


@pytest.mark.parametrize("prompt,params,param,words", BAD)
def test_the_limits_alone_refuse_what_the_engine_refuses(prompt, params, param, words):
    """The Ray ingress holds only a replica's RequestLimits (pickled across): its check gives the
    engine's own 400, parameter and words alike."""
    eng = engine()
    limits = pickle.loads(pickle.dumps(eng.limits))
    with pytest.raises(ParamError, match=words) as by_engine:
        eng.check_request(prompt, params)
    with pytest.raises(ParamError, match=words) as by_limits:
        limits.check_request(prompt, params, grammars=None)
    assert by_engine.value.param == by_limits.value.param == param
    assert str(by_engine.value) == str(by_limits.value)


def test_the_limits_cut_max_tokens_to_the_context_and_count_only_a_windows_pages():
    limits = RequestLimits(vocab_size=50, max_context=96, page_size=4, num_pages=16, max_batched_tokens=8)
    assert limits.room(10) == 54                               # 16 pages of 4 tokens, less the prompt
    roomy = RequestLimits(vocab_size=50, max_context=96, page_size=4, num_pages=24, max_batched_tokens=8)
    cut = roomy.check_request([3] * 90, SamplingParams(max_tokens=50, min_tokens=20))
    assert (cut.max_tokens, cut.min_tokens) == (6, 6)
    windowed = RequestLimits(vocab_size=50, max_context=96, page_size=4, num_pages=6, max_batched_tokens=8,
                             kv_window=8)
    assert windowed.room(10) == 86                             # a window's pages fit: the context bounds it
    assert windowed.check_request([3] * 10, SamplingParams(max_tokens=86)).max_tokens == 86
    assert engine(num_pages=6, window=8).limits == windowed


def test_an_engine_a_step_ahead_refuses_structured_output_by_its_limits():
    from kiln.runtime.overlap import OverlapEngine
    eng = OverlapEngine(FakeRunner(16, 4, 50), 16)
    assert not eng.limits.structured_output and engine().limits.structured_output
    with pytest.raises(ParamError, match="does not run one step ahead"):
        eng.check_request([3], SamplingParams(structured=GrammarSpec("json_object", "", "response_format")))
