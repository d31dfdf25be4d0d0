"""Speculative decoding on the fake runner: verification and rollback (page tables, reference
counts, the prefix cache) with every guess, some or none taken; the n-gram and draft proposers;
speculation beside preemption, n > 1, stop strings and windows; and the rejection sampler's
distribution (a chi-square test against the target's own)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fake_runner import FakeRunner, reference_greedy
from kiln.runtime.config import EngineConfig
from kiln.runtime.draft_proposer import DraftProposer
from kiln.runtime.engine import Engine
from kiln.runtime.ngram import NgramIndex, NgramProposer
from kiln.runtime.sampler import SamplerState, SamplingParams, probabilities, process_logits
from kiln.runtime.speculative import Lookahead, Proposal, SpeculativeConfig, Speculator, verify_row

VOCAB = 50


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompts(count, seed=0, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(count)]


class Scripted:
    """Guesses the reference continuation, with each guess made wrong with probability `wrong`,
    and checks the pool after every step through the engine it is given."""
    cost = 0.0

    def __init__(self, wrong: float, seed: int = 0, window=None):
        self.wrong, self.rng, self.window = wrong, np.random.default_rng(seed), window
        self.proposed = 0

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks):
            truth = reference_greedy(seq.all_ids, k, VOCAB, window=self.window)
            guesses = [t if self.rng.random() >= self.wrong else (t + 1) % VOCAB for t in truth]
            self.proposed += len(guesses)
            out.append(Proposal(guesses))
        return out

    def retain(self, live):
        pass


def speculating_engine(proposer, num_pages=64, page_size=4, k=4, max_batched_tokens=32, max_num_seqs=16,
                       window=None, tokenizer=None, max_batch=16):
    runner = FakeRunner(num_pages, page_size, VOCAB, kv_window=window)
    config = SpeculativeConfig("ngram", k, max_batch=max_batch)
    limits = EngineConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens)
    engine = Engine(runner, num_pages, (), limits, tokenizer, Speculator(config, proposer, runner.max_context))
    return engine, runner


def run_checked(engine, prompts_, params):
    """generate(), checking the pool's states and reference counts after every step, and that every
    cached page holds tokens of a real sequence (no rejected guess)."""
    reqs = [engine.add_request(p, params) for p in prompts_]
    while engine.has_unfinished():
        engine.step()
        seqs = [s for r in reqs for s in r.sequences if not s.finished]
        engine.pool.check([s.table for s in seqs])
        for s in seqs:
            assert s.table.num_tokens == s.num_computed, "rows of rejected guesses are still in the table"
    truths = [tuple(s.all_ids) for r in reqs for s in r.sequences]
    p = engine.pool.page_size
    for parent, tokens in engine.pool._key_of.values():
        assert any(tokens in {t[i:i + p] for i in range(0, len(t) - p + 1, p)} for t in truths), \
            "a cached page holds tokens no sequence has"
    return [r.output() for r in reqs]


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_verification_keeps_greedy_outputs_with_all_some_or_no_guesses_taken(wrong, page_size):
    proposer = Scripted(wrong, seed=page_size)
    engine, _ = speculating_engine(proposer, page_size=page_size, num_pages=256 // page_size + 8)
    ps = prompts(6, seed=page_size)
    outs = run_checked(engine, ps, greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(p, 30, VOCAB) for p in ps]
    stats = engine.speculator.stats
    assert stats.draft_tokens == proposer.proposed > 0
    if wrong == 0.0:
        assert stats.accepted_tokens == stats.draft_tokens
        assert engine.stats.steps < 30 / 2          # several tokens a step
    elif wrong == 1.0:
        assert stats.accepted_tokens == 0
    else:
        assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert engine.pool.num_free == engine.pool.num_pages


def test_lookahead_shrinks_after_misses_and_grows_after_hits():
    look = Lookahead()
    assert look.choose(8, 0.05) >= 4
    for _ in range(12):
        look.record(4, 0)
    # guessing does not pay: no guesses, but one every PROBE_EVERY steps
    assert [look.choose(8, 0.15) for _ in range(2 * Lookahead.PROBE_EVERY)] == \
        ([0] * (Lookahead.PROBE_EVERY - 1) + [1]) * 2
    assert look.choose(8, 0.0) >= 1                    # free guesses always pay
    for _ in range(10):
        look.record(1, 1)
    assert look.choose(8, 0.05) >= 4
    assert Lookahead().choose(8, 0.15) < Lookahead().choose(8, 0.05)      # dearer guesses: fewer


def test_speculation_with_preemption_prefix_hits_and_n_samples():
    ps = prompts(8, seed=4, lo=10, hi=20)
    ps += [ps[0][:12] + [3, 4]]                       # a prefix-cache hit
    proposer = Scripted(0.2, seed=1)
    engine, _ = speculating_engine(proposer, num_pages=40, max_num_seqs=8, max_batched_tokens=24)
    outs = run_checked(engine, ps, greedy(40))
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(p, 40, VOCAB) for p in ps]
    # n > 1: the samples share the prompt's pages, and each speculates on its own
    engine, _ = speculating_engine(Scripted(0.2, seed=2))
    [out] = run_checked(engine, ps[:1], greedy(20, n=3))
    assert [c.token_ids for c in out.outputs] == [reference_greedy(ps[0], 20, VOCAB)] * 3
    assert engine.speculator.stats.drafts > 0


def test_a_window_drops_pages_behind_accepted_runs():
    ps = prompts(4, seed=5, lo=20, hi=30)
    engine, _ = speculating_engine(Scripted(0.25, window=9), window=9, num_pages=64)
    outs = run_checked(engine, ps, greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(p, 40, VOCAB, window=9) for p in ps]


def test_max_tokens_and_stop_tokens_inside_an_accepted_run():
    p = prompts(1, seed=6)[0]
    ref = reference_greedy(p, 30, VOCAB)
    engine, _ = speculating_engine(Scripted(0.0))
    [out] = run_checked(engine, [p], greedy(13))                 # max_tokens lands inside a run of 5
    assert out.outputs[0].token_ids == ref[:13] and out.outputs[0].finish_reason == "length"
    stop = ref[7]
    engine, _ = speculating_engine(Scripted(0.0))
    [out] = run_checked(engine, [p], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]))
    assert out.outputs[0].token_ids == ref[:ref.index(stop) + 1] and out.outputs[0].stop_reason == stop


def test_stop_string_inside_an_accepted_run(tokenizer):
    vocab = tokenizer.vocab_size
    prompt = tokenizer.encode("The quick brown fox")
    ref = reference_greedy(prompt, 24, vocab)
    full = tokenizer.decode(ref)
    stop = full[len(full) // 2:len(full) // 2 + 3]

    class Truth(Scripted):
        def propose(self, seqs, ks):
            return [Proposal(reference_greedy(s.all_ids, k, vocab)) for s, k in zip(seqs, ks)]
    runner = FakeRunner(64, 4, vocab)
    engine = Engine(runner, 64, (), tokenizer=tokenizer,
                    speculator=Speculator(SpeculativeConfig("ngram", 6), Truth(0.0), runner.max_context))
    [out] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text == full[:full.find(stop)]
    assert engine.speculator.stats.accepted_tokens > 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from kiln.runtime.tokenizer import Tokenizer
    from kiln.testing.tiny import train_tokenizer
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return Tokenizer(out)


def test_ngram_index_finds_the_latest_longest_match():
    ids = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    index = NgramIndex(1, 3)
    index.extend(ids)
    assert index.lookup(ids, 3) == [9, 2, 6]             # [6, 7] last followed by 9
    ids2 = ids + [8]                                     # suffix [6, 7, 8]: only the first occurrence
    index.extend(ids2)
    assert index.lookup(ids2, 2) == [1, 6]
    assert NgramIndex(2, 3).lookup([1, 2, 3], 4) == []


def test_ngram_proposer_and_opt_out():
    # a prompt that repeats: the fake model's continuation differs, so guesses are tried and mostly missed
    p = [4, 5, 6, 7] * 6
    engine, _ = speculating_engine(NgramProposer(1, 3))
    outs = run_checked(engine, [p, p[:-1]], greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(q, 30, VOCAB) for q in (p, p[:-1])]
    assert engine.speculator.stats.drafts > 0
    engine, _ = speculating_engine(NgramProposer(1, 3))
    run_checked(engine, [p], greedy(30, speculative=False))
    assert engine.speculator.stats.drafts == 0


def test_no_speculation_beyond_the_batch_limit():
    engine, _ = speculating_engine(Scripted(0.0), max_batch=2)
    ps = prompts(3, seed=8)
    outs = run_checked(engine, ps, greedy(10))
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(q, 10, VOCAB) for q in ps]
    assert engine.speculator.stats.drafts == 0


@pytest.mark.parametrize("same", [True, False])
def test_draft_model_proposer_keeps_outputs_and_its_own_pages(same):
    """A draft that is the target (every guess taken) or another model (guesses mostly missed)."""
    class Other(FakeRunner):
        @staticmethod
        def next_token_logits(history, vocab_size):
            return FakeRunner.next_token_logits(history[-3:], vocab_size)
    draft = (FakeRunner if same else Other)(48, 4, VOCAB)
    proposer = DraftProposer(draft, 48, VOCAB, 0.1)
    engine, _ = speculating_engine(proposer, num_pages=64)
    ps = prompts(5, seed=9)
    outs = run_checked(engine, ps, greedy(25))
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(q, 25, VOCAB) for q in ps]
    stats = engine.speculator.stats
    assert stats.drafts > 0
    assert (stats.accepted_tokens == stats.draft_tokens) if same else stats.accepted_tokens < stats.draft_tokens
    engine.step()                                       # nothing runs: the draft forgets every sequence
    engine.speculator.propose([], set())
    assert not proposer.seqs and proposer.pool.num_free == proposer.pool.num_pages
    proposer.pool.check([])


# -- the rejection sampler ----------------------------------------------------------------------

def chi_square_critical(df: int, z: float = 3.72) -> float:
    """The chi-square value exceeded with probability about 1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected > 5
    rest = (counts[~keep].sum(), expected[~keep].sum())
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    if rest[1] > 0:
        stat += (rest[0] - rest[1]) ** 2 / rest[1]
    return stat, int(keep.sum()) - (0 if rest[1] > 0 else 1)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=12),
                                    dict(temperature=1.3, top_p=0.8, repetition_penalty=1.3)])
@pytest.mark.parametrize("draft", ["sampled", "deterministic"])
def test_rejection_sampling_gives_the_targets_distribution(params, draft):
    """A guess x ~ q kept with probability min(1, p/q), else a draw from (p - q)+: the token that
    comes out is distributed as p (the target's, after penalties and filters)."""
    rng = np.random.default_rng(0)
    vocab, trials = 20, 25000
    logits = rng.normal(0, 1.5, vocab).astype(np.float32)
    sp = SamplingParams(seed=1, **params)
    state = SamplerState(sp, prompt_ids=[3, 4])
    p = probabilities(process_logits(logits, state), sp)
    q = probabilities(rng.normal(0, 1.5, vocab).astype(np.float32), SamplingParams(temperature=1.0))
    counts = np.zeros(vocab)
    for _ in range(trials):
        guess = int(rng.choice(vocab, p=q)) if draft == "sampled" else 7
        token, taken = verify_row(logits, state, guess, q if draft == "sampled" else None)
        assert taken == (token == guess) or not taken
        counts[token] += 1
    stat, df = chi_square(counts, p)
    assert stat < chi_square_critical(df), (stat, df)


def test_speculative_sampling_is_indistinguishable_from_plain_sampling():
    """Through the engine: the second token of many seeded requests, with and without speculation
    (guesses from a draft that disagrees often), against the fake model's exact distribution."""
    vocab = 12
    prompt = [1, 2, 3]
    params = [SamplingParams(temperature=1.5, max_tokens=3, ignore_eos=True, seed=s) for s in range(6000)]

    class Sharp(FakeRunner):                # a flatter distribution than the default, so many tokens occur
        @staticmethod
        def next_token_logits(history, vocab_size):
            logits = FakeRunner.next_token_logits(history, vocab_size) / 4
            return logits + np.linspace(0, 1, vocab_size, dtype=np.float32)

    def second_tokens(speculate):
        runner = Sharp(512, 4, vocab)
        speculator = None
        if speculate:
            draft = DraftProposer(FakeRunner(512, 4, vocab), 512, vocab, 0.1)
            speculator = Speculator(SpeculativeConfig("draft", 2, draft="fake", max_batch=10**6), draft, 512)
        engine = Engine(runner, 512, (), config=EngineConfig(max_num_seqs=256, max_batched_tokens=4096),
                        speculator=speculator)
        outs = engine.generate([prompt] * len(params), params)
        if speculate:
            assert engine.speculator.stats.drafts > 0 and engine.speculator.stats.accepted_tokens > 0
        return [o.outputs[0].token_ids for o in outs]

    plain, spec = second_tokens(False), second_tokens(True)
    # exact: P(t2) = sum over t1 of P(t1) P(t2 | t1), from the fake model's logits
    sp = SamplingParams(temperature=1.5)
    first = probabilities(Sharp.next_token_logits(prompt, vocab), sp)
    want = sum(first[t] * probabilities(Sharp.next_token_logits(prompt + [t], vocab), sp) for t in range(vocab))
    for got in (plain, spec):
        counts = np.bincount([t[1] for t in got], minlength=vocab).astype(float)
        stat, df = chi_square(counts, want)
        assert stat < chi_square_critical(df), (stat, df)


def test_penalties_logprobs_and_chunked_prefill_beside_speculation():
    """Penalised requests with logprobs speculate and give the plain engine's tokens and logprobs,
    while long prompts arrive and prefill in chunks in the same steps."""
    ps = prompts(4, seed=11, lo=5, hi=12) + prompts(2, seed=12, lo=60, hi=80)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4,
                             frequency_penalty=0.5, logprobs=2)] * len(ps)

    def run(speculator):
        runner = FakeRunner(128, 4, VOCAB)
        engine = Engine(runner, 128, (), config=EngineConfig(max_num_seqs=16, max_batched_tokens=12),
                        speculator=speculator)
        reqs = [engine.add_request(p, sp) for p, sp in zip(ps[:4], params)]
        engine.step()
        engine.step()
        reqs += [engine.add_request(p, sp) for p, sp in zip(ps[4:], params)]      # arrive mid-decode
        engine.run_to_completion()
        return engine, [r.output().outputs[0] for r in reqs]
    _, plain = run(None)
    engine, spec = run(Speculator(SpeculativeConfig("ngram", 4), Scripted(0.3), 512))
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    for a, b in zip(spec, plain):
        assert a.logprobs == b.logprobs
    assert engine.speculator.stats.accepted_tokens > 0
    chunked = [s for s in engine.model.steps if len(s["q_indptr"]) > 2 and len(s["tokens"]) == 12]
    assert chunked, "no step mixed prefill chunks with speculating decodes"
