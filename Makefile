# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OUTPUT ?= results/demo
TEXT ?=

.PHONY: setup test demo clean

setup: $(VENV)/.installed

# A container that already has torch (the NGC image) keeps it and its Triton: the venv then
# sees the system packages and only the missing requirements are installed. Elsewhere the
# pinned torch is installed (the CPU build on a machine without a GPU).
$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-torch.txt
	@set -e; \
	if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "setup: keeping the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	  if $(PYTHON) -c "import triton" >/dev/null 2>&1; then \
	    grep -v '^triton' requirements.txt > $(VENV)/requirements-kept-torch.txt; \
	  else cp requirements.txt $(VENV)/requirements-kept-torch.txt; fi; \
	  $(PY) -m pip install -q -r $(VENV)/requirements-kept-torch.txt -r requirements-dev.txt; \
	else \
	  $(PYTHON) -m venv $(VENV); \
	  $(PY) -m pip install -q -r requirements-torch.txt; \
	  $(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt; \
	fi; \
	touch $@

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
