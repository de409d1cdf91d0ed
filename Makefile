# The two commands README promises: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV   ?= .venv
PIP    := $(VENV)/bin/pip

.PHONY: demo test venv lint clean

# Deploy to a local lab host and show the probe report.
demo: venv
	bash scripts/demo.sh

# Every test: unit, real SGLang code on CPU, lab hosts (root), GPU tests skip without CUDA.
test: venv
	bash scripts/test.sh

lint: venv
	$(VENV)/bin/ruff check .

venv: $(VENV)/.installed

# torch==2.13.0 first: it is the CPU wheel on disk; an unpinned torch would pull GBs of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[ops,dev]'
	touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info
