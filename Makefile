# `make demo` runs the whole default workflow; `make test` runs the tests.
# Both create the venv and install the pinned environment first.
#   DEVICE=cpu|cuda   which lock to install (requirements-$(DEVICE).lock); cpu by default
#   TORCH_INDEX=URL   where PyTorch's CPU build comes from (DEVICE=cpu), unless pip's
#                     own sources (a wheel folder) already hold it
#   WHEELHOUSE=DIR    DEVICE=cuda from a wheelhouse, offline, beside the packages of
#                     $(PYTHON)'s environment (a GPU node's torch): `make wheelhouse`
#                     made it where the index is reachable (docs/install.md)
DEVICE ?= cpu
VENV ?= $(if $(filter cuda,$(DEVICE)),.venv-cuda,.venv)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
BIN := $(abspath $(VENV))/bin
PYTHON ?= python3
# The venv's pip, put in before the lock: the one Python 3.11's venv brings (23.2) took
# about 100 CPU-s to resolve the CUDA lock (`make lock-cuda`; 4.3 GB of wheels read),
# pip 26.3 38 CPU-s for the same set (2 cores, AMD EPYC, 2026-12-06).
PIP_VERSION ?= 26.3
CORES ?= 2
WHEELHOUSE ?=
NODE ?= node.json
export PATH := $(BIN):$(PATH)
export TORCH_INDEX

.PHONY: install demo test lint lock lock-cuda wheelhouse clean

install: $(VENV)/.installed-$(DEVICE)

# The generated envs/$(DEVICE).post-deploy.sh installs the lock (Snakemake's conda
# deployment runs the same script). draftflow itself goes in as an editable install
# of the checkout: vLLM servers import its connector, and `draftflow` is a command.
$(VENV)/.installed-$(DEVICE): envs/$(DEVICE).post-deploy.sh pyproject.toml
ifeq ($(WHEELHOUSE),)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q pip==$(PIP_VERSION)
	bash envs/$(DEVICE).post-deploy.sh
else
	$(PYTHON) -m draftflow.wheelhouse venv $(VENV)
	$(BIN)/python -m pip install -q --no-index --no-deps $(WHEELHOUSE)/*.whl
endif
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation --editable .
	touch $@

demo: install
	$(BIN)/snakemake --cores $(CORES)

lint: install
	$(BIN)/snakemake --lint
	$(BIN)/snakefmt --check Snakefile rules

test: lint
	$(BIN)/pytest -n $(CORES)

# The CPU lock is frozen from the CPU venv (torchvision's CPU build, where the venv has
# it, is installed beside torch instead); the CUDA lock is resolved by pip
# (Python 3.11 and 3.12, default index); both regenerate the install scripts.
lock:
	$(BIN)/pip freeze --all --exclude-editable --exclude pip --exclude torchvision > requirements-cpu.lock
	$(BIN)/python -m draftflow.locks scripts

lock-cuda:
	$(BIN)/python -m draftflow.locks cuda

# The wheels a GPU node without an index lacks, for the node NODE describes
# (`python3 -m draftflow.wheelhouse describe > node.json` there), into wheelhouse/.
wheelhouse: install
	$(BIN)/python -m draftflow.wheelhouse make --node $(NODE) --out wheelhouse

# Keeps each run's answer stores and hidden states (hours of GPU work on a real
# target) unless ALL=1, and says so.
clean:
	$(PYTHON) -m draftflow.run_folder $(if $(filter 1,$(ALL)),--all)
