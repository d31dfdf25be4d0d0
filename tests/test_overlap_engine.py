"""The one-step-ahead engine (runtime/overlap.py) against the synchronous one, on fake runners.

The lazy runner's `launch` returns at once and computes a step only when its result is read (after
the step before it, in launch order, as a device stream would), so these tests check ordering,
not timing: a placeholder the runner is not told to feed, a KV slot read before anything wrote it,
or a page reused while a step still needs it changes the tokens or trips the runner's asserts.
Each workload must give the synchronous engine's tokens, finish reasons, logprobs and text."""
from __future__ import annotations

import numpy as np
import pytest

from fake_runner import FakeRunner, LazyRunner
from test_scheduler import tokenizer  # noqa: F401  (its trained tokenizer, a fixture)
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import Engine
from kiln.runtime.overlap import OverlapEngine
from kiln.runtime.sampler import SamplingParams

VOCAB = 50


def engines(num_pages=64, page_size=4, max_num_seqs=16, max_batched_tokens=32, prefix_caching=True,
            tokenizer=None, eos=(), window=None):
    """(synchronous engine, one-step-ahead engine, the lazy runner) on the same settings."""
    vocab = tokenizer.vocab_size if tokenizer else VOCAB
    config = EngineConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                          prefix_caching=prefix_caching)
    lazy = LazyRunner(num_pages, page_size, vocab, kv_window=window)
    return (Engine(FakeRunner(num_pages, page_size, vocab, kv_window=window), num_pages, eos, config, tokenizer),
            OverlapEngine(lazy, num_pages, eos, config, tokenizer), lazy)


def prompts(count, seed=0, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(count)]


def summary(outputs):
    """Everything a client sees of each request's final output."""
    return [(o.request_id, o.prompt_logprobs,
             [(c.index, c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs) for c in o.outputs])
            for o in outputs]


def run_both(sync, ahead, ps, params):
    results = []
    for engine in (sync, ahead):
        outs = engine.generate(ps, params)
        assert engine.pool.num_free == engine.pool.num_pages, "pages left held after every request finished"
        results.append(summary(outs))
    assert results[1] == results[0]
    return results[0]


def stop_after(prompt, k):
    """A stop token that greedy decoding of `prompt` meets k tokens in (from the synchronous engine)."""
    sync, _, _ = engines()
    [out] = sync.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k + 1, ignore_eos=True))
    return out.outputs[0].token_ids[k]


def test_greedy_with_stop_tokens_max_tokens_and_min_tokens_matches():
    ps = prompts(8, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(8)]
    params[1] = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_after(ps[1], 4)])
    params[2] = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_after(ps[2], 2)], min_tokens=6)
    params[3] = SamplingParams(temperature=0.0, max_tokens=1)
    sync, ahead, lazy = engines()
    final = run_both(sync, ahead, ps, params)
    reasons = [o[2][0][2] for o in final]
    assert reasons[1] == "stop" and reasons[0] == reasons[3] == "length"
    assert params[2].stop_token_ids[0] not in final[2][2][0][1][:6]      # masked until min_tokens
    # the step past each stop was computed, then dropped
    assert sum(map(len, (s["tokens"] for s in lazy.steps))) > sum(map(len, (s["tokens"] for s in sync.model.steps)))


def test_eos_stop_one_step_late_drops_the_extra_token_and_its_slot():
    prompt = prompts(1, seed=6)[0]
    eos = stop_after(prompt, 3)
    sync, ahead, _ = engines(eos=(eos,))
    final = run_both(sync, ahead, [prompt], [SamplingParams(temperature=0.0, max_tokens=30)])
    tokens = final[0][2][0][1]
    assert tokens[-1] == eos and len(tokens) == tokens.index(eos) + 1


def test_seeded_sampling_with_n_samples_logprobs_and_prompt_logprobs_matches():
    ps = prompts(4, seed=7, lo=6, hi=14)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, max_tokens=9, n=3, logprobs=3,
                             prompt_logprobs=2, ignore_eos=True) for i in range(4)]
    params[1] = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=12, n=2, ignore_eos=True)
    sync, ahead, lazy = engines(num_pages=48)
    final = run_both(sync, ahead, ps, params)
    assert lazy.copied > 0                                    # the samples' shared last page, copied on write
    assert len({tuple(c[1]) for c in final[0][2]}) > 1       # own generators: the samples differ


def test_penalties_and_min_tokens_wait_for_their_token_and_match():
    """Sequences whose next draw reads the token before it: strong penalties (they change the
    tokens) and a min_tokens that ends exactly where the stop token comes."""
    ps = prompts(4, seed=8)
    strong = dict(repetition_penalty=10.0, frequency_penalty=2.0, presence_penalty=2.0)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, **strong),
              SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True, logit_bias={3: 2.0}, **strong),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    sync, _, _ = engines()
    [plain] = sync.generate([ps[3]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    ref = plain.outputs[0].token_ids
    k = next(i for i in range(3, 30) if ref[i] not in ref[:i])      # the stop token's first place
    params.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ref[k]], min_tokens=k))
    sync, ahead, _ = engines()
    final = run_both(sync, ahead, ps, params)
    assert final[3][2][0][1] == ref[:k + 1] and final[3][2][0][2] == "stop"
    unpenalised = summary(engines()[0].generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=30,
                                                                      ignore_eos=True)))
    assert unpenalised[0][2][0][1] != final[0][2][0][1]          # the penalties do change the tokens


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_under_a_tight_pool_matches(caching):
    ps = prompts(8, seed=1, lo=5, hi=14)
    ps[5] = ps[2][:8] + ps[5]                   # shared prefixes: with caching, some pages are found again
    params = [SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True) for i in range(8)]
    sync, ahead, _ = engines(num_pages=10, max_batched_tokens=16, prefix_caching=caching)
    run_both(sync, ahead, ps, params)
    assert ahead.scheduler.num_preemptions > 0


def test_prefix_cache_hits_match_and_register_only_computed_pages():
    system = list(range(1, 33))                                # 8 full pages of 4
    ps = [system + [40 + i, 41, 42] for i in range(3)]
    finals = []
    for engine in engines(max_batched_tokens=64)[:2]:
        outs = [engine.generate([p], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0] for p in ps]
        finals.append((summary(outs), [o.num_cached_tokens for o in outs], engine.pool.stats.hit_tokens))
    assert finals[1] == finals[0] and finals[0][1] == [0, 32, 32]


def test_sliding_window_with_forks_and_preemption_matches():
    ps = prompts(5, seed=9, lo=10, hi=20)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=1 + i % 2) for i in range(5)]
    sync, ahead, _ = engines(num_pages=24, max_batched_tokens=16, window=6)
    run_both(sync, ahead, ps, params)


def test_abort_mid_stream_keeps_the_others_exact_and_frees_every_page():
    ps = prompts(3, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    results = []
    for engine in engines()[:2]:
        reqs = [engine.add_request(p, params) for p in ps]
        seen = {}
        for _ in range(5):
            for out in engine.step():
                seen[out.request_id] = out.outputs[0].token_ids
        aborted = engine.abort(reqs[1].request_id)
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        assert -1 not in aborted.outputs[0].token_ids            # no token the host had not read
        final = engine.run_to_completion()
        assert reqs[1].request_id not in final and engine.pool.num_free == engine.pool.num_pages
        results.append(([final[r.request_id].outputs[0].token_ids for r in (reqs[0], reqs[2])],
                        aborted.outputs[0].token_ids))
    assert results[1][0] == results[0][0]
    # the aborted request's tokens are a prefix of what it would have made
    assert results[0][1][:len(results[1][1])] == results[1][1]


def streamed(engine, ps, params):
    """Each request's samples as streamed: the new tokens of every output, in order, and whether an
    output ever showed a token the host had not read back."""
    reqs = [engine.add_request(p, params) for p in ps]
    got: dict = {}
    unread = False
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                got.setdefault((out.request_id, c.index), []).extend(c.new_token_ids)
                unread |= -1 in c.token_ids
    return [[got.get((r.request_id, i), []) for i in range(params.n)] for r in reqs], unread


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=8, stop_token_ids=[25])],
                         ids=["greedy", "n3-stops"])
def test_outputs_stream_every_token_once_in_order(params):
    """Streamed tokens add up to the final ones in both engines (a sample that stopped early repeats
    nothing while its siblings go on), and no output shows a token still in flight."""
    ps = prompts(4, seed=12)
    sync, ahead, _ = engines()
    finals = [[c[1] for c in w[2]] for w in summary(engines()[0].generate(ps, params))]
    for engine in (sync, ahead):
        got, unread = streamed(engine, ps, params)
        assert got == finals and not unread


def test_prefix_hits_come_as_soon_as_in_the_synchronous_engine():
    """A request that shares a prefix with one admitted a step earlier finds its pages cached."""
    system = list(range(1, 17))
    cached = []
    for engine in engines(max_batched_tokens=64)[:2]:
        a = engine.add_request(system + [30, 31], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        engine.step()
        engine.step()
        b = engine.add_request(system + [40, 41], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        final = engine.run_to_completion()
        cached.append((final[b.request_id].num_cached_tokens, final[a.request_id].outputs[0].token_ids,
                       final[b.request_id].outputs[0].token_ids))
    assert cached[1] == cached[0] and cached[0][0] == 16


def test_a_window_and_a_tight_pool_finish_as_in_the_synchronous_engine():
    """Pages outside the window go back before the next step is scheduled, as in the synchronous
    engine: a pool sized for the window alone still serves a long prompt (once, a sequence held
    the next step's pages on top of the dead ones and preempted itself forever)."""
    prompt = prompts(1, seed=13, lo=32, hi=33)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sync, ahead, _ = engines(num_pages=7, max_batched_tokens=16, window=6)
    [want] = sync.generate([prompt], params)
    ahead.add_request(prompt, params)
    steps = 0
    while ahead.has_unfinished() and steps < 50:
        outs = ahead.step()
        steps += 1
    assert not ahead.has_unfinished(), "the one-step-ahead engine did not finish"
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert ahead.scheduler.num_preemptions == sync.scheduler.num_preemptions


def test_stop_strings_and_text_match(tokenizer):
    texts = ["The quick brown fox", "A lazy dog sleeps", "Once upon a time"]
    ps = [tokenizer.encode(t) for t in texts]
    sync, _, _ = engines(tokenizer=tokenizer)
    [probe] = sync.generate([ps[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop = probe.outputs[0].text[3:6] or "e"
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=12, stop=["e"]),
              SamplingParams(temperature=0.0, max_tokens=12)]
    sync, ahead, _ = engines(tokenizer=tokenizer)
    final = run_both(sync, ahead, ps, params)
    assert final[0][2][0][2] == "stop"
