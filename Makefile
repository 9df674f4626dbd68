# Two commands set everything up (see README): `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs there.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU wheel of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Said before the long quiet pip run: what it installs and how big (the sizes of the default
# torch's CPU wheel, and of a .venv with the test tools, triton's 1 GB the largest of them).
ifeq ($(origin TORCH_SPEC),file)
TORCH_SIZE := (the CPU wheel: about 190 MB to download, 750 MB installed)
endif

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml setup.py fsdp_replay/agent/fingerprint/_fpcore.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "installing into $(VENV): $(strip $(TORCH_SPEC) $(TORCH_SIZE)), numpy, and fsdp-replay with its test tools; about 3 GB in all, a few quiet minutes"
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

# Record the example FSDP2 job (2 CPU ranks, gloo) into runs/demo, summarize the trace, and
# replay rank 1 alone from the step-5 snapshot.
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/fsdp-replay record --out runs/demo --snapshot-every 5 -- \
		$(BIN)/torchrun --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 10
	$(BIN)/fsdp-replay inspect runs/demo
	$(BIN)/fsdp-replay replay runs/demo --rank 1 --from-step 5

# As root, the eBPF tests need bcc, kernel headers and a real libnccl: scripts/install-ebpf.sh
# installs them (once; a stamp remembers). Elsewhere those tests skip and say why.
EBPF_STAMP := $(VENV)/.ebpf-installed
$(EBPF_STAMP): $(STAMP) scripts/install-ebpf.sh
	@if [ "$$(id -u)" = 0 ]; then scripts/install-ebpf.sh $(VENV) && touch $@; \
	else echo "not root: the eBPF tests will skip"; fi

lint: $(STAMP)
	$(BIN)/ruff check fsdp_replay tests examples bench helm/fsdp-replay/files
	$(BIN)/ruff format --check fsdp_replay tests examples bench helm/fsdp-replay/files
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# As root, a real Docker engine runs for the image tests (scripts/install-docker.sh starts it and
# stops the one it started); the docker marker is decided when pytest collects, so it starts first.
test: lint $(EBPF_STAMP)
	@if [ "$$(id -u)" = 0 ]; then scripts/install-prometheus.sh >/dev/null && scripts/install-docker.sh start; \
	else echo "not root: the Docker and Prometheus tests will skip"; fi
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ "$$(id -u)" = 0 ]; then scripts/install-docker.sh stop; fi; exit $$rc

# The fast tier: everything but the multi-process runs (the `slow` marker); about a minute.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_record.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
