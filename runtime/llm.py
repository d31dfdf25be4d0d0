"""The offline API: `LLM(artifact_dir).generate(prompts, SamplingParams(...))`, one RequestOutput
per prompt, in prompt order (vLLM's shape); a progress bar for long batches."""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from kiln.artifact import WEIGHTS
from kiln.errors import KilnError

from .config import EngineConfig
from .draft_proposer import DraftProposer
from .engine import Engine
from .kv_pool import live_pages
from .limits import RequestLimits
from .lora import LoRARequest
from .memory import FRACTION, host_available_memory, parse_bytes
from .model import CompiledModel
from .ngram import NgramProposer
from .overlap import OverlapEngine
from .request import RequestOutput
from .sampler import SamplingParams
from .speculative import Speculator
from .threads import set_threads
from .tokenizer import Tokenizer

AUTO_FRACTION = 0.5      # "auto": this share of the device's free memory ...
AUTO_CAP = 4 << 30       # ... but never more than this, nor more than max_num_seqs full contexts


def kv_budget(spec: str | int | float, model: CompiledModel, max_num_seqs: int,
              tokens: int | None = None, max_batched_tokens: int = 2048) -> tuple[int, str]:
    """Bytes for the KV cache, and how they were chosen. `spec` is a size ('512MiB', or an int), a
    fraction of the device's free memory ('0.3'), or 'auto'. With `tokens` (a job that knows how
    long it is), the cache holds that many tokens, and `spec` is only a ceiling."""
    # a CPU's TVM device reports no free memory: the host's is the CPU's
    free = model.device.available_global_memory or (host_available_memory() if model.device.dlpack_device_type() == 1
                                                    else 0)
    if spec == "auto":
        # a full context per sequence, or what one holds at most when pages outside a window are dropped
        per_sequence = live_pages(model.max_context, max_batched_tokens, model.page_size, model.kv_window)
        want = max_num_seqs * per_sequence * model.bytes_per_page
        held = "full context" if model.kv_window is None else f"{model.kv_window}-token window"
        cap = min(want, AUTO_CAP, int(AUTO_FRACTION * free) if free else AUTO_CAP)
        how = (f"auto: {max_num_seqs} × a {held}, at most "
               f"{AUTO_FRACTION:.0%} of free memory and {AUTO_CAP >> 30} GiB")
    elif isinstance(spec, float) or (isinstance(spec, str) and FRACTION.fullmatch(spec)):
        fraction = float(spec)
        if not 0 < fraction <= 1 or not free:
            raise KilnError(f"KV memory fraction {spec} needs a value in (0, 1] and a device that reports "
                            "its free memory")
        cap, how = int(fraction * free), f"{fraction:g} of free memory"
    else:
        cap = parse_bytes(spec) if isinstance(spec, str) else int(spec)
        how = f"--kv-memory {spec}"
    if tokens is None:
        return cap, how
    pages = live_pages(tokens, max_batched_tokens, model.page_size, model.kv_window)
    if pages * model.bytes_per_page <= cap:
        return pages * model.bytes_per_page, f"sized for {tokens} tokens"
    return cap, f"{how}; {tokens} tokens asked for"


class LLM:
    def __init__(self, artifact_dir: str | Path, config: EngineConfig | None = None, *, verify: bool = True,
                 size_kv_for: int | None = None, tokenizer: Tokenizer | None = None, **settings):
        """An engine on the artifact, as `config` (runtime/config.py) says, with `settings` (its fields by
        name: kv_memory="8GiB", max_num_seqs=16, speculative="ngram", ...) changed in it.
        `size_kv_for`: size the KV cache for this many tokens (at most `kv_memory`), for a job that
        knows its length. `overlap` None: one step ahead of the host (runtime/overlap.py) on a GPU
        artifact, where an H100 measured it faster with the same tokens (docs/BENCHMARKS.md), not on
        the CPU, whose steps run where the host does, nor where the engine speculates."""
        self.config = config = (config or EngineConfig()).replace(**settings)
        # CPU threads for the kernels: `threads`, else $TVM_NUM_THREADS, else every available core.
        self.threads = set_threads(config.threads)
        self.model = CompiledModel(artifact_dir, verify=verify)
        self.tokenizer = tokenizer or Tokenizer(artifact_dir)
        if size_kv_for is not None:          # no job holds more than the model's context
            size_kv_for = min(size_kv_for, self.model.max_context)
        budget, self.kv_how = kv_budget(config.kv_memory, self.model, config.max_num_seqs, size_kv_for,
                                        config.max_batched_tokens)
        self.num_pages = self.model.allocate_kv(budget)
        self.kv_tokens = self.num_pages * self.model.page_size
        speculative = self.speculative = config.speculative
        self.draft_model = None
        if speculative is not None and speculative.method == "draft":
            self.draft_model = open_draft(speculative.draft, self.model, self.tokenizer, self.kv_tokens,
                                          config.max_num_seqs * (speculative.num_tokens + self.model.page_size),
                                          verify)
        overlap = config.overlap
        if overlap is None:
            overlap = self.model.manifest.target.device != "cpu" and speculative is None
        self.set_overlap(overlap)

    @property
    def limits(self) -> RequestLimits:
        """What a request must fit on this engine (runtime/limits.py)."""
        return self.engine.limits

    def set_overlap(self, overlap: bool) -> None:
        """A fresh engine, one step ahead of the host (OverlapEngine) or not, between requests."""
        if getattr(self, "engine", None) is not None and self.engine.has_unfinished():
            raise KilnError("the engine can change only when no request is running")
        engine = OverlapEngine if overlap else Engine
        self.engine = engine(self.model, self.num_pages, self.tokenizer.eos_token_ids, self.config,
                             tokenizer=self.tokenizer, speculator=self._speculator())

    def _speculator(self) -> Speculator | None:
        """A fresh proposer for a fresh engine (the draft model's pages are reused)."""
        config = self.speculative
        if config is None:
            return None
        if config.method == "ngram":
            proposer = NgramProposer(config.ngram_min, config.ngram_max)
        else:
            draft, pages, cost = self.draft_model
            proposer = DraftProposer(draft, pages, self.model.vocab_size, cost)
        return Speculator(config, proposer, self.model.max_context, self.model.manifest.target.device)

    def describe_kv(self) -> str:
        mib = self.engine.pool.num_pages * self.model.bytes_per_page / 2**20
        dtypes = "/".join(sorted({spec.dtype for spec in self.model.kv_specs}))
        window = f", pages outside the {self.model.kv_window}-token window dropped" if self.model.kv_window else ""
        return (f"KV cache: {self.engine.pool.num_pages} pages of {self.model.page_size} tokens "
                f"= {self.kv_tokens} tokens fit ({mib:.0f} MiB, {dtypes}, {self.model.bytes_per_token} B/token"
                f"{window}; {self.kv_how})")

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) together; outputs in prompt order. `lora_request`:
        the adapter of every prompt, or one per prompt (None: the base model), as vLLM's."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if not len(plist) == len(loras) == len(prompts):
            raise KilnError(f"{len(prompts)} prompts but {len(plist)} SamplingParams and {len(loras)} LoRA requests")
        reqs = []
        for prompt, sp, lora in zip(prompts, plist, loras):
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
            reqs.append(self.engine.add_request(ids, sp, prompt=text, lora_request=lora))
        bar = None
        if use_tqdm and len(reqs) > 1:
            bar = tqdm(total=len(reqs), desc="Processed prompts", unit="req", dynamic_ncols=True)
        final = self.engine.run_to_completion(lambda out: bar.update(1) if bar and out.finished else None)
        if bar:
            bar.close()
        return [final[r.request_id] for r in reqs]


def open_draft(artifact: str | Path, target: CompiledModel, tokenizer: Tokenizer, tokens: int, headroom: int,
               verify: bool = True) -> tuple[CompiledModel, int, float]:
    """The draft model of speculative decoding: (its runner with KV pages for the target's `tokens`
    and `headroom` more, the page count, one draft step's cost relative to a target step, taken as
    the ratio of their weight bytes: both read all their weights a step)."""
    draft = CompiledModel(artifact, verify=verify)
    if draft.manifest.target.device != target.manifest.target.device:
        raise KilnError(f"the draft model {artifact} runs on {draft.manifest.target.device}, the target on "
                        f"{target.manifest.target.device}: compile both for the same target")
    if Tokenizer(artifact).vocab() != tokenizer.vocab():
        raise KilnError(f"the draft model {artifact} has another tokenizer than the target: its token ids "
                        "would mean other text")
    pages = draft.allocate_kv((tokens + headroom) * draft.bytes_per_token + draft.bytes_per_page)
    cost = draft.manifest.files[WEIGHTS]["bytes"] / max(1, target.manifest.files[WEIGHTS]["bytes"])
    return draft, pages, cost
