"""kiln.testing: what the tests, the benchmarks and `make demo` build and drive kiln with; nothing in
the product imports it (tests/test_layering.py checks).

  tiny.py          small random-weight Hugging Face models and a locally trained tokenizer
  cluster_load.py  loads for a kiln cluster (streamed with disconnects, shared prefixes), outcomes counted
  cluster_ops.py   deploying, inspecting and killing the replicas of a kiln application on Ray Serve
"""
