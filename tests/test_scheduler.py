"""The scheduler and engine against a fake model runner (no TVM): budgets, chunked prefill,
admission, preemption with recompute, abort, prefix caching, n > 1 with copy-on-write, stops."""
from __future__ import annotations

import numpy as np
import pytest

from fake_runner import FakeRunner, reference_greedy
from kiln.runtime.config import EngineConfig
from kiln.errors import ParamError
from kiln.runtime.engine import Engine
from kiln.runtime.sampler import SamplingParams

VOCAB = 50


def engine_for(num_pages=64, page_size=4, max_num_seqs=16, max_batched_tokens=32, prefix_caching=True,
               tokenizer=None, eos=()):
    runner = FakeRunner(num_pages, page_size, VOCAB)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                          prefix_caching=prefix_caching)
    return Engine(runner, num_pages, eos, config, tokenizer), runner


def prompts(count, seed=0, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(count)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens_of(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_outputs_equal_the_unpaged_reference():
    engine, _ = engine_for()
    ps = prompts(10)
    outs = engine.generate(ps, [greedy(3 + i) for i in range(10)])
    assert tokens_of(outs) == [reference_greedy(p, 3 + i, VOCAB) for i, p in enumerate(ps)]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_token_budget_is_respected_and_prefill_chunks_share_steps_with_decodes():
    engine, runner = engine_for(max_batched_tokens=10)
    engine.add_request(list(range(1, 4)), greedy(12))           # decodes soon
    engine.step()
    engine.add_request(list(range(1, 40)), greedy(2))           # a 39-token prompt: four chunks
    mixed = 0
    while engine.has_unfinished():
        engine.step()
        step = runner.steps[-1]
        assert len(step["tokens"]) <= 10
        lens = np.diff(step["q_indptr"])
        mixed += int(1 in lens.tolist() and lens.max() > 1)
    assert mixed >= 3


def test_waiting_request_is_admitted_as_soon_as_pages_allow():
    engine, _ = engine_for(num_pages=6, max_batched_tokens=64)
    first = engine.add_request(list(range(1, 21)), greedy(4))   # 20 + 4 tokens: all 6 pages of 4
    second = engine.add_request(list(range(1, 6)), greedy(2))   # needs 2 pages; 1 is free after step 1
    engine.step()
    while not first.finished:
        assert [s.request for s in engine.scheduler.running] == [first]
        engine.step()
    engine.step()                                               # the first step after it freed its pages
    assert second.sequences[0].num_computed == 5


def test_preemption_recomputes_and_keeps_outputs_exact():
    ps = prompts(8, seed=1, lo=5, hi=14)
    params = [greedy(10 + i) for i in range(8)]
    engine, _ = engine_for(num_pages=10, max_batched_tokens=16, prefix_caching=False)
    outs = engine.generate(ps, params)
    assert engine.scheduler.num_preemptions > 0
    assert tokens_of(outs) == [reference_greedy(p, sp.max_tokens, VOCAB) for p, sp in zip(ps, params)]
    assert sum(o.metrics.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    assert engine.pool.num_free == engine.pool.num_pages


def test_abort_frees_pages_at_once():
    engine, _ = engine_for(num_pages=16)
    keep = engine.add_request(prompts(1, seed=2)[0], greedy(20))
    gone = engine.add_request(list(range(1, 30)), greedy(20))
    engine.step()
    engine.step()
    used = engine.pool.num_pages - engine.pool.num_free
    out = engine.abort(gone.request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.pool.num_pages - engine.pool.num_free < used
    assert engine.abort(gone.request_id) is None
    final = engine.run_to_completion()
    assert list(final) == [keep.request_id]


def test_prefix_cache_hits_skip_computation_and_keep_tokens():
    system = list(range(1, 33))                                  # 32 tokens = 8 full pages
    ps = [system + [40 + i, 41, 42] for i in range(3)]
    runs = {}
    for caching in (False, True):
        engine, runner = engine_for(prefix_caching=caching, max_batched_tokens=64)
        outs = [engine.generate([p], greedy(5))[0] for p in ps]  # one after another: later ones hit
        computed = sum(len(s["tokens"]) for s in runner.steps)
        runs[caching] = (tokens_of(outs), computed, [o.num_cached_tokens for o in outs], engine.pool.stats)
    assert runs[True][0] == runs[False][0] == [reference_greedy(p, 5, VOCAB) for p in ps]
    assert runs[True][2] == [0, 32, 32] and runs[False][2] == [0, 0, 0]
    assert runs[False][1] - runs[True][1] == 64                  # two prompts skipped 32 tokens each
    assert runs[True][3].hit_tokens == 64


def test_priority_runs_first_and_fcfs_within_a_priority():
    engine, _ = engine_for(max_num_seqs=1)
    order = []
    a = engine.add_request([1, 2, 3], greedy(1), priority=1)
    b = engine.add_request([4, 5, 6], greedy(1), priority=0)
    c = engine.add_request([7, 8, 9], greedy(1), priority=0)
    engine.run_to_completion(lambda out: order.append(out.request_id))
    assert order == [b.request_id, c.request_id, a.request_id]


def test_n_samples_share_the_prompt_pages_with_copy_on_write():
    engine, runner = engine_for(num_pages=32)
    prompt = list(range(1, 11))                                  # 10 tokens: the third page is partial
    params = SamplingParams(temperature=1.0, n=4, seed=3, max_tokens=6, ignore_eos=True)
    [out] = engine.generate([prompt], params)
    assert len(out.outputs) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    prefill_tokens = sum(len(s["tokens"]) for s in runner.steps if len(s["tokens"]) > 4)
    assert prefill_tokens == 10                                   # the prompt was computed once
    assert runner.copied == 3                   # the shared partial page, copied once per extra sample
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1    # own generators: samples differ
    assert engine.pool.num_free == engine.pool.num_pages


def test_n_samples_greedy_are_identical_and_exact():
    engine, runner = engine_for(num_pages=32)
    prompt = list(range(1, 11))
    [out] = engine.generate([prompt], greedy(7, n=3))
    assert runner.copied == 2
    assert [c.token_ids for c in out.outputs] == [reference_greedy(prompt, 7, VOCAB)] * 3


def test_stop_token_min_tokens_and_logprobs():
    engine, _ = engine_for()
    prompt = [5, 6, 7]
    ref = reference_greedy(prompt, 10, VOCAB)
    stop = ref[2]
    [out] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop],
                                                     logprobs=2))
    first = ref.index(stop)
    c = out.outputs[0]
    assert c.token_ids == ref[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.logprobs) == len(c.token_ids) and all(len(lp) in (2, 3) for lp in c.logprobs)
    assert c.cumulative_logprob < 0
    [late] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop],
                                                      min_tokens=first + 2))
    assert stop not in late.outputs[0].token_ids[:first + 2]


def test_metrics_are_ordered():
    engine, _ = engine_for()
    [out] = engine.generate([[1, 2, 3]], greedy(5))
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finish_time
    assert m.ttft >= 0 and m.tpot(5) >= 0


@pytest.mark.parametrize("bad", [dict(n=0), dict(min_p=2.0), dict(logprobs=99), dict(stop=[""]),
                                 dict(presence_penalty=3.0), dict(logit_bias={-1: 1.0}),
                                 dict(min_tokens=20, max_tokens=5)])
def test_bad_sampling_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from kiln.runtime.tokenizer import Tokenizer
    from kiln.testing.tiny import train_tokenizer
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return Tokenizer(out)


def test_stop_string_spanning_tokens_ends_the_text_before_it(tokenizer):
    vocab = tokenizer.vocab_size
    runner = FakeRunner(64, 4, vocab)
    engine = Engine(runner, 64, (), tokenizer=tokenizer)
    prompt = tokenizer.encode("The quick brown fox")
    ref = reference_greedy(prompt, 24, vocab)
    pieces = [tokenizer.decode(ref[:i + 1]) for i in range(len(ref))]
    full = pieces[-1]
    # a stop string that starts inside one token's text and ends inside a later one
    boundary = next(len(pieces[i]) for i in range(3, len(ref)) if 2 < len(pieces[i]) < len(full) - 3)
    stop = full[boundary - 2:boundary + 2]
    [out] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[:full.find(stop)]
    assert len(c.token_ids) < 24


# ---------------------------------------------------------------------------- prompt logprobs, prompt-only requests

def reference_prompt_logprobs(prompt, k):
    """log-softmax of the unpaged reference's logits at every prompt position, computed here."""
    out = [None]
    for t in range(1, len(prompt)):
        x = FakeRunner.next_token_logits(prompt[:t], VOCAB).astype(np.float64)
        lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
        best = np.argsort(-lp, kind="stable")[:k].tolist()
        out.append({i: lp[i] for i in [prompt[t], *best]})
    return out


def assert_same_logprobs(got, want):
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys() and all(abs(g[i] - w[i]) < 1e-5 for i in g)


@pytest.mark.parametrize("budget,num_pages", [(64, 64), (7, 64), (32, 12)],
                         ids=["one chunk", "chunked prefill", "preempted"])
def test_prompt_logprobs_equal_the_reference(budget, num_pages):
    engine, runner = engine_for(num_pages=num_pages, max_batched_tokens=budget)
    ps = prompts(4, seed=3, lo=20, hi=30)
    outs = engine.generate(ps, [greedy(6, prompt_logprobs=2) for _ in ps])
    for p, out in zip(ps, outs):
        assert_same_logprobs(out.prompt_logprobs, reference_prompt_logprobs(p, 2))
        assert out.outputs[0].token_ids == reference_greedy(p, 6, VOCAB)
    if num_pages == 12:
        assert engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_skip_the_prefix_cache_and_max_tokens_0_scores_only():
    engine, runner = engine_for()
    prompt = prompts(1, seed=4, lo=24, hi=25)[0]
    engine.generate([prompt], greedy(3))                         # its full pages are now cached
    [scored] = engine.generate([prompt], greedy(0, prompt_logprobs=0, n=2))
    assert_same_logprobs(scored.prompt_logprobs, reference_prompt_logprobs(prompt, 0))
    assert scored.num_cached_tokens == 0 and scored.finished
    assert [(c.token_ids, c.finish_reason) for c in scored.outputs] == [([], "length")] * 2
    assert engine.pool.num_free == engine.pool.num_pages and not engine.has_unfinished()
    rows = runner.steps[-1]["logit_rows"].tolist()
    assert rows == list(range(len(prompt)))                      # every prompt row's logits came back


# ---------------------------------------------------------------------------- sliding window

def windowed_engine(window, num_pages, max_batched_tokens=8, max_num_seqs=16, page_size=4):
    runner = FakeRunner(num_pages, page_size, VOCAB, kv_window=window)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens)
    return Engine(runner, num_pages, (), config), runner


def test_a_window_bounds_the_pages_each_sequence_holds():
    """Generations several pools long run in a pool that holds only their window."""
    engine, _ = windowed_engine(window=6, num_pages=8)
    ps = prompts(2, seed=4, lo=25, hi=31)
    reqs = [engine.add_request(p, greedy(40)) for p in ps]      # 65-70 tokens: 17+ pages each, pool of 8
    most = 0
    while engine.has_unfinished():
        engine.step()
        tables = [s.table for s in engine.scheduler.running]
        engine.pool.check(tables)
        most = max([most] + [sum(p >= 0 for p in t.pages) for t in tables])
    assert [r.output().outputs[0].token_ids for r in reqs] == [reference_greedy(p, 40, VOCAB, window=6) for p in ps]
    assert most <= engine.pool.live_pages_for(10**6, 8) == 5      # (6 - 1 + 8) / 4 rounded up, + 1


def test_window_with_prefix_hits_forks_and_preemption_keeps_tokens():
    engine, _ = windowed_engine(window=9, num_pages=12, max_batched_tokens=6)
    shared = prompts(1, seed=9, lo=24, hi=25)[0]
    first = engine.generate([shared + [3, 4]], greedy(20))[0].outputs[0].token_ids
    assert first == reference_greedy(shared + [3, 4], 20, VOCAB, window=9)
    hits = engine.pool.stats.hit_tokens
    params = [greedy(30), SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=25, ignore_eos=True), greedy(30)]
    batch = [shared + [5], shared + [6, 7], prompts(1, seed=11, lo=20, hi=21)[0]]
    outs = engine.generate(batch, params)                      # 12 pages for 5 sequences: preemptions
    assert engine.pool.stats.hit_tokens > hits                 # the dropped prefix pages stayed cached
    assert engine.scheduler.num_preemptions > 0
    assert outs[0].outputs[0].token_ids == reference_greedy(batch[0], 30, VOCAB, window=9)
    assert outs[2].outputs[0].token_ids == reference_greedy(batch[2], 30, VOCAB, window=9)
    alone, _ = windowed_engine(window=9, num_pages=64, max_batched_tokens=6)
    again = alone.generate([batch[1]], params[1])[0]
    assert [o.token_ids for o in outs[1].outputs] == [o.token_ids for o in again.outputs]
    engine.pool.check([])


def test_the_engine_says_what_fits_the_context_and_the_kv_cache():
    """max_tokens_for: all the room left where none is asked (at most the default), the asked count
    where it fits, and a ContextLengthError naming the parameter where it does not. The room is the
    smaller of the model's context (512) and the KV cache (16 pages of 4 = 64 tokens)."""
    from kiln.errors import ContextLengthError
    engine, _ = engine_for(num_pages=16)
    assert engine.limits.room(10) == 54
    assert engine.limits.max_tokens_for(10, None) == 54 and engine.limits.max_tokens_for(10, None, default=16) == 16
    assert engine.limits.max_tokens_for(10, 54) == 54
    with pytest.raises(ContextLengthError, match="at most 54 fit") as e:
        engine.limits.max_tokens_for(10, 55)
    assert e.value.param == "max_tokens"
    with pytest.raises(ContextLengthError, match="no room") as e:
        engine.limits.max_tokens_for(64, None, prompt_param="messages")
    assert e.value.param == "messages"
    with pytest.raises(ContextLengthError, match="context is 512"):
        engine.limits.max_tokens_for(512, 1)


def test_a_window_gives_the_server_the_room_the_engine_accepts():
    """With a sliding window a sequence holds only the pages in its window, so the room is the
    model's context even where the pool is smaller: the server's admission (max_tokens_for) and the
    engine's own check (check_request) agree, and the long generation runs."""
    engine, _ = windowed_engine(window=6, num_pages=8)
    context = engine.model.max_context
    assert context > 8 * 4 and engine.limits.room(10) == context - 10
    assert engine.limits.max_tokens_for(10, context - 10) == context - 10
    req = engine.check_request(list(range(3, 13)), greedy(context - 10))
    assert req.params.max_tokens == context - 10
    tight, _ = engine_for(num_pages=16)                 # no window: the pool bounds it, for both
    assert tight.limits.room(10) == 54
    with pytest.raises(ParamError):
        tight.check_request(list(range(3, 13)), greedy(55))


def test_the_async_engine_refuses_requests_beyond_its_waiting_limit():
    """AsyncEngine(max_waiting=N): a batch of requests that would leave more than N waiting is
    refused whole (QueueFull), and what was admitted before still runs to the end."""
    import asyncio
    from kiln.errors import QueueFull
    from kiln.runtime.async_engine import AsyncEngine

    async def run():
        engine = AsyncEngine(engine_for()[0], max_waiting=3)
        first = engine.add_requests([dict(prompt_ids=p, params=greedy(4)) for p in prompts(2)])
        with pytest.raises(QueueFull):
            engine.add_requests([dict(prompt_ids=p, params=greedy(4)) for p in prompts(2, seed=1)])
        assert engine.num_pending == 2                  # the refused pair left nothing behind
        outs = [out async for out in first if out.finished]
        assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 4 for o in outs)
    asyncio.run(run())
