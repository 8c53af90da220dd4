# Quick start: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned so that pip does not pull a multi-GB
# CUDA build where a CPU wheel is at hand. Override e.g. TORCH_SPEC="torch".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Azurite (the Azure Storage emulator, Node.js) for the az:// tests, from the npm
# registry at the versions tests/servers/azurite/package-lock.json pins; ~2 min and
# ~360 MB the first time, seconds from npm's cache.
AZURITE_DIR := build/azurite
AZURITE_STAMP := $(AZURITE_DIR)/.installed
AZURITE_PINS := tests/servers/azurite/package.json tests/servers/azurite/package-lock.json
NPM_CI := npm ci --prefix $(AZURITE_DIR) --no-audit --no-fund --loglevel=error
# Test files run in this many pytest-xdist processes (whole files per process, so
# module fixtures are built once); most tests wait on subprocesses and servers.
TEST_PROCESSES ?= 3

.PHONY: venv azurite demo test lint fuzz soak bench clean

# The Python environment and Azurite install side by side: both mostly wait on
# registries, so a fresh `make test` pays for the longer of the two, not their sum.
PREREQUISITES := $(MAKE) --no-print-directory -j2 $(STAMP) $(AZURITE_STAMP)

venv:
	@$(PREREQUISITES)

azurite: $(AZURITE_STAMP)

# one retry after a pause: a registry hiccup should not fail a CI run
$(AZURITE_STAMP): $(AZURITE_PINS)
	mkdir -p $(AZURITE_DIR)
	cp $(AZURITE_PINS) $(AZURITE_DIR)/
	$(NPM_CI) || (sleep 10 && $(NPM_CI))
	touch $(AZURITE_STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,examples,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/schnet_md17.py --out runs/demo

test:
	@$(PREREQUISITES)
	$(PY) -m ruff check pyg_atompack tests examples benchmarks notebooks docs
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile

# A long fuzzing run of the .atp reader and the .pt shard loader (~10 min).
fuzz: $(STAMP)
	PYG_ATOMPACK_FUZZ_EXAMPLES=20000 $(PY) -m pytest -q tests/test_fuzz_atp.py tests/test_fuzz_pt.py

# Streaming soak test against the fault-injecting loopback server (not in CI).
soak: $(STAMP)
	$(PY) benchmarks/soak.py

# Every benchmark, one after another; each writes benchmarks/results/<name>.md.
bench: $(STAMP)
	$(PY) benchmarks/bench_atp.py --quick
	$(PY) benchmarks/offcpu.py
	$(PY) benchmarks/bench_dataset.py
	$(PY) benchmarks/bench_convert.py
	$(PY) benchmarks/bench_graph.py
	$(PY) benchmarks/stream_overlap.py
	$(PY) benchmarks/stream_memory.py
	$(PY) benchmarks/paired_schnet.py
	$(PY) benchmarks/peers.py

lint: $(STAMP)
	$(PY) -m ruff check pyg_atompack tests examples benchmarks notebooks docs

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
