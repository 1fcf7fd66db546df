# Two commands for a new user: `make run` (whole DAG on the embedded default) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
SNAKEMAKE := $(VENV)/bin/snakemake
CONFIG ?= config/config.yaml
PYTHON ?= python3
# pinned test requirements installed without their own dependencies (the file says why)
NODEPS := envs/requirements-nodeps.txt

.PHONY: install run test test-fast lint clean wheelhouse

install: $(VENV)/.installed

# torch is pinned to the CPU build; on a GPU node, install the matching CUDA build of torch into
# the venv first and this step keeps it (pip only installs what is missing or different).
$(VENV)/.installed: envs/requirements.txt $(NODEPS) pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r envs/requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r $(NODEPS)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

run: install
	$(SNAKEMAKE) --cores all --configfile $(CONFIG)

lint: install
	$(VENV)/bin/ruff check src scripts tests benchmarks
	$(VENV)/bin/ruff format --check src scripts tests benchmarks
	$(SNAKEMAKE) --lint --configfile $(CONFIG)

# The suite on TEST_WORKERS processes (pytest-xdist): each test module stays on one worker, so its
# module fixtures (a DAG run, a SLURM cluster) run once, and the modules with the most `slow` tests start
# first (tests/conftest.py). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint
	$(PYTEST) --durations=25

# The edit-test loop: everything but the `slow` tests (real DAGs, torchrun, SLURM).
test-fast: install
	$(PYTEST) -m "not slow"

clean:
	rm -rf results .snakemake

# Offline install (air-gapped nodes): every pinned requirement and flashdraft itself as wheels in
# $(WHEELHOUSE), for the target's platform tags (every tag its wheels may carry) and Python (default:
# this machine's), e.g.
#   make wheelhouse PLATFORM="manylinux_2_28_x86_64 manylinux2014_x86_64" PYVER=3.11 \
#     TORCH_INDEX=https://download.pytorch.org/whl/cu128
# then on the node: pip install --no-index --find-links wheelhouse -r envs/requirements.txt flashdraft,
# and pip install --no-index --find-links wheelhouse --no-deps -r envs/requirements-nodeps.txt
WHEELHOUSE ?= wheelhouse
PLATFORM ?=
PYVER ?=
TORCH_INDEX ?=
# Published as sources only (pure Python): built into wheels here, then found by the download.
SDIST_ONLY := connection_pool==0.0.3
TARGET := $(foreach p,$(PLATFORM),--platform $(p)) $(if $(PYVER),--python-version $(PYVER)) \
	--only-binary=:all: $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

wheelhouse: install
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps -w $(WHEELHOUSE) $(SDIST_ONLY) . -r $(NODEPS)
	$(PY) -m pip download -q --disable-pip-version-check -d $(WHEELHOUSE) --find-links $(WHEELHOUSE) \
		$(TARGET) -r envs/requirements.txt
