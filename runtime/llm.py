"""The offline facade: open an artifact, then generate text for prompts."""
from __future__ import annotations

from pathlib import Path

from .engine import Engine, Request
from .model import CompiledModel, parse_bytes
from .sampler import SamplingParams
from .tokenizer import Tokenizer

AUTO_KV_CAP = {"cpu": 2 << 30, "cuda": 16 << 30}   # "auto" never takes more than this


class LLM:
    def __init__(self, artifact_dir: str | Path, kv_memory: str | int = "auto", max_num_seqs: int = 64,
                 max_batched_tokens: int = 2048, verify: bool = True):
        self.model = CompiledModel(artifact_dir, verify=verify)
        self.tokenizer = Tokenizer(artifact_dir)
        wanted = max_num_seqs * self.model.max_context * self.model.bytes_per_page // self.model.page_size
        budget = (min(wanted, AUTO_KV_CAP[self.model.manifest["target"]["device"]])
                  if kv_memory == "auto" else parse_bytes(kv_memory) if isinstance(kv_memory, str) else kv_memory)
        num_pages = self.model.allocate_kv(budget)
        self.kv_tokens = num_pages * self.model.page_size
        self.engine = Engine(self.model, num_pages, self.tokenizer.eos_token_ids, max_num_seqs, max_batched_tokens)

    def describe_kv(self) -> str:
        mib = self.engine.pool.num_pages * self.model.bytes_per_page / 2**20
        return (f"KV cache: {self.engine.pool.num_pages} pages of {self.model.page_size} tokens "
                f"= {self.kv_tokens} tokens ({mib:.0f} MiB)")

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None,
                 on_token=None) -> list[Request]:
        params = params or SamplingParams()
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        return self.engine.generate(ids, params, on_token)


