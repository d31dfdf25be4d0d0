"""Adapter slots in the scheduler, against a fake runner whose KV rows are marked by the adapter that
wrote them (tests/fake_runner.py FakeLoRARunner): sequences wait for a slot, a slot is never taken from
a running sequence, the least recently used free slot is reused, the prefix cache keeps adapters
apart, and preemption gives slots back."""
from __future__ import annotations

import numpy as np
import pytest

from fake_runner import FakeLoRARunner, reference_lora_greedy, write_fake_adapter
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import Engine
from kiln.runtime.lora import LoRAError, LoRARequest
from kiln.runtime.sampler import SamplingParams

VOCAB = 50


@pytest.fixture
def loras(tmp_path):
    return {k: LoRARequest(f"a{k}", k, str(write_fake_adapter(tmp_path / f"a{k}", k))) for k in range(1, 6)}


def engine_for(num_pages=64, max_loras=2, max_batched_tokens=32, prefix_caching=True, max_cpu_loras=None):
    runner = FakeLoRARunner(num_pages, 4, VOCAB, max_loras)
    config = EngineConfig(max_num_seqs=16, max_batched_tokens=max_batched_tokens, prefix_caching=prefix_caching,
                          max_cpu_loras=max_cpu_loras)
    return Engine(runner, num_pages, (), config), runner


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompts(count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, int(rng.integers(3, 20))).tolist() for _ in range(count)]


def run(engine, requests):
    """requests: (prompt, adapter k or 0, max_tokens); the tokens of each, in order."""
    added = [engine.add_request(p, greedy(n), lora_request=lora) for p, lora, n in requests]
    final = engine.run_to_completion()
    return [final[r.request_id].outputs[0].token_ids for r in added]


def test_five_adapters_and_the_base_on_two_slots_each_get_their_own_tokens(loras):
    engine, runner = engine_for(max_loras=2)
    ps = prompts(11)
    ks = [1, 2, 3, 0, 4, 5, 1, 3, 0, 2, 5]
    got = run(engine, [(p, loras.get(k), 6) for p, k in zip(ps, ks)])
    assert got == [reference_lora_greedy(p, 6, VOCAB, k) for p, k in zip(ps, ks)]
    for step in runner.steps:                      # never more adapters in a step than slots
        assert len({s for s in step["lora_slots"] if s >= 0}) <= 2
    assert engine.lora_slots.users == [0, 0] and engine.pool.num_free == engine.pool.num_pages   # cached pages idle


def test_a_running_sequences_slot_is_never_taken_and_the_lru_free_slot_is(loras):
    engine, runner = engine_for(max_loras=2)
    long = engine.add_request(prompts(1, 1)[0], greedy(40), lora_request=loras[1])
    short = engine.add_request(prompts(1, 2)[0], greedy(2), lora_request=loras[2])
    waits = engine.add_request(prompts(1, 3)[0], greedy(2), lora_request=loras[3])
    engine.step()
    assert runner.writes == [(0, 1), (1, 2)]          # adapter 3 waits: both slots are in use
    while not waits.finished:
        engine.step()
    assert runner.writes == [(0, 1), (1, 2), (1, 3)] and not long.finished   # took 2's slot once it was free
    engine.add_request(prompts(1, 4)[0], greedy(2), lora_request=loras[2])
    engine.add_request(prompts(1, 5)[0], greedy(2), lora_request=loras[4])
    final = engine.run_to_completion()
    assert long.request_id in final
    # adapter 2 came back to slot 1 (3's, free), then 4 waited for a free slot: 2's, the LRU one, not 1's
    assert runner.writes[3] == (1, 2) and all(slot != 0 for slot, _ in runner.writes[1:])


def test_the_prefix_cache_keeps_adapters_apart(loras):
    engine, _ = engine_for(max_loras=2)
    prompt = prompts(1, 7)[0] * 3                     # several full pages
    first = engine.add_request(prompt, greedy(3), lora_request=loras[1])
    engine.run_to_completion()
    requests = [(0, None), (2, loras[2]), (1, loras[1])]
    added = [engine.add_request(prompt, greedy(3), lora_request=lora) for _, lora in requests]
    final = engine.run_to_completion()
    for (k, _), req in zip(requests, added):
        assert final[req.request_id].outputs[0].token_ids == reference_lora_greedy(prompt, 3, VOCAB, k)
    hits = [final[r.request_id].num_cached_tokens for r in added]
    assert hits[0] == hits[1] == 0 and hits[2] > 0 and first.metrics.num_cached_tokens == 0


def test_preemption_gives_the_slot_back_and_outputs_stay_exact(loras):
    engine, _ = engine_for(num_pages=12, max_loras=2, prefix_caching=False)
    ps = prompts(5, 9)
    ks = [1, 2, 3, 1, 2]
    got = run(engine, [(p, loras[k], 12) for p, k in zip(ps, ks)])
    assert got == [reference_lora_greedy(p, 12, VOCAB, k) for p, k in zip(ps, ks)]
    assert engine.scheduler.num_preemptions > 0 and engine.lora_slots.users == [0, 0]


def test_bad_adapters_are_refused_and_nothing_is_queued(loras, tmp_path):
    engine, _ = engine_for()
    with pytest.raises(LoRAError, match="cannot read"):
        engine.add_request([1, 2, 3], greedy(2), lora_request=LoRARequest("gone", 9, str(tmp_path / "gone")))
    with pytest.raises(LoRAError, match="lora_int_id 1 is adapter a1's"):
        engine.add_request([1, 2, 3], greedy(2), lora_request=loras[1])
        engine.add_request([1, 2, 3], greedy(2), lora_request=LoRARequest("other", 1, loras[2].lora_path))
    with pytest.raises(LoRAError, match="lora_int_id must be a positive int"):
        LoRARequest("zero", 0, loras[1].lora_path)
    assert len(engine.requests) == 1                 # the first good one only


def test_samples_forked_from_a_sequence_share_its_slot(loras):
    """n = 3 samples of a request on an adapter: every sample runs on the adapter's one slot (its tokens
    are the adapter's), and the slot is let go once all have finished."""
    engine, runner = engine_for(max_loras=2)
    prompt = prompts(1, 11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=3)
    req = engine.add_request(prompt, params, lora_request=loras[4])
    out = engine.run_to_completion()[req.request_id]
    assert [c.token_ids for c in out.outputs] == [reference_lora_greedy(prompt, 5, VOCAB, 4)] * 3
    assert runner.writes == [(0, 4)] and engine.lora_slots.users == [0, 0]
