"""A stand-in for a compiled model that keeps the engine honest about its KV pages.

Its "KV cache" is an array of token ids, one per slot: each step writes every new token at its
slot, then every sequence reads its whole history back through its page list (page_values,
last_page_len), exactly where the real attention kernel would look. The next-token logits are
a deterministic function of that history, so a wrong page table, a missed copy-on-write or a
stale prefix-cache page changes the tokens a test sees.
With `kv_window` W, a token's logits depend on the last W tokens only (itself included), read the
same way; a read through a page the pool dropped fails.
"""
from __future__ import annotations

import copy

import numpy as np


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int = 4, vocab_size: int = 50, max_context: int = 512,
                 kv_window: int | None = None):
        self.page_size, self.vocab_size, self.max_context = page_size, vocab_size, max_context
        self.kv_window = kv_window
        self.kv = np.full(num_pages * page_size, -1, np.int64)     # -1: never written
        self.steps: list[dict] = []                                  # what each forward was asked
        self.copied = 0                                              # pages copied (copy-on-write)

    @staticmethod
    def next_token_logits(history: list[int], vocab_size: int) -> np.ndarray:
        """Peaked on a token that depends on the whole history (order included)."""
        h = 7
        for t in history:
            h = (h * 31 + t + 1) % 1_000_003
        logits = np.zeros(vocab_size, np.float32)
        logits[h % vocab_size] = 5.0
        logits[(h // vocab_size) % vocab_size] += 3.0
        return logits

    def copy_pages(self, pairs):
        p = self.page_size
        for src, dst in pairs:
            self.kv[dst * p:(dst + 1) * p] = self.kv[src * p:(src + 1) * p]
            self.copied += 1

    @property
    def kv_layout(self) -> str:
        return f"fake-page{self.page_size}"

    def read_pages(self, pages: list[int]) -> dict[str, np.ndarray]:
        return {"tokens": self.kv.reshape(-1, self.page_size)[list(pages)].copy()}

    def write_pages(self, pages: list[int], contents: dict[str, np.ndarray]) -> None:
        self.kv.reshape(-1, self.page_size)[list(pages)] = contents["tokens"]

    def forward(self, inputs: dict) -> np.ndarray:
        self.steps.append({k: v.copy() for k, v in inputs.items()})
        self.kv[inputs["slot_mapping"]] = inputs["tokens"]
        p = self.page_size
        out = []
        qi, pi, pv, lpl = inputs["q_indptr"], inputs["page_indptr"], inputs["page_values"], inputs["last_page_len"]
        for s in range(len(qi) - 1):
            pages = pv[pi[s]:pi[s + 1]]
            kv_len = (len(pages) - 1) * p + lpl[s]
            for row in inputs["logit_rows"]:              # the rows asked for that belong to this sequence
                if qi[s] <= row < qi[s + 1]:
                    seen = kv_len - (qi[s + 1] - 1 - row)  # keys up to and including this row's token
                    first = max(0, seen - self.kv_window) if self.kv_window else 0
                    assert all(pages[t // p] >= 0 for t in range(first, seen)), "read a dropped page"
                    history = self.kv[[pages[t // p] * p + t % p for t in range(first, seen)]].tolist()
                    assert -1 not in history, "a sequence read a KV slot nothing wrote"
                    out.append(self.next_token_logits(history, self.vocab_size))
        return np.stack(out)


def reference_greedy(prompt: list[int], max_tokens: int, vocab_size: int, stop_ids=(), window=None) -> list[int]:
    """What greedy generation must give, computed without any paging."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        tok = int(np.argmax(FakeRunner.next_token_logits(ids[-window:] if window else ids, vocab_size)))
        out.append(tok)
        ids.append(tok)
        if tok in stop_ids:
            break
    return out


class LaunchedStep:
    """A step the lazy runner was given and has not computed: it is computed when its result is
    first read, after the step launched before it, as a device's stream runs them."""

    def __init__(self, runner: "LazyRunner", inputs, copies, rows, states, previous, feed):
        self.runner, self.inputs, self.copies = runner, inputs, copies
        self.rows, self.states, self.previous, self.feed = rows, states, previous, feed
        self._result = None

    def result(self):
        if self._result is None:
            from kiln.runtime.device_sampler import HostLogits
            before = self.previous.result()[0] if self.previous is not None else None
            tokens = self.inputs["tokens"].copy()
            for index, row in self.feed:                  # the placeholders, from the step before
                tokens[index] = before[row]
            assert (tokens >= 0).all(), "a placeholder token the runner was not told to feed"
            self.runner.copy_pages(self.copies)
            logits = HostLogits(self.runner.forward({**self.inputs, "tokens": tokens}))
            self._result = (logits.sample(self.rows, self.states), logits)
            self.previous = None                          # computed: the chain ends here
        return self._result


class LazyRunner(FakeRunner):
    """A FakeRunner whose `launch` (runtime/overlap.py) returns at once and computes nothing until
    the step's result is read. What the sampler reads of each sequence's state is taken at the
    launch, as a device sampler takes it (its penalty entries, and its uniform number, drawn then
    from the sequence's generator): a sequence continued before its last token was known samples
    without it."""

    def launch(self, inputs, copies, rows, states, previous, feed, keep_logits=False) -> LaunchedStep:
        taken = [copy.deepcopy(s) for s in states]
        for s in states:
            if not s.params.greedy:
                s.rng.random()               # the draw the launched step makes, gone from the generator
        return LaunchedStep(self, {k: v.copy() for k, v in inputs.items()}, list(copies), list(rows),
                            taken, previous, list(feed))


class FakeLoRARunner(FakeRunner):
    """A FakeRunner with `max_loras` adapter slots over one fake projection: an adapter's rows hold its
    number k (write_lora_slot), and every token a sequence on slot s writes into the KV cache is marked
    with its adapter's k (token + 1000 k), as an adapter's K/V differ from the base model's: so a page
    shared across adapters, or a row run on another adapter's slot, changes the tokens a test sees."""
    MODULE = "model.layers.0.self_attn.q_proj"

    def __init__(self, num_pages: int, page_size: int = 4, vocab_size: int = 50, max_loras: int = 2):
        from kiln.interface import LoRALayout, LoRASite
        super().__init__(num_pages, page_size, vocab_size)
        self.lora = LoRALayout(max_loras, 1, "float32", (LoRASite("lora_a.m", "lora_b.m", (self.MODULE,), (1,), 1),))
        self.slot_adapter = [0] * max_loras
        self.writes: list[tuple[int, int]] = []          # (slot, adapter k) of each write_lora_slot

    def write_lora_slot(self, slot: int, rows: dict) -> None:
        self.slot_adapter[slot] = int(rows["lora_a.m"][0, 0])
        self.writes.append((slot, self.slot_adapter[slot]))

    def forward(self, inputs: dict) -> np.ndarray:
        marks = np.array([self.slot_adapter[s] if s >= 0 else 0 for s in inputs["lora_slots"]], np.int64)
        return super().forward({**inputs, "tokens": inputs["tokens"] + 1000 * marks})


def write_fake_adapter(folder, k: int):
    """A PEFT adapter folder FakeLoRARunner reads as adapter k (rank 1, scale 1, A = [[k]])."""
    import json
    from pathlib import Path
    from safetensors.numpy import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 1}))
    key = f"base_model.model.{FakeLoRARunner.MODULE}.lora_{{}}.weight"
    save_file({key.format("A"): np.full((1, 1), k, np.float32), key.format("B"): np.ones((1, 1), np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


def reference_lora_greedy(prompt: list[int], max_tokens: int, vocab_size: int, k: int) -> list[int]:
    """reference_greedy for a sequence on adapter k (0: none): every token it reads is marked with k."""
    ids, out = [t + 1000 * k for t in prompt], []
    for _ in range(max_tokens):
        tok = int(np.argmax(FakeRunner.next_token_logits(ids, vocab_size)))
        out.append(tok)
        ids.append(tok + 1000 * k)
    return out
