# The two commands README promises: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV   ?= .venv
PIP    := $(VENV)/bin/pip

.PHONY: demo test check venv lint clean

# Deploy to a local lab host and show the probe report.
demo: venv
	bash scripts/demo.sh

# Every test: unit, real SGLang code on CPU, lab hosts (root), GPU tests skip without CUDA.
test: venv
	bash scripts/test.sh

# The fast loop while you work: lint plus the tests that start no process (docs/testing.md).
check: venv
	bash scripts/check.sh

lint: venv
	$(VENV)/bin/ruff check .

venv: $(VENV)/.installed $(VENV)/.sglang-installed $(VENV)/.sglang-lab-base-installed $(VENV)/.sglang-cpu-lab-installed \
      $(VENV)/.sglang-gpu-lab-installed $(VENV)/router/.installed

# torch==2.13.0 first: it is the CPU wheel on disk; an unpinned torch would pull GBs of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[ops,dev]'
	touch $@

# --- sglang test environment (issue 4, sglang plugin): the pinned SGLang's real code for tests/sglang,
# without its CUDA dependency tree (docs/sglang-pin.md). The requirements file pins torch==2.13.0 so pip
# cannot swap in a CUDA torch.
$(VENV)/.sglang-installed: $(VENV)/.installed requirements/sglang-test.txt
	$(PIP) install -q -r requirements/sglang-test.txt
	$(PIP) install -q --no-deps sglang==0.5.23
	touch $@
# --- end sglang test environment

# --- the lab layers' base (issue 42): the machinery both lab layers below run on (boot, seams, fault
# switch, stand-in, the real-server harness), a distribution of its own; inert by itself.
LAB_BASE := scripts/lab/sglang-lab-base
$(VENV)/.sglang-lab-base-installed: $(VENV)/.sglang-installed $(LAB_BASE)/pyproject.toml \
    $(wildcard $(LAB_BASE)/ddtree_sglang_lab_base/*.py)
	rm -rf $(VENV)/.lab-base-build && cp -r $(LAB_BASE) $(VENV)/.lab-base-build
	$(PIP) install -q --no-deps --no-build-isolation $(VENV)/.lab-base-build && rm -rf $(VENV)/.lab-base-build
	touch $@
# --- end lab layers' base

# --- the real SGLang server on CPU (issue 16): the lab-only compatibility layer and what the server
# imports beyond the set above. It stays inert in this venv unless DDTREE_SGLANG_CPU_LAB=1.
CPU_LAB := scripts/lab/sglang-cpu-lab
$(VENV)/.sglang-cpu-lab-installed: $(VENV)/.sglang-lab-base-installed $(CPU_LAB)/requirements.txt $(CPU_LAB)/pyproject.toml \
    $(CPU_LAB)/setup.py $(wildcard $(CPU_LAB)/ddtree_sglang_cpu_lab/*.py)
	$(PIP) install -q -r $(CPU_LAB)/requirements.txt
	rm -rf $(VENV)/.cpu-lab-build && cp -r $(CPU_LAB) $(VENV)/.cpu-lab-build
	$(PIP) install -q --no-deps --no-build-isolation $(VENV)/.cpu-lab-build && rm -rf $(VENV)/.cpu-lab-build
	touch $@
# --- end real SGLang server on CPU

# --- the GPU lab's layer (issue 20): its seams and stand-ins are tested here on CPU against the installed
# wheel; it stays inert in this venv unless DDTREE_SGLANG_GPU_LAB=1 (docs/sglang-gpu-lab.md).
GPU_LAB := scripts/lab/sglang-gpu-lab
$(VENV)/.sglang-gpu-lab-installed: $(VENV)/.sglang-cpu-lab-installed $(GPU_LAB)/pyproject.toml $(GPU_LAB)/setup.py $(wildcard $(GPU_LAB)/ddtree_sglang_gpu_lab/*.py)
	rm -rf $(VENV)/.gpu-lab-build && cp -r $(GPU_LAB) $(VENV)/.gpu-lab-build
	$(PIP) install -q --no-deps --no-build-isolation $(VENV)/.gpu-lab-build && rm -rf $(VENV)/.gpu-lab-build
	touch $@
# --- end GPU lab layer

# --- the router (issue 26): sglang-router in a venv of its own, as roles/sglang_router installs it (beside
# SGLang its launcher imports sglang's tracing, which fails on this CPU set); unit tests run it on loopback.
ROUTER_PIN := $(shell grep -oE '^sglang_router_version: "[0-9.]+"' roles/sglang_router/defaults/main.yml | grep -oE '[0-9.]+')
$(VENV)/router/.installed: roles/sglang_router/defaults/main.yml
	$(PYTHON) -m venv $(VENV)/router
	$(VENV)/router/bin/pip install -q --upgrade pip
	$(VENV)/router/bin/pip install -q sglang-router==$(ROUTER_PIN)
	touch $@
# --- end router

clean:
	rm -rf $(VENV) build dist *.egg-info
