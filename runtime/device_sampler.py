"""Sampling on the device that holds the logits: only token ids (and asked-for logprobs) come back.

The compiled functions (codegen/lowering/sampling.py) compute the draw runtime/sampler.py defines. The host
keeps what is per request: each sequence's generator draws its one uniform number here, exactly as
the NumPy sampler would (one per sampled row, none for a greedy row), and the penalties and bias
become a short list of (row, token) entries from the rows that use them (`penalty_entries`), and a
structured output's grammar mask a bitmask row (`apply_token_mask`). One `sample` call runs up to
five compiled functions: `apply_penalties` when some row has entries, `apply_token_mask` when some
row has a grammar, then `sample_greedy` for the greedy rows, `sample_plain` for sampled rows without top-k/top-p and
`sample_sorted` for the rest (each on its own rows, so a row is sorted only if its params need it).

Uses only TVM's runtime and NumPy.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.interface import OPTIONAL_SAMPLER_FUNCTIONS, SAMPLER_FUNCTIONS

from .sampler import SamplerState, penalty_entries, sample, top_logprobs
from .step_buffers import StepBuffers



class DeviceSampler:
    """Picks tokens from logits that stay on `device`, with the functions of a compiled VM."""

    def __init__(self, vm, device):
        self.device = device
        self.buffers = StepBuffers(device)      # the small per-call arrays, in reused device memory
        self.fn = {}
        for key, name in SAMPLER_FUNCTIONS.items():
            try:
                self.fn[key] = vm[name]
            except AttributeError as e:
                if key not in OPTIONAL_SAMPLER_FUNCTIONS:
                    raise KilnError(f"the compiled library has no sampling functions ({e}); "
                                    "it was built before kiln compiled sampling with the model") from None

    @property
    def masks(self) -> bool:
        """Whether grammar masks apply here (artifacts compiled before structured output cannot)."""
        return "mask" in self.fn

    def _put(self, name: str, array: np.ndarray):
        return self.buffers.put(name, np.ascontiguousarray(array))

    def sample(self, logits, states: Sequence[SamplerState], rows: Sequence[int] | None = None) -> np.ndarray:
        """One token per state: state i samples from logits row rows[i] (default: row i).

        logits: a tvm.runtime.Tensor f32 [r, vocab] on the device. Returns int64 [len(states)]."""
        count = len(states)
        rows = np.arange(count, dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
        if rows.shape != (count,):
            raise ValueError(f"{count} sampler states but {rows.shape[0]} rows")
        if not count:
            return np.zeros(0, np.int64)
        out = np.empty(count, np.int64)
        for picked, ids in self.sample_on_device(logits, states, rows):
            out[picked] = ids.numpy()
        return out

    def sample_on_device(self, logits, states: Sequence[SamplerState],
                         rows: Sequence[int] | np.ndarray) -> list[tuple[list[int], object]]:
        """As `sample`, with the ids left where they were drawn: (which states, their ids as an
        int32 tensor on the device) for each group of rows one compiled function samples."""
        return self.draw(logits, self.plan(states, rows, int(logits.shape[1])))

    def plan(self, states: Sequence[SamplerState], rows: Sequence[int] | np.ndarray, vocab: int) -> list:
        """Everything a draw uploads, uploaded now: before the step's forward is launched, a launch
        does not wait for it (runtime/launch.py). Each sampled row's uniform number is drawn from
        its state's generator now. [(function, states it samples, device arguments after the
        logits)], the penalties' first where a row has entries."""
        rows = np.asarray(rows, np.int32)
        if not len(states):
            return []
        steps = []
        penalties = self._penalty_args(rows, states, vocab)
        if penalties is not None:
            steps.append(("penalties", None, penalties))
            rows = np.arange(len(states), dtype=np.int32)       # the draws read the processed rows
        masks = [st.allowed() for st in states]
        if any(m is not None for m in masks):
            bits = _bitmask(masks, vocab)                    # a grammar's mask, before the draws
            flat = self._put("mask.bits", bits.reshape(-1))
            steps.append(("mask", None, [self._put("mask.rows", rows), flat._create_view(bits.shape, "int32")]))
            rows = np.arange(len(states), dtype=np.int32)
        greedy = [i for i, st in enumerate(states) if st.params.greedy]
        if greedy:
            steps.append(("greedy", greedy, [self._put("greedy.rows", rows[greedy])]))
        for kind, picked in self._sampled_groups(states, vocab).items():
            steps.append((kind, picked, self._row_params(kind, rows, states, picked, vocab)))
        return steps

    def draw(self, logits, plan: list) -> list[tuple[list[int], object]]:
        """Run a plan's functions on a step's logits: (states, their ids on the device) per group."""
        source, groups = logits, []
        for kind, picked, args in plan:
            if kind in ("penalties", "mask"):                  # each rewrites the rows the draws read
                source = self.fn[kind](source, *args)
            else:
                groups.append((picked, self.fn[kind](source, *args)))
        return groups

    def _row_params(self, kind: str, rows: np.ndarray, states, picked: list[int], vocab: int) -> list:
        """The device arguments after the logits for `picked` states: rows, temperature, [top_k,
        top_p,] min_p and each state's uniform number, drawn from its generator here."""
        p = [states[i].params for i in picked]
        args = [rows[picked], np.array([q.temperature for q in p], np.float64)]
        if kind == "sorted":
            args += [np.array([q.top_k if 0 < q.top_k < vocab else 0 for q in p], np.int32),
                     np.array([q.top_p for q in p], np.float64)]
        args += [np.array([q.min_p for q in p], np.float64),
                 np.array([states[i].rng.random() for i in picked], np.float64)]
        return [self._put(f"{kind}.{i}", a) for i, a in enumerate(args)]

    @staticmethod
    def _sampled_groups(states: Sequence[SamplerState], vocab: int) -> dict[str, list[int]]:
        """Indices of the non-greedy states, split by whether their filters need a sorted row."""
        groups: dict[str, list[int]] = {"plain": [], "sorted": []}
        for i, st in enumerate(states):
            p = st.params
            if not p.greedy:
                groups["sorted" if 0 < p.top_k < vocab or p.top_p < 1.0 else "plain"].append(i)
        return {kind: picked for kind, picked in groups.items() if picked}

    def _penalized(self, logits, rows: np.ndarray, states: Sequence[SamplerState], vocab: int):
        """The processed logits f32 [len(states), vocab] on the device, or None when no row has
        penalty or bias entries."""
        args = self._penalty_args(rows, states, vocab)
        return None if args is None else self.fn["penalties"](logits, *args)

    def _penalty_args(self, rows: np.ndarray, states: Sequence[SamplerState], vocab: int) -> list | None:
        """apply_penalties' device arguments after the logits (its output: the processed logits f32
        [len(states), vocab]), or None when no row has penalty or bias entries (then the draw reads
        the raw logits)."""
        parts = [(i, penalty_entries(st, vocab)) for i, st in enumerate(states)]
        parts = [(i, e) for i, e in parts if len(e[0])]
        if not parts:
            return None
        entry_rows = np.concatenate([np.full(len(e[0]), i, np.int32) for i, e in parts])
        columns = [np.concatenate([e[c] for _, e in parts]) for c in range(4)]
        return [self._put(f"penalties.{i}", a)
                for i, a in enumerate((rows, entry_rows, columns[0].astype(np.int32), *columns[1:]))]

    def top_logprobs(self, logits, rows: Sequence[int], tokens: Sequence[int],
                     ks: Sequence[int]) -> list[dict[int, float]]:
        """As runtime/sampler.py `top_logprobs` for each (row, token, k): the log-softmax of raw logits
        row rows[i] at tokens[i], then its ks[i] (<= 20) best tokens. Ties among them may come in
        another order than NumPy's lowest-id-first on a GPU."""
        if not len(rows):
            return []
        ids, values, own = self.fn["logprobs"](logits, self._put("logprobs.rows", np.asarray(rows, np.int32)),
                                               self._put("logprobs.tokens", np.asarray(tokens, np.int32)))
        ids, values, own = ids.numpy(), values.numpy(), own.numpy()
        out = []
        for i, (tok, k) in enumerate(zip(tokens, ks)):
            row = {int(tok): float(own[i])}
            for t, lp in zip(ids[i, :k].tolist(), values[i, :k].tolist()):
                row.setdefault(int(t), float(lp))
            out.append(row)
        return out


def _bitmask(masks: list, vocab: int) -> np.ndarray:
    """int32 [rows, ceil(vocab / 32)]: bit t % 32 of word t // 32 set where token t is allowed
    (every bit for a row without a mask)."""
    words = (vocab + 31) // 32
    bits = np.full((len(masks), words), -1, np.int32)
    for i, mask in enumerate(masks):
        if mask is not None:
            packed = np.zeros(words * 4, np.uint8)
            packed[:(vocab + 7) // 8] = np.packbits(mask[:vocab], bitorder="little")
            bits[i] = packed.view("<i4")
    return bits


class HostLogits:
    """A step's logits on the host (a NumPy array): the engine's view when sampling is NumPy's."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def sample(self, rows: list[int], states: Sequence[SamplerState]) -> np.ndarray:
        return sample(self.array[rows], states)

    def logprobs(self, rows: list[int], tokens: list[int], ks: list[int]) -> list[dict[int, float]]:
        return [top_logprobs(self.array[r], t, k) for r, t, k in zip(rows, tokens, ks)]

    def host_rows(self, rows: list[int]) -> np.ndarray:
        return self.array[rows]


class DeviceLogits:
    """A step's logits left on the device, sampled there by a DeviceSampler."""

    def __init__(self, tensor, sampler: DeviceSampler):
        self.tensor, self.sampler = tensor, sampler

    def sample(self, rows: list[int], states: Sequence[SamplerState]) -> np.ndarray:
        constrained = [i for i, st in enumerate(states) if st.grammar is not None]
        if not constrained or self.sampler.masks:
            return self.sampler.sample(self.tensor, states, rows)
        # an artifact compiled without apply_token_mask: constrained rows are read back and drawn here
        free = [i for i in range(len(states)) if states[i].grammar is None]
        out = np.empty(len(states), np.int64)
        out[free] = self.sampler.sample(self.tensor, [states[i] for i in free], [rows[i] for i in free])
        host = self.tensor.numpy()
        out[constrained] = sample(host[[rows[i] for i in constrained]], [states[i] for i in constrained])
        return out

    def logprobs(self, rows: list[int], tokens: list[int], ks: list[int]) -> list[dict[int, float]]:
        return self.sampler.top_logprobs(self.tensor, rows, tokens, ks)

    def host_rows(self, rows: list[int]) -> np.ndarray:
        """Rows read back to the host (a speculative chunk's, which are verified there)."""
        return self.tensor.numpy()[rows]
