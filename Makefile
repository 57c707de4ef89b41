# Two entry points, each self-contained on a fresh machine (README quick start).
#   make run   -> virtual environment, install, run the main job on the embedded default
#   make test  -> virtual environment, install with test tools, ruff, pytest
#   make bench -> the speed comparisons against Opacus / dp-accounting / per-record loops
#   make docs  -> the documentation site in site/ (mkdocs build --strict: a broken link fails)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: install install-dev run test bench docs clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# pip runs again only when pyproject.toml, setup.py or a C kernel changed since the last
# install (a stamp file in the virtual env; setup.py compiles the kernels); setuptools'
# "Editable installation" banner (about folders named like the package in the working
# directory: this repository maps them on purpose) is silenced
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

KERNEL_BUILD := pyproject.toml setup.py $(wildcard fedlap_privacy/compute/kernels/*.c)

$(VENV)/.installed: $(KERNEL_BUILD) | $(PY)
	$(PY) -m pip install -q $(TORCH)
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(KERNEL_BUILD) | $(PY)
	$(PY) -m pip install -q $(TORCH)
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e '.[dev,flower,simulation]'
	touch $@ $(VENV)/.installed

run: install
	$(VENV)/bin/fedlap-privacy train --out runs/latest

test: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -n auto --dist loadfile

bench: install-dev
	$(PY) benchmarks/speed/accountant.py
	$(PY) benchmarks/speed/dp_step.py
	$(PY) benchmarks/speed/audit_features.py

# NO_MKDOCS_2_WARNING: mkdocs-material prints a banner about its successor on every build
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info fedlap_privacy/compute/kernels/_kernels*.so
