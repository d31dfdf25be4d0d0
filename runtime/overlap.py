"""One step ahead: the engine launches step N+1 before it reads step N's tokens back.

For a runner that `launch`es a step and hands its result over later: a device whose kernels run
while the host works, or tests/fake_runner.py's lazy runner. While step N runs, the host schedules
and builds step N+1, assuming every sequence that samples in N goes on: each gets a placeholder
token, which the runner fills from step N's sampled ids (`feed`), so no token crosses to the host
between the two steps. Then the host takes N's tokens and does what trails by one step: stop
checks, detokenising, streaming and prefix-cache registration. A sequence that N stopped has also
computed a token in N+1: that token is dropped, and its KV slot goes back with the sequence's pages.

A sequence whose next draw depends on the token before it is not continued blindly: penalties read
the output tokens, min_tokens masking counts them, and a sample that reaches max_tokens is its
last. Such a sequence waits for its token and runs every other step. Greedy and seeded outputs are
the synchronous engine's: every sequence draws from its own generator, in the same order.

The runner's side (`launch(inputs, copies, rows, states, previous, feed, keep_logits)` -> a handle
whose `result()` is (sampled ids, logits with `logprobs(rows, tokens, ks)`, valid then when
keep_logits was set)): the page copies, the placeholders' ids and the step run in launch order,
after the previous step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kiln.errors import KilnError

from .engine import Engine
from .request import RequestOutput, Sequence
from .scheduler import ScheduledChunk
from .step import output_offsets, step_inputs

PLACEHOLDER = -1        # an output token the runner has sampled and the host has not read yet


@dataclass
class Launched:
    """A step in flight and what the host does with its result."""
    handle: object
    chunks: list[tuple[ScheduledChunk, int]]        # each chunk, with its sequence's preemptions at launch
    ready: list[Sequence]                            # who samples, in result order
    positions: list[int | None]                      # where each one's placeholder sits in its output_ids
    unsampled: list[Sequence]                        # max_tokens 0: the prompt scored, nothing drawn
    rows: list[int] = field(default_factory=list)    # each ready sequence's logits row
    prompt_rows: list[tuple] = field(default_factory=list)   # (request, start, first row, end row)
    row_of: dict = field(default_factory=dict)       # sequence -> its index among `ready`


class OverlapEngine(Engine):
    """The Engine, running one step ahead on a runner that launches steps (see the module docstring)."""
    runs_ahead = True

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        if self.speculator is not None:
            # a step's guesses start from the tokens the step before it confirms
            raise KilnError("speculative decoding does not run one step ahead: use an engine that does not "
                            "overlap steps (kiln.LLM(..., overlap=False))")
        self.inflight: Launched | None = None

    def has_unfinished(self) -> bool:
        return self.inflight is not None or super().has_unfinished()

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is not None:                  # tokens not read back yet are not the client's
            for seq in req.sequences:
                while seq.output_ids and seq.output_ids[-1] == PLACEHOLDER:
                    seq.output_ids.pop()
        return super().abort(request_id)

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then finish the one in flight: its outputs come back (one step late)."""
        t0 = time.perf_counter()
        if self.inflight is not None:
            self._settle_pages(self.inflight)
        launched = self._launch()
        outputs = self._finish(self.inflight) if self.inflight is not None else []
        self.inflight = launched
        self.stats.seconds += time.perf_counter() - t0
        return outputs

    # -- the step ahead ------------------------------------------------------------------------
    def _launch(self) -> Launched | None:
        schedule = self.scheduler.schedule()
        if not schedule.chunks:
            return None
        now = time.perf_counter()
        previous = self.inflight
        chunks, feed, base = [], [], 0
        for c in schedule.chunks:
            chunks.append(self._step_chunk(c, now))
            # a placeholder is always the one token of a decode: the sample of the step in flight
            feed += [(base + j, previous.row_of[c.seq]) for j, t in enumerate(chunks[-1].tokens) if t == PLACEHOLDER]
            base += len(chunks[-1].tokens)
        offsets = output_offsets(chunks)
        launched = Launched(None, [(c, c.seq.preemptions) for c in schedule.chunks], [], [], [])
        rows = launched.rows
        for i, c in enumerate(schedule.chunks):
            seq = c.seq
            if chunks[i].all_rows:
                launched.prompt_rows.append((seq.request, c.start, offsets[i], offsets[i + 1]))
            seq.num_computed += c.num_tokens          # in flight: written before anything reads it
            if seq.num_computed == seq.num_tokens:
                for s in self._fork_samples(seq):
                    if s.request.params.max_tokens == 0:
                        launched.unsampled.append(s)
                    else:
                        rows.append(offsets[i + 1] - 1)
                        launched.ready.append(s)
        for index, s in enumerate(launched.ready):
            launched.row_of[s] = index
            if self._continues(s):
                s.output_ids.append(PLACEHOLDER)
                launched.positions.append(len(s.output_ids) - 1)
            else:
                launched.positions.append(None)
        copies = [pair for c in schedule.chunks for pair in c.copies]
        # logits the host reads at the finish: logprobs of samples or of prompt tokens
        keep = bool(launched.prompt_rows) or any(s.logprobs is not None for s in launched.ready)
        launched.handle = self.model.launch(step_inputs(chunks, self.model.page_size), copies, rows,
                                            [s.state for s in launched.ready],
                                            previous.handle if previous else None, feed, keep)
        return launched

    @staticmethod
    def _continues(seq: Sequence) -> bool:
        """Whether the next step may take this sequence before its sampled token is known: not when
        the sample after it depends on it, or this one is its last by length."""
        p, state = seq.request.params, seq.state
        history = bool(p.presence_penalty or p.frequency_penalty) or p.repetition_penalty != 1.0 \
            or (state.num_output < p.min_tokens and bool(state.stop_ids))
        return not history and len(seq.output_ids) + 1 < p.max_tokens

    def _settle_pages(self, launched: Launched) -> None:
        """What the synchronous engine does to the pages after a step's forward, done for the step in
        flight before the next is scheduled, as there: its filled pages enter the prefix cache (their
        tokens are all known: a decode's is the sample of the step before, read back by now) and
        pages outside every window go back. The device reuses none before the step in flight is done."""
        for c, preemptions in launched.chunks:
            seq = c.seq
            if seq.finished or seq.preemptions != preemptions:     # its pages went back since the launch
                continue
            end = c.start + c.num_tokens
            if end // self.pool.page_size > len(seq.table.hashes):
                self.pool.register_full_pages(seq.table, seq.all_ids, end)
            self.pool.drop_dead_pages(seq.table, end)

    # -- the step behind -----------------------------------------------------------------------
    def _finish(self, launched: Launched) -> list[RequestOutput]:
        tf = time.perf_counter()
        tokens, logits = launched.handle.result()
        self.stats.forward_seconds += time.perf_counter() - tf
        self.stats.steps += 1
        now = time.perf_counter()
        for req in {s.request for s in launched.ready + launched.unsampled}:
            for s in req.sequences:
                s.new_text, s.new_token_ids = "", []
        for req, start, first, end in launched.prompt_rows:
            if self.requests.get(req.request_id) is req:
                self._add_prompt_logprobs(req, start, logits, first, end)
        touched = {}
        for s in launched.unsampled:
            if not s.finished:
                self._finish_unsampled(s, now)
                touched[s.request.request_id] = s.request
        live = [i for i, s in enumerate(launched.ready) if not s.finished]    # (stopped or aborted since)
        asked = [i for i in live if launched.ready[i].logprobs is not None]
        found = logits.logprobs([launched.rows[i] for i in asked], [int(tokens[i]) for i in asked],
                                [launched.ready[i].request.params.logprobs for i in asked])
        logprobs = dict(zip(asked, found))
        for i in live:
            s, tok, position = launched.ready[i], int(tokens[i]), launched.positions[i]
            if position is None:
                s.output_ids.append(tok)
                position = len(s.output_ids) - 1
            else:
                s.output_ids[position] = tok
            self._record_token(s, tok, logprobs.get(i), now, position + 1)
            if s.finished:
                del s.output_ids[position + 1:]     # the step past its stop computed one more: dropped
            touched[s.request.request_id] = s.request
        outputs = [self._output(req) for req in touched.values()]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    @staticmethod
    def _output(req) -> RequestOutput:
        """The request's output with only the tokens read back: a sample in flight is not the client's."""
        out = req.output()
        for completion in out.outputs:
            while completion.token_ids and completion.token_ids[-1] == PLACEHOLDER:
                completion.token_ids.pop()
        return out
