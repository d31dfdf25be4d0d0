"""Steps launched now and read back later: a CompiledModel's side of the one-step-ahead engine
(runtime/overlap.py).

`Launcher.launch` runs a step's page copies, its entry and, where the artifact samples on the
device, its sampling, and reads nothing back:
- the step's inputs and its sampler's arguments are written to pinned memory and their copies
  queued first, behind the step still running (runtime/step_buffers.py: no upload waits for the
  GPU), so the forward, queued after them, reads them;
- the placeholder tokens come from the step before's sampled ids by device-to-device copies into
  this step's token buffer, after the inputs are uploaded;
- the sampled ids go to pinned host memory by an asynchronous copy on TVM's stream, and a CUDA event
  is recorded after it. `result()` waits for that event, so it waits for this step alone while the
  next one runs;
- logits that a captured CUDA graph overwrites at its next replay are copied first when the host
  reads them at the finish (`keep_logits`: logprobs of samples or prompt tokens).
On a CPU the copies and the read-back are plain and immediate. An artifact that samples on the host
computes each step at its launch; its placeholders are filled on the host from the ids of the step
before.
"""
from __future__ import annotations

import numpy as np

from kiln.interface import GRAPH_ENTRY, WIDE_GRAPH_ENTRY

from .cuda_runtime import DEVICE_TO_HOST, CudaRuntime
from .device_sampler import DeviceLogits, HostLogits
from .step_buffers import host_array
from .tvm_bridge import empty, pinned_device

ID_BYTES = 4            # the compiled samplers' ids are int32, as the token buffer is
PINNED_SLOTS = 2        # read-back buffers in turn: a step's ids are read before the step after next launches


class Computed:
    """A step computed at its launch: its sampled ids and logits on the host."""

    def __init__(self, tokens: np.ndarray, logits: HostLogits):
        self._result = (tokens, logits)

    def result(self):
        return self._result


class OnDevice:
    """A launched step whose ids were drawn on the device and are on their way to the host."""

    def __init__(self, groups: list, count: int, logits: DeviceLogits, readback=None):
        self.groups, self.count, self.logits = groups, count, logits
        self.readback = readback                 # (CudaRuntime, event, the pinned ids as numpy), or None: read plainly
        self._tokens: np.ndarray | None = None
        self.places = {i: (ids, place) for picked, ids in groups for place, i in enumerate(picked)}

    def source(self, index: int) -> tuple[object, int]:
        """Where sampled id `index` (the index-th state's) lies: its group's tensor, its place there."""
        return self.places[index]

    def result(self):
        if self._tokens is None:
            tokens = np.empty(self.count, np.int64)
            if self.readback is None:
                for picked, ids in self.groups:
                    tokens[picked] = ids.numpy()
            else:
                cuda, event, host = self.readback
                cuda.wait(event)
                order = [i for picked, _ in self.groups for i in picked]
                tokens[order] = host[:self.count]
            self._tokens = tokens
        return self._tokens, self.logits


class Launcher:
    """Launches one model's steps (see the module docstring)."""

    def __init__(self, model, cuda=None, host_device=None):
        """`cuda` and `host_device` (the pinned memory the ids come back to): found from the model's
        device unless given."""
        self.model = model
        if cuda is None and model.manifest.target.device == "cuda":
            cuda = CudaRuntime()
        self.host_device = host_device or (pinned_device(model.device) if cuda else None)
        self.cuda = cuda if self.host_device is not None else None
        self.pinned: list = [None] * PINNED_SLOTS     # (pinned tensor, numpy over it) per slot
        self.events = [self.cuda.new_event() for _ in range(PINNED_SLOTS)] if self.cuda else []
        self.turn = 0

    def launch(self, inputs, copies, rows, states, previous, feed, keep_logits: bool = False):
        model = self.model
        model.copy_pages(copies)
        on_device = bool(feed) and isinstance(previous, OnDevice)
        if feed and not on_device:                # the ids of the step before are on the host
            tokens = inputs["tokens"].copy()
            before = previous.result()[0]
            for index, row in feed:
                tokens[index] = before[row]
            inputs = {**inputs, "tokens": tokens}
        kind, args, seqs = model.step_args(inputs)
        # every upload queued before the forward that reads it
        plan = model.sampler.plan(states, rows, model.vocab_size) if model.sampler is not None else None
        if on_device:
            self._feed(args[model.input_names.index("tokens")], previous, feed)
        logits = model.call(kind, args, seqs)
        if plan is None:
            host = HostLogits(logits.numpy())
            return Computed(host.sample(rows, states), host)
        groups = model.sampler.draw(logits, plan)
        if kind in (GRAPH_ENTRY, WIDE_GRAPH_ENTRY) and keep_logits:
            # the graph's output buffer is overwritten at the next replay
            kept = empty(logits.shape, logits.dtype, model.device)
            kept.copyfrom(logits)
            logits = kept
        return OnDevice(groups, len(states), DeviceLogits(logits, model.sampler), self._read_back(groups, len(states)))

    @staticmethod
    def _feed(target, previous: OnDevice, feed) -> None:
        """Token `index` of this step <- id `row` of the step before, device to device, in runs."""
        runs: list[list] = []                     # [index, tensor, place, length]
        for index, row in feed:
            tensor, place = previous.source(row)
            last = runs[-1] if runs else None
            if last and last[1] is tensor and index == last[0] + last[3] and place == last[2] + last[3]:
                last[3] += 1
            else:
                runs.append([index, tensor, place, 1])
        for index, tensor, place, length in runs:
            target._create_view((length,), "int32", relative_byte_offset=ID_BYTES * index).copyfrom(
                tensor._create_view((length,), "int32", relative_byte_offset=ID_BYTES * place))

    def _read_back(self, groups, count: int):
        """Copy the ids to this turn's pinned buffer on TVM's stream and record the event after it
        (CUDA); None where a plain read serves (a CPU)."""
        if self.cuda is None or not count:
            return None
        slot = self.turn % PINNED_SLOTS
        self.turn += 1
        if self.pinned[slot] is None or int(self.pinned[slot][0].shape[0]) < count:
            buffer = empty((max(count, 64),), "int32", self.host_device)
            self.pinned[slot] = (buffer, host_array(buffer, int(buffer.shape[0]), np.int32))
        buffer, host = self.pinned[slot]
        offset = 0
        for picked, ids in groups:
            self.cuda.copy_async(buffer.data_ptr() + ID_BYTES * offset, ids.data_ptr(), ID_BYTES * len(picked),
                                 DEVICE_TO_HOST)
            offset += len(picked)
        self.cuda.record(self.events[slot])
        return self.cuda, self.events[slot], host
