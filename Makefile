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
# The test files that talk HTTP(S) or the Hub. `make test` runs them once more next to
# each huggingface_hub release of HF_RELEASES (the main venv holds the newest), so that a
# release the package does not work with fails CI, not a user: 0.36.2 is what pip
# resolves next to transformers 4.x (huggingface_hub<1.0, requests-based), 1.33.0 a
# recent 1.x (httpx-based).
REMOTE_TESTS := tests/test_http_client.py tests/test_transport_hub.py tests/test_hub.py \
	tests/test_hub_publish.py tests/test_stream_hub.py tests/test_dataset_hub.py \
	tests/test_urls.py tests/test_http_versions.py tests/test_stream_parts.py \
	tests/test_stream_sources.py tests/test_remote_hostile_transfers.py \
	tests/test_stream_arriving.py::test_from_the_hub_with_its_listed_hashes \
	tests/test_remote_hostile_cache.py::test_a_hostile_hub_listing_is_refused \
	tests/test_layers.py::test_hub_lists_and_reads_without_torch \
	tests/test_remote_backends.py tests/test_groups_pyg.py
HF_RELEASES ?= 0.36.2 1.33.0
# Each release gets a venv under HF_VENVS holding only that release and the packages it
# needs in other versions than the main venv has; a .pth file adds the main venv's
# site-packages after its own (torch and the rest are shared). ~3 s each from pip's cache.
HF_VENVS := build/hf
# Extra pins per release: the 0.x venv also tests the lowest httpx pyproject.toml allows.
HF_PINS_0.36.2 := httpx==0.28.1
HF_STAMPS := $(HF_RELEASES:%=$(HF_VENVS)/%/.installed)

.PHONY: venv azurite demo test test-hf-releases lint fuzz soak bench bench-quick clean

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
	$(PY) -m pip install -q -e ".[test,examples,bench,docs]"
	touch $(STAMP)

# The venv of one huggingface_hub release ($* is the version); pip installs into it only
# what the main venv lacks or holds in another version, and the check proves the release
# and the pins are the ones imported.
$(HF_VENVS)/%/.installed: $(STAMP)
	rm -rf $(HF_VENVS)/$*
	$(PY) -m venv --without-pip $(HF_VENVS)/$*
	$(HF_VENVS)/$*/bin/python -c "import sys, sysconfig; \
	    open(sysconfig.get_path('purelib') + '/main-venv.pth', 'w').write( \
	        'import site; site.addsitedir(%r)\n' % sys.argv[1])" \
	    "$$($(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))")"
	$(PY) -m pip --python $(HF_VENVS)/$*/bin/python install -q "huggingface_hub==$*" \
	    $(HF_PINS_$*)
	$(HF_VENVS)/$*/bin/python -c "import sys, huggingface_hub, httpx; \
	    from importlib.metadata import version; \
	    pins = dict(p.split('==') for p in sys.argv[1:]); \
	    found = {'huggingface_hub': huggingface_hub.__version__, 'httpx': httpx.__version__}; \
	    assert all(found.get(k, version(k)) == v for k, v in pins.items()), (pins, found); \
	    print('huggingface_hub', found['huggingface_hub'], 'httpx', found['httpx'])" \
	    "huggingface_hub==$*" $(HF_PINS_$*)
	touch $@

demo: $(STAMP)
	$(PY) examples/schnet_md17.py --out runs/demo

test:
	@$(PREREQUISITES)
	$(PY) -m ruff check pyg_atompack tests examples benchmarks notebooks docs
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --durations=25
	@$(MAKE) --no-print-directory test-hf-releases

# REMOTE_TESTS next to each release of HF_RELEASES, one release after another.
test-hf-releases: $(HF_STAMPS)
	@for release in $(HF_RELEASES); do \
	    echo "== the remote tests with huggingface_hub $$release"; \
	    $(HF_VENVS)/$$release/bin/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile \
	        $(REMOTE_TESTS) || exit 1; \
	done

# The documentation site (mkdocs.yml) into build/site, strictly: a warning fails. `make test`
# builds it too and checks its links (tests/test_docs_site.py). After `make test` the
# tutorials show the outputs of the notebooks it executed (docs/hooks.py). The variable
# silences Material's notice about its end of life, printed on every build.
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d build/site
	@echo "open build/site/index.html, or: $(PY) -m http.server -d build/site"

# A long fuzzing run of the .atp reader and the .pt shard loader (~10 min).
fuzz: $(STAMP)
	PYG_ATOMPACK_FUZZ_EXAMPLES=20000 $(PY) -m pytest -q tests/test_fuzz_atp.py tests/test_fuzz_pt.py \
	    tests/test_groups_fuzz.py

# Streaming soak test against the fault-injecting loopback server (not in CI).
soak: $(STAMP)
	$(PY) benchmarks/soak.py

# The headline table of README.md and docs/benchmarks.md, reprinted from quick runs of
# the scripts behind it (about 12 minutes on the 2-core VM; not part of `make test`).
bench-quick: $(STAMP)
	$(PY) benchmarks/headline.py --quick

# Every benchmark, one after another; each writes benchmarks/results/<name>.md.
bench: $(STAMP)
	$(PY) benchmarks/bench_atp.py --quick
	$(PY) benchmarks/framed_crc.py
	$(PY) benchmarks/atom_budget.py
	$(PY) benchmarks/groups_loader.py
	$(PY) benchmarks/carry_groups.py
	$(PY) benchmarks/bench_elastic.py
	$(PY) benchmarks/neighbours.py
	$(PY) benchmarks/autotune.py
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
