"""kiln: a compiler-first LLM inference stack."""
__version__ = "0.1.0"
