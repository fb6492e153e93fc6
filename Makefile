# Two commands: `make demo` (decode over a KV cache sharded across processes) and `make test`.
# Each sets up .venv first. Without a GPU it installs the CPU build of torch and the Triton whose
# interpreter runs the kernels on the CPU. With a GPU the venv sees the machine's torch and triton
# (>= 3.6) and installs nothing from the network.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
TRITON_CPU ?= triton==3.9.0
NGPU := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')

ifeq ($(NGPU),0)
VENV_FLAGS :=
INSTALL := $(PY) -m pip install -q $(TORCH_CPU) $(TRITON_CPU) && $(PY) -m pip install -q -e '.[test,bench]'
else
VENV_FLAGS := --system-site-packages
INSTALL := $(PY) -m pip install -q --no-deps --no-build-isolation -e .
endif

$(VENV)/.ready: pyproject.toml
	python3 -m venv $(VENV_FLAGS) $(VENV)
	$(INSTALL)
	touch $@

.PHONY: setup test demo
setup: $(VENV)/.ready

test: $(VENV)/.ready
	$(PY) -m pytest -q tests

demo: $(VENV)/.ready
ifeq ($(NGPU),0)
	TRITON_INTERPRET=1 $(PY) -m torch.distributed.run --standalone --nproc-per-node=2 launch/cp_decode.py --device cpu --context 4096 --batch 2 --steps 4
else
	$(PY) -m torch.distributed.run --standalone --nproc-per-node=$(NGPU) launch/cp_decode.py --context 1048576 --batch 1 --steps 32
endif
