"""Structured output (runtime/grammar.py): the vocabulary xgrammar sees, the masks, and outputs that
parse and validate against their schema whatever the weights (the fake runner's logits know
nothing of JSON)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fake_runner import FakeRunner
from kiln.errors import ParamError
from kiln.runtime.engine import Engine
from kiln.runtime.grammar import GrammarSpec, Grammars
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
             "properties": {"name": {"type": "string", "maxLength": 12},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["tags", "kind", "inner"],
               "properties": {
                   "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c d"]}, "maxItems": 3},
                   "kind": {"anyOf": [{"type": "boolean"}, {"type": "null"},
                                      {"type": "integer", "minimum": -5, "maximum": 5}]},
                   "inner": {"type": "object", "required": ["x"], "additionalProperties": False,
                             "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}},
                   "note": {"type": "string", "minLength": 1, "maxLength": 4}}},
    "formats": {"type": "object", "additionalProperties": False, "required": ["when", "id"],
                "properties": {"when": {"type": "string", "format": "date"},
                               "id": {"type": "string", "format": "uuid"},
                               "host": {"type": "string", "format": "ipv4"}}},
    "list": {"type": "array", "minItems": 1, "maxItems": 4,
             "items": {"type": "object", "required": ["k"], "additionalProperties": False,
                       "properties": {"k": {"type": "string", "maxLength": 6}, "v": {"type": "boolean"}}}},
}


@pytest.fixture(scope="module")
def tokenizer(make_model):
    return Tokenizer(make_model("llama"))


def engine(tokenizer, **kwargs):
    return Engine(FakeRunner(512, vocab_size=512), num_pages=512, eos_ids=tokenizer.eos_token_ids,
                  tokenizer=tokenizer, **kwargs)


def test_vocabulary_is_what_xgrammar_reads_from_the_hf_tokenizer(tokenizer, make_model):
    """kiln builds xgrammar's TokenizerInfo from tokenizer.json without transformers; xgrammar's own
    from_huggingface must see the same bytes for every token."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(make_model("llama"))
    ref = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=512, stop_token_ids=sorted(tokenizer.eos_token_ids))
    ours = Grammars(tokenizer, 512, tokenizer.eos_token_ids).tokenizer_info()
    assert (ours.vocab_type, ours.add_prefix_space) == (ref.vocab_type, ref.add_prefix_space)
    assert ours.decoded_vocab == ref.decoded_vocab


def test_masks_match_xgrammars_matcher_token_by_token(tokenizer, make_model):
    """Along random walks through a schema's language, kiln's mask is xgrammar's own matcher's on the
    Hugging Face tokenizer's vocabulary, less the special tokens that are not stop tokens."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(make_model("llama"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=512, stop_token_ids=sorted(tokenizer.eos_token_ids))
    schema = json.dumps(SCHEMAS["nested"])
    reference = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)
    special = sorted(tokenizer.special_ids() - tokenizer.eos_token_ids)
    grammars = Grammars(tokenizer, 512, tokenizer.eos_token_ids)
    rng = np.random.default_rng(0)
    for walk in range(4):
        ours, theirs = grammars.matcher(GrammarSpec("json_schema", schema)), xgr.GrammarMatcher(reference)
        bits = xgr.allocate_token_bitmask(1, 512)
        for _ in range(60):
            assert ours.terminated == theirs.is_terminated()
            if theirs.is_terminated():
                break
            theirs.fill_next_token_bitmask(bits)
            want = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")[:512].astype(bool)
            want[special] = False
            got = ours.allowed()
            np.testing.assert_array_equal(got, want)
            token = int(rng.choice(np.flatnonzero(got)))
            assert ours.accept(token) and theirs.accept_token(token)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_parses_and_validates(tokenizer, name, temperature):
    eng = engine(tokenizer)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[name]))
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=400, structured=spec) for seed in range(4)]
    validator = jsonschema_rs.validator_for(SCHEMAS[name])
    for out in eng.generate([tokenizer.encode(f"prompt {i}") for i in range(4)], params):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", sample.text
        assert validator.is_valid(json.loads(sample.text)), sample.text


def test_constrained_and_free_requests_share_steps(tokenizer):
    eng = engine(tokenizer)
    prompts = [tokenizer.encode("a"), tokenizer.encode("b"), tokenizer.encode("c")]
    free = eng.generate([prompts[1]], [SamplingParams(temperature=0, max_tokens=20)])[0].outputs[0].token_ids
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["flat"]))
    outs = eng.generate(prompts, [SamplingParams(temperature=0, max_tokens=300, structured=spec),
                                  SamplingParams(temperature=0, max_tokens=20),
                                  SamplingParams(temperature=1, seed=3, n=3, max_tokens=300, structured=spec)])
    assert outs[1].outputs[0].token_ids == free               # the mask is that sequence's alone
    for sample in outs[0].outputs + outs[2].outputs:
        assert sample.finish_reason == "stop" and isinstance(json.loads(sample.text), dict)
    assert len({tuple(s.token_ids) for s in outs[2].outputs}) > 1      # n samples, each its own matcher


def test_any_json_object(tokenizer):
    """Free-form JSON has no bound a random model must reach: the outputs that end, end parsed."""
    eng = engine(tokenizer)
    outs = eng.generate([tokenizer.encode(f"p{i}") for i in range(8)],
                        [SamplingParams(temperature=t, seed=s, max_tokens=400, structured=GrammarSpec("json_object"))
                         for s in range(4) for t in (0, 1)])
    ended = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(ended) >= 2
    assert all(isinstance(json.loads(text), dict) for text in ended)     # an object, as OpenAI's json_object


def test_preempted_constrained_sequences_finish_valid(tokenizer):
    """A pool too small for every sequence at once: some are preempted and recomputed."""
    eng = Engine(FakeRunner(48, vocab_size=512), num_pages=48, eos_ids=tokenizer.eos_token_ids, tokenizer=tokenizer)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["list"]))
    outs = eng.generate([tokenizer.encode(f"p{i}") for i in range(6)],
                        [SamplingParams(temperature=1, seed=i, max_tokens=150, structured=spec) for i in range(6)])
    validator = jsonschema_rs.validator_for(SCHEMAS["list"])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and validator.is_valid(json.loads(out.outputs[0].text))


@pytest.mark.parametrize("spec,check", [
    (GrammarSpec("regex", r"(yes|no)-[0-9]{2}"), lambda t: t[:3] in ("yes", "no-") and t[-2:].isdigit()),
    (GrammarSpec.choice(["red", "green \"light\"", "blue\n"]), lambda t: t in ("red", "green \"light\"", "blue\n")),
    (GrammarSpec("ebnf", 'root ::= "(" [a-c]+ ")"'),
     lambda t: t[0] == "(" and t[-1] == ")" and set(t[1:-1]) <= set("abc")),
])
def test_regex_choice_and_grammar(tokenizer, spec, check):
    eng = engine(tokenizer)
    for out in eng.generate([tokenizer.encode("q")] * 3,
                            [SamplingParams(temperature=1, seed=s, max_tokens=60, structured=spec) for s in range(3)]):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text


@pytest.mark.parametrize("spec,words", [
    (GrammarSpec("json_schema", "{not json", "response_format"), "not JSON"),
    (GrammarSpec("regex", "([a-", "structured_outputs"), "regex"),
    (GrammarSpec("ebnf", "root ::= undefined_rule", "guided_grammar"), "ebnf"),
])
def test_what_cannot_compile_is_a_param_error_naming_the_field(tokenizer, spec, words):
    eng = engine(tokenizer)
    with pytest.raises(ParamError) as e:
        eng.add_request(tokenizer.encode("q"), SamplingParams(structured=spec))
    assert e.value.param == spec.param and words in str(e.value)
    assert not eng.has_unfinished()


def test_grammars_compile_once_per_spec(tokenizer):
    eng = engine(tokenizer)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["flat"]))
    for _ in range(3):
        eng.add_request(tokenizer.encode("q"), SamplingParams(max_tokens=5, structured=spec))
    assert list(eng.grammars.compile_seconds) == [spec]
    assert eng.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS["flat"]))) is eng.grammars.compile(spec)


def test_one_step_ahead_engine_refuses_a_grammar_by_name(tokenizer):
    from fake_runner import LazyRunner
    from kiln.runtime.overlap import OverlapEngine
    eng = OverlapEngine(LazyRunner(64, vocab_size=512), 64, tokenizer.eos_token_ids, tokenizer=tokenizer)
    with pytest.raises(ParamError) as e:
        eng.add_request(tokenizer.encode("q"),
                        SamplingParams(structured=GrammarSpec("json_object", param="response_format")))
    assert e.value.param == "response_format" and "overlap=False" in str(e.value)


def test_a_constrained_output_is_the_same_alone_batched_and_from_the_prefix_cache(tokenizer):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["nested"]))
    prompt = tokenizer.encode("a shared prefix that fills more than one page of the cache, then a question")
    params = SamplingParams(temperature=1, seed=11, max_tokens=300, structured=spec)
    alone = engine(tokenizer).generate([prompt], [params])[0].outputs[0].token_ids
    eng = engine(tokenizer)
    batch = eng.generate([prompt, tokenizer.encode("other"), prompt],
                         [params, SamplingParams(temperature=1, seed=3, max_tokens=40), params])
    assert batch[0].outputs[0].token_ids == alone == batch[2].outputs[0].token_ids
    again = eng.generate([prompt], [params])[0]                 # its prompt's pages now come from the cache
    assert again.metrics.num_cached_tokens > 0 and again.outputs[0].token_ids == alone


def test_the_grammar_cache_keeps_the_most_recently_used(tokenizer, monkeypatch):
    import kiln.runtime.grammar as grammar
    monkeypatch.setattr(grammar, "CACHED_GRAMMARS", 2)
    grammars = Grammars(tokenizer, 512, tokenizer.eos_token_ids)
    specs = [GrammarSpec.choice([f"option {i}"]) for i in range(3)]
    first = grammars.compile(specs[0])
    grammars.compile(specs[1])
    assert grammars.compile(specs[0]) is first            # a hit: now the most recent
    grammars.compile(specs[2])                             # evicts specs[1], the least recent
    assert list(grammars.compile_seconds) == [specs[0], specs[2]]
    assert grammars.compile(specs[0]) is first


def test_a_whole_output_ends_the_sequence_without_its_stop_token(tokenizer):
    """Where the grammar lets nothing but a stop token follow, the sequence ends with "stop" at its
    last allowed token: it spends no step drawing the stop token, and max_tokens reached on that very
    token is no cut. A grammar that may still go on (a+) ends at max_tokens with "length"."""
    eng = engine(tokenizer)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["flat"]))
    validator = jsonschema_rs.validator_for(SCHEMAS["flat"])
    ask = dict(temperature=1, structured=spec)
    roomy = [eng.generate([tokenizer.encode("p")], [SamplingParams(**ask, seed=seed, max_tokens=400)])[0].outputs[0]
             for seed in range(3)]
    for seed, sample in enumerate(roomy):
        assert sample.finish_reason == "stop" and sample.stop_reason is None, sample.text
        assert not set(sample.token_ids) & tokenizer.eos_token_ids and validator.is_valid(json.loads(sample.text))
        exact = eng.generate([tokenizer.encode("p")], [SamplingParams(**ask, seed=seed,
                                                                      max_tokens=len(sample.token_ids))])[0]
        assert (exact.outputs[0].finish_reason, exact.outputs[0].text) == ("stop", sample.text)
    more = GrammarSpec("regex", "a+")
    cut = eng.generate([tokenizer.encode("p")], [SamplingParams(temperature=1, seed=0, max_tokens=4, min_tokens=4,
                                                                structured=more)])[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4 and set(cut.text) == {"a"}
