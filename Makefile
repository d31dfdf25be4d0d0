# kiln: `make demo` and `make test` set everything up from nothing (a .venv here) and run.
PY_SYS ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MODEL  ?=
DEMO   := build/demo
PROMPT ?= The quick brown fox

.PHONY: demo test setup clean rocm-deps metal-deps

$(VENV)/.installed: pyproject.toml
	$(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned to the local CPU build; transformers/torch are for import and tests only.
	$(PY) -m pip install -q "apache-tvm==0.27.0.post1" "apache-tvm-ffi==0.1.14.post1" "torch==2.13.0" \
	    "transformers>=4.45" "safetensors>=0.4" "tokenizers>=0.19" "numpy>=1.26" "ml_dtypes>=0.4" \
	    "jinja2>=3.1" "click>=8.1" "tqdm>=4.66" "fastapi>=0.110" "uvicorn>=0.29" "prometheus-client>=0.20" \
	    "httpx>=0.27" "pytest>=8" "hypothesis>=6.100" "openai>=1.40" "schemathesis>=3.30" "setuptools>=68" \
	    "sentencepiece>=0.2" "protobuf>=4" "blake3>=1.0"
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

setup: $(VENV)/.installed

demo: setup
ifeq ($(MODEL),)
	$(PY) -m kiln.tiny $(DEMO)/model --family llama
	$(VENV)/bin/kiln compile $(DEMO)/model --target cpu -o $(DEMO)/artifact --force
else
	$(VENV)/bin/kiln compile $(MODEL) --target cpu -o $(DEMO)/artifact --force
endif
	$(VENV)/bin/kiln inspect $(DEMO)/artifact
	$(VENV)/bin/kiln run $(DEMO)/artifact --prompt "$(PROMPT)" --max-tokens 64

test: setup
	$(PY) -m pytest -q tests

# Optional build tools for `--target rocm` / `--target metal` (Debian packages, ~30 MB download, root);
# without them those targets fail with the missing tool's name and their tests skip.
rocm-deps:
	apt-get update -qq && apt-get install -y --no-install-recommends lld-22 rocm-device-libs

metal-deps:
	apt-get update -qq && apt-get install -y --no-install-recommends lld-22

clean:
	rm -rf build $(VENV)
