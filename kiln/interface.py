"""Contracts between what kiln compiles and what its runtime calls, in a leaf both import (so neither
imports the other): the compiled sampler's functions, by the name the runtime looks each up with."""
from __future__ import annotations

# what the runtime asks for -> the function codegen/sampling.py compiles into the artifact
SAMPLER_FUNCTIONS = {"penalties": "apply_penalties", "greedy": "sample_greedy", "plain": "sample_plain",
                     "sorted": "sample_sorted", "logprobs": "token_logprobs"}
MAX_LOGPROBS = 20       # the most alternatives SamplingParams.logprobs may ask for (the compiled top-k's k)
