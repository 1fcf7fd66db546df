# Two commands for a new user: `make run` (whole DAG on the embedded default) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
SNAKEMAKE := $(VENV)/bin/snakemake
CONFIG ?= config/config.yaml
PYTHON ?= python3

.PHONY: install run test lint clean

install: $(VENV)/.installed

# torch is pinned to the CPU build; on a GPU node, install the matching CUDA build of torch into
# the venv first and this step keeps it (pip only installs what is missing or different).
$(VENV)/.installed: envs/requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r envs/requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

run: install
	$(SNAKEMAKE) --cores all --configfile $(CONFIG)
	@echo "Report: $(CURDIR)/results/report.html"

lint: install
	$(VENV)/bin/ruff check src scripts tests benchmarks
	$(SNAKEMAKE) --lint --configfile $(CONFIG)

test: lint
	$(VENV)/bin/pytest -q -ra

clean:
	rm -rf results .snakemake
