"""kiln: a compiler-first LLM inference stack.

    import kiln
    llm = kiln.LLM("artifact/")
    outs = llm.generate(["Hello"], kiln.SamplingParams(temperature=0.8, max_tokens=64))
"""
__version__ = "0.1.0"

_EXPORTS = {"LLM": "kiln.runtime.llm", "SamplingParams": "kiln.runtime.sampler",
            "AsyncEngine": "kiln.runtime.async_engine", "RequestOutput": "kiln.runtime.request",
            "GrammarSpec": "kiln.runtime.grammar", "SpeculativeConfig": "kiln.runtime.speculative",
            "EngineConfig": "kiln.runtime.config", "CompileOptions": "kiln.options",
            "LoRARequest": "kiln.runtime.lora"}


def __getattr__(name):
    # Imported on first use: `import kiln` (the CLI, the compiler) does not load the runtime.
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
