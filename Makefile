# `make demo` runs the whole default workflow; `make test` runs the tests.
# Both create .venv and install the pinned environment first.
VENV := .venv
BIN := $(VENV)/bin
PYTHON ?= python3
CORES ?= 2
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install demo test lint lock clean

install: $(VENV)/.installed

# --no-deps: the lock is complete, and it leaves out the CUDA builds of
# torchvision/torchaudio that speculators declares (they break transformers
# beside the CPU torch). torch==2.13.0 comes from this machine's disk.
# draftflow itself is put on the path with a .pth file (vLLM servers import its connector).
$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-deps -r requirements.lock
	$(BIN)/python -c "import site; open(site.getsitepackages()[0] + '/draftflow.pth', 'w').write('$(CURDIR)\n')"
	touch $@

demo: install
	$(BIN)/snakemake --cores $(CORES)

lint: install
	$(BIN)/snakemake --lint
	$(BIN)/snakefmt --check Snakefile rules

test: lint
	$(BIN)/pytest

lock:
	$(BIN)/pip freeze --exclude-editable > requirements.lock

clean:
	rm -rf results logs benchmarks .snakemake
