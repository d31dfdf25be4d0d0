"""The engine: `step()` = schedule -> run the compiled forward -> sample -> update.

The model runner is anything with `page_size`, `vocab_size`, `max_context`, `forward(inputs)`
(runtime/step.py inputs -> f32 logits [seqs, vocab]) and `copy_pages(pairs)`: a CompiledModel,
or a fake one in the scheduler tests. A runner whose `sampler` is not None samples on its device:
`run(inputs)` leaves the logits there and only token ids and asked-for logprobs come back.
Requests come in with `add_request` (token ids), leave when finished or through `abort`; every
step returns a RequestOutput for each request that got tokens (or finished) in it. A runner that
`launch`es steps and finishes them later runs under runtime/overlap.py's OverlapEngine instead,
one step ahead of the host. With a Speculator (runtime/speculative.py), decoding sequences bring
guessed tokens to each step and keep the ones the model's own logits confirm.
"""
from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kiln.errors import ParamError

from .config import EngineConfig
from .kv_pool import PagePool
from .limits import RequestLimits
from .lora import no_slots
from .lora_slots import LoRASlots
from .kv_transfer import KVSnapshot, check_layout
from .request import Request, RequestOutput, Sequence
from .device_sampler import DeviceLogits, HostLogits
from .grammar import Grammars
from .sampler import SamplerState, SamplingParams
from .scheduler import Scheduler
from .speculative import Speculator, verify_row
from .step import SeqChunk, output_offsets, step_inputs
from .tokenizer import IncrementalDetokenizer


@dataclass
class EngineStats:
    """Running totals over the engine's life (bounded: no per-step history is kept)."""
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0               # in step(), the forward included
    forward_seconds: float = 0.0       # in the compiled forward alone


class Engine:
    """Runs many requests together on one model runner."""
    runs_ahead = False         # OverlapEngine's steps run one ahead of the host: no grammar can mask them

    def __init__(self, model, num_pages: int, eos_ids=(), config: EngineConfig = EngineConfig(), tokenizer=None,
                 speculator: Speculator | None = None):
        """`config`: its batch limits and prefix cache (the rest of it is kiln.LLM's)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.pool = PagePool(num_pages, model.page_size, config.prefix_caching, window=model.kv_window)
        self.lora_slots = LoRASlots(model, config.max_cpu_loras) if getattr(model, "lora", None) else None
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_batched_tokens, self.lora_slots)
        self.limits = RequestLimits(model.vocab_size, model.max_context, model.page_size, num_pages,
                                    config.max_batched_tokens, model.kv_window, hasattr(model, "read_pages"),
                                    structured_output=not self.runs_ahead)
        self.eos_ids = frozenset(eos_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.grammars = Grammars(tokenizer, model.vocab_size, self.eos_ids) if tokenizer is not None else None
        self._mask_worker: ThreadPoolExecutor | None = None       # started by the first constrained step
        self.speculator = speculator

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    prompt: str | None = None, priority: int = 0, export_kv: bool = False,
                    lora_request=None) -> Request:
        """Validate and queue a request (raises ParamError, or LoRAError for its adapter, changing nothing,
        if it cannot run). With `export_kv`, its last output carries the sequence's KV pages
        (`RequestOutput.kv`); with `lora_request` (runtime/lora.py LoRARequest) it runs on that adapter."""
        return self.enqueue(self.check_request(prompt_ids, params, request_id, prompt, priority, export_kv,
                                               lora_request))

    def import_kv(self, snapshot: KVSnapshot, params: SamplingParams | None = None, request_id: str | None = None,
                  prompt: str | None = None, priority: int = 0) -> Request:
        """Queue a request that goes on from another engine's sequence (runtime/kv_transfer.py): its
        K/V rows are written into this engine's pages, its generated tokens are taken as this
        engine's own, and it computes from the first token without K/V. `params` are the request's
        (max_tokens counts the tokens already generated)."""
        return self.enqueue_imported(self.check_import(snapshot, params, request_id, prompt, priority), snapshot)

    def check_import(self, snapshot: KVSnapshot, params: SamplingParams | None = None, request_id: str | None = None,
                     prompt: str | None = None, priority: int = 0, prompt_ids: list[int] | None = None) -> Request:
        """Everything `import_kv` checks, without touching the engine's state (as `check_request`);
        `prompt_ids`, where given, must be the snapshot's prompt."""
        check_layout(snapshot, self.model.kv_layout)
        if prompt_ids is not None and list(prompt_ids) != snapshot.token_ids[:snapshot.prompt_len]:
            raise ParamError("prompt", "the KV snapshot was made for another prompt")
        req = self.check_request(snapshot.token_ids[:snapshot.prompt_len], params, request_id, prompt, priority)
        if req.params.n != 1:
            raise ParamError("n", "a sequence imported with its KV pages is one sample (n = 1)")
        generated = len(snapshot.token_ids) - snapshot.prompt_len
        if generated >= req.params.max_tokens:
            raise ParamError("max_tokens", f"the imported sequence has {generated} tokens already; max_tokens "
                                           f"{req.params.max_tokens} leaves none to generate")
        return req

    def enqueue_imported(self, req: Request, snapshot: KVSnapshot) -> Request:
        """Queue a request made by `check_import`, with its pages (between steps). Raises OutOfPages,
        changing nothing, when the pool cannot hold them now."""
        if req.request_id in self.requests:
            raise ParamError("request_id", f"request id {req.request_id!r} is already running")
        seq = self._new_sequence(req, 0, self._sampler_state(req))
        if snapshot.rng_state is not None:
            seq.state.rng.bit_generator.state = snapshot.rng_state
        now = time.perf_counter()
        for count, tok in enumerate(snapshot.token_ids[snapshot.prompt_len:], 1):
            seq.output_ids.append(tok)
            logprobs = snapshot.logprobs[count - 1] if snapshot.logprobs else None
            self._record_token(seq, tok, logprobs, now, count)
        if seq.finished:                        # a stop token or string among them
            raise ParamError("prompt", "the imported sequence has already finished")
        seq.table = self.pool.adopt(snapshot.token_ids, snapshot.num_computed, snapshot.first_page)
        self.model.write_pages(seq.table.pages[snapshot.first_page:], snapshot.pages)
        seq.num_computed = snapshot.num_computed
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        return req

    def _sampler_state(self, req: Request) -> SamplerState:
        stop_ids = frozenset(req.params.stop_token_ids) | (frozenset() if req.params.ignore_eos else self.eos_ids)
        grammar = self.grammars.matcher(req.params.structured) if req.params.structured is not None else None
        return SamplerState(req.params, req.prompt_ids, stop_ids, grammar=grammar)

    def export_kv(self, seq: Sequence) -> KVSnapshot:
        """A snapshot of `seq`'s computed K/V rows, its tokens and its sampler's place."""
        t0 = time.perf_counter()
        table = seq.table
        carried = table.pages[table.dropped:self.pool.pages_for(seq.num_computed)]
        return KVSnapshot(self.model.kv_layout, seq.all_ids, len(seq.request.prompt_ids), seq.num_computed,
                          table.dropped, self.model.read_pages(carried),
                          None if seq.logprobs is None else list(seq.logprobs),
                          seq.state.rng.bit_generator.state, {"export": time.perf_counter() - t0})

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, prompt: str | None = None, priority: int = 0,
                      export_kv: bool = False, lora_request=None) -> Request:
        """Everything `add_request` checks (the request's limits, runtime/limits.py, that its id is not
        running, and its adapter, read from disk here if it is not yet), without touching the engine's
        scheduling state: safe to call while a step runs in another thread. Returns the Request for
        `enqueue`."""
        params = self.limits.check_request(prompt_ids, params, self.grammars, export_kv)
        if request_id is not None and request_id in self.requests:
            raise ParamError("request_id", f"request id {request_id!r} is already running")
        if lora_request is not None:
            if self.lora_slots is None:
                raise no_slots(lora_request.lora_name)
            if export_kv:
                raise ParamError("kv_transfer_params", "a request on a LoRA adapter cannot export its KV pages")
            self.lora_slots.check(lora_request)
        return Request(str(next(self._ids)) if request_id is None else request_id, list(prompt_ids), params,
                       prompt, priority, export_kv, lora_request)

    def enqueue(self, req: Request) -> Request:
        """Queue a request made by `check_request` (between steps)."""
        if req.request_id in self.requests:
            raise ParamError("request_id", f"request id {req.request_id!r} is already running")
        seq = self._new_sequence(req, 0, self._sampler_state(req))
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        return req

    def _new_sequence(self, req: Request, index: int, state: SamplerState) -> Sequence:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens, req.prompt_ids)
        seq = Sequence(req, index, state, detok)
        req.sequences.append(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None if it is not running."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.sequences:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        req.metrics.finish_time = time.perf_counter()
        return req.output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.speculator is not None:
            running = self.scheduler.running
            self.speculator.propose(running, {*running, *self.scheduler.waiting})
        schedule = self.scheduler.schedule()
        if not schedule.chunks:
            return []
        copies = [c for chunk in schedule.chunks for c in chunk.copies]
        if copies:
            self.model.copy_pages(copies)
        now = time.perf_counter()
        # what this step streams: every sample of a scheduled request starts empty (a sibling that
        # finished earlier must not repeat its last token)
        for req in {c.seq.request for c in schedule.chunks}:
            for s in req.sequences:
                s.new_text, s.new_token_ids = "", []
        inputs = [self._step_chunk(c, now) for c in schedule.chunks]
        masks = self._prepare_masks(schedule.chunks)
        tf = time.perf_counter()
        logits = self._run(step_inputs(inputs, self.model.page_size))
        if masks is not None:
            masks.result()
        forward = time.perf_counter() - tf
        self.stats.forward_seconds += forward
        if self.speculator is not None:
            self.speculator.timed(forward, sum(len(c.draft) for c in schedule.chunks))
        offsets = output_offsets(inputs)
        rows, ready, guessed = [], [], []
        touched: dict[str, Request] = {}
        for i, c in enumerate(schedule.chunks):
            seq = c.seq
            if c.draft:                                   # verified after the plain rows are drawn
                guessed.append((c, offsets[i]))
                continue
            row = offsets[i + 1] - 1                      # this chunk's last token's logits
            if inputs[i].all_rows:
                self._add_prompt_logprobs(seq.request, c.start, logits, offsets[i], offsets[i + 1])
            seq.num_computed += c.num_tokens
            if seq.num_computed // self.pool.page_size > len(seq.table.hashes):    # a page just filled
                self.pool.register_full_pages(seq.table, seq.all_ids, seq.num_computed)
            self.pool.drop_dead_pages(seq.table, seq.num_computed)     # outside every layer's window
            if seq.num_computed == seq.num_tokens:        # caught up: this row's logits pick the next token
                for s in self._fork_samples(seq):
                    if s.request.params.max_tokens == 0:      # prompt only (scoring): nothing to sample
                        self._finish_unsampled(s, now)
                        touched[s.request.request_id] = s.request
                        continue
                    rows.append(row)
                    ready.append(s)
        if ready:
            tokens = logits.sample(rows, [s.state for s in ready]).tolist()
            asked = [i for i, seq in enumerate(ready) if seq.logprobs is not None]
            found = logits.logprobs([rows[i] for i in asked], [tokens[i] for i in asked],
                                    [ready[i].request.params.logprobs for i in asked])
            logprobs = dict(zip(asked, found))
            now = time.perf_counter()
            for i, (seq, tok) in enumerate(zip(ready, tokens)):
                self._append_token(seq, tok, logprobs.get(i), now)
                touched[seq.request.request_id] = seq.request
        if guessed:
            host = logits.host_rows([first + j for c, first in guessed for j in range(len(c.draft) + 1)])
            now, at = time.perf_counter(), 0
            for c, first in guessed:
                self._verify(c, first, host[at:at + len(c.draft) + 1], logits, now)
                at += len(c.draft) + 1
                touched[c.seq.request.request_id] = c.seq.request
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - t0
        outputs = [req.output() for req in touched.values()]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _verify(self, c, first: int, rows: np.ndarray, logits, now: float) -> None:
        """Take the tokens a speculative chunk's rows confirm (runtime/speculative.py): row j, after
        guess j - 1, gives one token; the walk stops at the first token that is not the guess, or
        where the sequence finishes. The KV rows of the guesses not taken are cut off."""
        seq, draft = c.seq, c.draft
        probs = seq.draft_probs
        accepted = 0
        for j in range(len(draft) + 1):
            seq.num_computed += 1                         # row j's input: the last token or a taken guess
            guess = draft[j] if j < len(draft) else None
            token, taken = verify_row(rows[j], seq.state, guess, None if probs is None or guess is None else probs[j])
            found = None
            if seq.logprobs is not None:
                found = logits.logprobs([first + j], [token], [seq.request.params.logprobs])[0]
            self._append_token(seq, token, found, now)
            accepted += taken
            if seq.finished or not taken:
                break
        self.speculator.record(seq, len(draft), accepted)
        if seq.finished:                                  # its pages are gone already
            return
        self.pool.truncate(seq.table, seq.num_computed)
        self.pool.register_full_pages(seq.table, seq.all_ids, seq.num_computed)
        self.pool.drop_dead_pages(seq.table, seq.num_computed)

    def _prepare_masks(self, chunks):
        """The grammar masks of the constrained sequences this step samples, computed on a worker
        thread while the forward runs (both release the GIL); None when there are none."""
        states = [c.seq.state for c in chunks if c.seq.state.grammar is not None
                  and c.start + c.num_tokens - len(c.draft) == c.seq.num_tokens]
        if not states:
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
        return self._mask_worker.submit(lambda: [state.prepare() for state in states])

    def _step_chunk(self, c, now: float) -> SeqChunk:
        """A scheduled chunk as the step's input (its tokens, pages and slots), counted in the stats."""
        seq = c.seq
        seq.request.metrics.first_scheduled_time = seq.request.metrics.first_scheduled_time or now
        in_prompt = max(0, min(c.num_tokens, len(seq.request.prompt_ids) - c.start))
        self.stats.prefill_tokens += in_prompt
        self.stats.decode_tokens += c.num_tokens - in_prompt
        tokens = seq.tokens(c.start, c.start + c.num_tokens - len(c.draft)) + c.draft
        return SeqChunk(tokens, c.start, list(seq.table.pages), c.slots,
                        all_rows=bool(c.draft) or (bool(in_prompt) and seq.request.needs_prompt_logprobs),
                        lora_slot=seq.lora_slot)

    def _finish_unsampled(self, seq: Sequence, now: float) -> None:
        seq.finish_reason = "length"
        self.scheduler.finish(seq)
        if seq.request.finished:
            seq.request.metrics.finish_time = now

    def _run(self, inputs: dict[str, np.ndarray]):
        """The step's logits: left on the device where the model samples there, else on the host."""
        sampler = getattr(self.model, "sampler", None)
        if sampler is not None:
            return DeviceLogits(self.model.run(inputs), sampler)
        return HostLogits(self.model.forward(inputs))

    def _add_prompt_logprobs(self, req: Request, start: int, logits, first: int, end: int) -> None:
        """Logprobs of the prompt tokens logits rows first..end-1 predict: row first + j (position
        start + j) predicts prompt token start + j + 1. Rows recomputed after a preemption are skipped."""
        rows, targets = [], []
        for j in range(end - first):
            target = start + j + 1
            if target == len(req.prompt_logprobs) + len(targets) and target < len(req.prompt_ids):
                rows.append(first + j)
                targets.append(req.prompt_ids[target])
        req.prompt_logprobs += logits.logprobs(rows, targets, [req.params.prompt_logprobs] * len(rows))

    def _fork_samples(self, seq: Sequence) -> list[Sequence]:
        """The sequences that sample from `seq`'s logits: n > 1 samples fork when the prompt is done."""
        req = seq.request
        if len(req.sequences) == req.params.n or seq.output_ids:
            return [seq]
        children = []
        after = seq
        for index in range(1, req.params.n):
            child = self._new_sequence(req, index, seq.state.fork(index))
            child.table = self.pool.fork(seq.table)
            child.num_computed = seq.num_computed
            self.scheduler.add_running(child, after)
            children.append(child)
            after = child
        return [seq, *children]

    def _append_token(self, seq: Sequence, tok: int, logprobs: dict[int, float] | None, now: float) -> None:
        seq.output_ids.append(tok)
        self._record_token(seq, tok, logprobs, now, len(seq.output_ids))

    def _record_token(self, seq: Sequence, tok: int, logprobs: dict[int, float] | None, now: float,
                      count: int) -> None:
        """Everything a new output token (the count-th, already in output_ids) changes: the sampler's
        counts, the text, streaming, metrics and whether the sequence stops."""
        req, p = seq.request, seq.request.params
        seq.new_token_ids.append(tok)
        seq.state.append(tok)
        m = req.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        stopped_by_token = tok in seq.state.stop_ids      # the sampler masks them until min_tokens
        if seq.detokenizer is not None and not (stopped_by_token and tok in self.eos_ids):
            self._add_text(seq, seq.detokenizer.add(tok))
        if not seq.finished:                              # (a stop string may have ended it already)
            if stopped_by_token:
                seq.finish_reason, seq.stop_reason = "stop", tok
            elif seq.state.grammar is not None and (seq.state.grammar.terminated or seq.state.grammar_ended()):
                # the structured output is complete (a stop token is all that may follow: the sequence
                # stops without a step to draw it, so one finished on its last allowed token is no cut)
                seq.finish_reason = "stop"
            elif count >= p.max_tokens:
                seq.finish_reason = "length"
        if seq.finished:
            # an exported sequence cut at max_tokens goes on elsewhere: text held back for the next token stays
            going_on = req.export_kv and seq.finish_reason == "length"
            if seq.detokenizer is not None and seq.stop_reason not in p.stop and not going_on:
                self._add_text(seq, seq.detokenizer.flush())
            if req.export_kv and seq.num_computed:
                req.kv = self.export_kv(seq)
            self.scheduler.finish(seq)
            if req.finished:
                m.finish_time = now

    def _add_text(self, seq: Sequence, piece: str) -> None:
        """Append detokenised text, ending the sequence at the first stop string (which is dropped)."""
        if not piece or seq.finished:
            return
        stops = seq.request.params.stop
        before = len(seq.text)
        seq.text += piece
        if stops:
            # a stop string may span tokens: search from where one ending in this piece could start
            start = max(0, before - max(map(len, stops)) + 1)
            found = [(seq.text.find(s, start), s) for s in stops]
            found = [(i, s) for i, s in found if i >= 0]
            if found:
                cut, stop = min(found)
                seq.text = seq.text[:cut]
                seq.finish_reason, seq.stop_reason = "stop", stop
                seq.new_text += seq.text[before:] if cut >= before else ""
                return
        seq.new_text += piece

    # -- offline use ---------------------------------------------------------------------------
    def run_to_completion(self, on_output: Callable[[RequestOutput], None] | None = None) -> dict[str, RequestOutput]:
        """Step until every request has finished; return each request's final output by id."""
        final = {}
        while self.has_unfinished():
            for out in self.step():
                if on_output:
                    on_output(out)
                if out.finished:
                    final[out.request_id] = out
        return final

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Run token-id prompts to completion together; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final = self.run_to_completion(on_output)
        return [final[r.request_id] for r in reqs]
