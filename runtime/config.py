"""EngineConfig: how an engine runs an artifact (its KV memory, batch limits, prefix cache, threads,
overlap and speculation), checked once, from `kiln run`/`kiln serve` or kiln.LLM's keywords through
the server and the Ray replicas to the engine and its scheduler."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.errors import KilnError

from .memory import check_kv_memory
from .speculative import SpeculativeConfig


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    kv_memory: str | int | float = "auto"   # bytes, '512MiB', a share of free memory ('0.3') or 'auto' (llm.kv_budget)
    max_num_seqs: int = 64                  # sequences a step runs at most
    max_batched_tokens: int = 2048          # new tokens a step runs at most (prompts are chunked to fit)
    prefix_caching: bool = True
    max_waiting: int = 512                  # requests queued beyond the running ones (more: a 429)
    threads: int | None = None              # CPU threads for the kernels (None: kiln.runtime.threads decides)
    overlap: bool | None = None             # one step ahead of the host (None: on GPUs, where nothing speculates)
    speculative: SpeculativeConfig | str | None = None    # "ngram", "draft:ARTIFACT" or a SpeculativeConfig
    num_speculative_tokens: int = 4         # the most tokens proposed a step (where `speculative` is a name)
    max_cpu_loras: int | None = None        # LoRA adapters kept read in host memory (None: the artifact's slots)

    def __post_init__(self):
        if isinstance(self.kv_memory, str):
            check_kv_memory(self.kv_memory)
        elif not self.kv_memory > 0:
            raise KilnError(f"kv_memory {self.kv_memory} leaves no memory for the KV cache")
        for name in ("max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise KilnError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_waiting < 0 or (self.threads is not None and self.threads < 1):
            raise KilnError(f"max_waiting must be at least 0 and threads at least 1 (got {self.max_waiting}, "
                            f"{self.threads})")
        if isinstance(self.speculative, str):
            object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative,
                                                                          self.num_speculative_tokens))
        elif self.speculative is not None:
            object.__setattr__(self, "num_speculative_tokens", self.speculative.num_tokens)

    def replace(self, **settings) -> EngineConfig:
        """This config with `settings` changed; a name it has no field for is refused."""
        unknown = set(settings) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise KilnError(f"no engine setting named {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **settings)
