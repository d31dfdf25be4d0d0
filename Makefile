# kiln: `make demo` and `make test` set everything up from nothing (a .venv here) and run.
PY_SYS ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MODEL  ?=
DEMO   := build/demo
PROMPT ?= The quick brown fox

.PHONY: demo test test-fast setup clean rocm-deps metal-deps flashinfer-deps

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "kiln: installing TVM, the CPU build of torch, transformers, Ray and the test tools into $(VENV)" \
	      "(a minute or two on a fresh machine; versions from constraints.txt)"
	# torch pinned to the local CPU build; transformers/torch are for import and tests only.
	$(PY) -m pip install -q -c constraints.txt "apache-tvm==0.27.0.post1" "apache-tvm-ffi==0.1.14.post1" "torch==2.13.0" \
	    "transformers>=5" "safetensors>=0.4" "tokenizers>=0.19" "numpy>=1.26" "ml_dtypes>=0.4" \
	    "jinja2>=3.1" "click>=8.1" "tqdm>=4.66" "fastapi>=0.110" "uvicorn>=0.29" "prometheus-client>=0.20" \
	    "httpx>=0.27" "pytest>=8" "pytest-xdist>=3.5" "filelock>=3.12" "hypothesis>=6.100" "openai>=1.40" \
	    "schemathesis>=3.30" "setuptools>=68" "sentencepiece>=0.2" "protobuf>=4" "blake3>=1.0" \
	    "nvidia-cuda-nvdisasm>=13" "nvidia-cuda-cuobjdump>=13" "langchain-openai>=1.0" "litellm>=1.70" "ray[serve]==2.60.0" \
	    "gguf==0.19.0" "accelerate>=1.0" "peft==0.21.2" "onnx==1.23.2" "onnxruntime==1.32.0" "onnxruntime-genai==0.18.0" \
	    "onnxscript==0.7.2" "onnx-ir==1.1.0"
	# onnx-ir: onnxruntime-genai's model builder imports it without declaring it (tests make ONNX files with it)
	# xgrammar (structured output) without its declared triton: kiln masks logits with NumPy;
	# nvidia-cutlass for its headers alone (sm_90 linears compile CUTLASS's Hopper GEMMs), not its Python tools
	$(PY) -m pip install -q -c constraints.txt --no-deps "xgrammar==0.2.8" "nvidia-cutlass==4.2.0.0"
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

setup: $(VENV)/.installed

demo: setup
ifeq ($(MODEL),)
	$(PY) -m kiln.testing.tiny $(DEMO)/model --family llama
	$(VENV)/bin/kiln compile $(DEMO)/model --target cpu -o $(DEMO)/artifact --force
else
	$(VENV)/bin/kiln compile $(MODEL) --target cpu -o $(DEMO)/artifact --force
endif
	$(VENV)/bin/kiln inspect $(DEMO)/artifact
	$(VENV)/bin/kiln run $(DEMO)/artifact --prompt "$(PROMPT)" --max-tokens 64

# Every core runs tests (pytest-xdist); artifacts are built once per run and shared through
# build/test-cache (tests/artifact_cache.py); the 25 slowest steps are listed at the end.
test: setup
	$(PY) -m pytest -q -n auto --dist loadfile --durations=25 tests

# The inner loop: the pure-Python and interpreter tests, no TVM build (the tests marked `build` left out).
test-fast: setup
	$(PY) -m pytest -q -n auto --no-build tests

# Optional build tools for `--target rocm` / `--target metal` (Debian packages, ~30 MB download, root);
# without them those targets fail with the missing tool's name and their tests skip.
rocm-deps:
	apt-get update -qq && apt-get install -y --no-install-recommends lld-22 rocm-device-libs

metal-deps:
	apt-get update -qq && apt-get install -y --no-install-recommends lld-22

# Optional compile-time extra for `kiln compile --target cuda --attention flashinfer`: FlashInfer's JIT
# (its sources; nvcc builds them) without the CUDA packages it declares, which kiln's build does not use.
# Without it that option fails with the release it needs and its tests skip.
flashinfer-deps: setup
	$(PY) -m pip install -q -c constraints.txt --no-deps "flashinfer-python==0.6.6" "nvidia-ml-py==13.615.71" \
	    "einops==0.8.2" "tabulate==0.10.0" "ninja==1.13.2"

clean:
	rm -rf build $(VENV)
