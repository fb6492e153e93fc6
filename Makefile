# Two commands: `make demo` (decode over a KV cache sharded across processes) and `make test`.
# Without a GPU: a .venv with torch and the Triton whose interpreter runs the kernels on the CPU (TORCH_INDEX,
# e.g. https://download.pytorch.org/whl/cpu, is the index torch comes from: its CPU build; by default pip's
# own sources, where plain PyPI gives the CUDA build, which runs on a CPU too). With a GPU: the Python that already has torch and triton (>= 3.6) on the PATH (a virtualenv's or conda
# env's python3 included) runs from the checkout with PYTHONPATH=.; nothing is installed from the network.
VENV ?= .venv
TORCH_CPU ?= torch==2.13.0
TRITON_CPU ?= triton==3.9.0
TORCH_INDEX ?=
NGPU := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')

ifeq ($(NGPU),0)
PY := $(VENV)/bin/python
RUN := $(PY)
READY := $(VENV)/.ready
$(VENV)/.ready: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_CPU)
	$(PY) -m pip install -q $(TRITON_CPU) -e '.[test,bench]'
	touch $@
else
PY := $(shell for p in python3 python; do $$p -c 'import torch, triton' >/dev/null 2>&1 && command -v $$p && break; done)
RUN := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY)
READY := gpu-env
# The GPU suite compiles a few hundred kernel variants: with pytest-xdist there, 8 workers share that work
# (the spawned multi-GPU tests rendezvous through their own temporary files, so they run beside the rest).
PYTEST_ARGS := $(shell $(PY) -c 'import xdist' >/dev/null 2>&1 && echo '-n 8')
.PHONY: gpu-env
gpu-env:
	@test -n "$(PY)" || { echo "make: no python3 on the PATH imports torch and triton (activate the environment that has them)"; exit 1; }
	@echo "GPU machine: using $(PY) (torch $$($(PY) -c 'import torch; print(torch.__version__)'), triton $$($(PY) -c 'import triton; print(triton.__version__)'))"
endif

.PHONY: setup test demo
setup: $(READY)

test: $(READY)
	$(RUN) -m pytest -q $(PYTEST_ARGS) tests

demo: $(READY)
ifeq ($(NGPU),0)
	TRITON_INTERPRET=1 $(RUN) -m torch.distributed.run --standalone --nproc-per-node=2 launch/cp_decode.py --device cpu --context 4096 --batch 2 --steps 4
else
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 $(RUN) -m torch.distributed.run --standalone --nproc-per-node=$(NGPU) launch/cp_decode.py --context 1048576 --batch 1 --steps 32
endif
