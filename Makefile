# The README's two commands: `make demo` and `make test`.  Both create the
# virtual environment on first use.  torch==2.13.0 is installed first and on
# its own so that pip takes the CPU build instead of pulling a CUDA one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv docs device-check demo test test-extended test-all stress equivalence conformance conformance-gloo-gates conformance-full bench bench-multinode bench-algorithms bench-ddp bench-workloads lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/commd demo

# The suite starts about a thousand interpreters (ranks, daemons, docs examples): compiled once here,
# they do not each compile commd again where PYTHONDONTWRITEBYTECODE keeps imports from writing .pyc files.
BYTECODE := $(PY) -m compileall -q -j 0 commd tests benchmarks > /dev/null

test: venv
	$(BYTECODE)
	$(PY) -m pytest -q -m "not slow and not extended"

# The rest of the tests CI runs (longer model-based and end-to-end ones; make test stays under 15 min).
test-extended: venv
	$(BYTECODE)
	$(PY) -m pytest -q -m "extended and not slow"

test-all: venv
	$(BYTECODE)
	$(PY) -m pytest -q

# Many seeded random programs on 3 simulated hosts x 2 ranks (tests/test_stress.py).
STRESS_PROGRAMS ?= 200
stress: venv
	STRESS_PROGRAMS=$(STRESS_PROGRAMS) STRESS_LENGTH=$${STRESS_LENGTH:-40} \
		$(PY) -m pytest -q -s tests/test_stress.py

# One op model on every path: random schedules of ops and faults against a model of the contract,
# on 1 node (2 and 3 ranks, staged tensors too) and 2, exchange rings on and off
# (tests/test_path_equivalence.py; make test-extended runs 150 on one node, ring on and off, and on the schedule path).
EQUIVALENCE_SCHEDULES ?= 5000
equivalence: venv
	EQUIVALENCE_ALL=1 EQUIVALENCE_SCHEDULES=$(EQUIVALENCE_SCHEDULES) $(PY) -m pytest -q -s tests/test_path_equivalence.py

# commd.ft under randomized fault injection: per seed, 4 ranks train 8 guarded steps while 1 or 2 of them are
# SIGKILLed at random points (forward, backward, after the commit, after the optimizer step, or during the
# survivors' recovery); every run must end recovered or failed loudly on every survivor within a bound,
# never hung (tests/test_ft_random.py; COMMD_FT_SEED_BASE shifts the seeds, COMMD_FT_RANDOM_LOG collects outcomes).
FT_SEEDS ?= 20
test-ft-random: venv
	$(BYTECODE)
	COMMD_FT_SEEDS=$(FT_SEEDS) $(PY) -m pytest tests/test_ft_random.py -m slow -q

# PyTorch's DistributedTest on commd (tests/conformance/run_distributed_suite.py).
# --gates gloo: the suite is imported as for Gloo, so every test Gloo may run runs, on commd.
conformance: venv
	$(PY) tests/conformance/run_distributed_suite.py --backend commd --gates gloo --subset fast \
		--compare tests/conformance/gloo_baseline.json

conformance-gloo-gates: venv
	$(PY) tests/conformance/run_distributed_suite.py --backend commd --gates gloo --subset full \
		--compare tests/conformance/gloo_baseline.json

# The suite's own gates: what PyTorch asks of a plugin backend named commd.
conformance-full: venv
	$(PY) tests/conformance/run_distributed_suite.py --backend commd --subset full \
		--compare tests/conformance/gloo_baseline.json

bench: venv
	$(PY) benchmarks/allreduce.py

bench-multinode: venv
	$(PY) benchmarks/multinode.py

# Library programs vs the tcp lane's native algorithms vs MPI on 4 simulated hosts (root; benchmarks/algorithms.py).
bench-algorithms: venv
	$(PY) benchmarks/algorithms.py

# DDP training step time and all-reduce bandwidth: commd vs Gloo vs MPI (benchmarks/ddp.py).
bench-ddp: venv
	$(PY) benchmarks/ddp.py

# commd.ft: a random rank SIGKILLed at a random point of a guarded DDP step (time to the error, to the
# survivors' first step), and the guard's failure-free overhead (benchmarks/ft.py, docs/fault-tolerance.md).
bench-ft: venv
	$(PY) benchmarks/ft.py

# MoE, DLRM and Megatron steps on 2x2 and 4x1 simulated hosts, three link settings: commd's mix against
# each lane, Gloo and MPI, and the replay of each recorded trace (root; benchmarks/workloads/compare.py).
bench-workloads: venv
	$(PY) benchmarks/workloads/compare.py --tables $${COMMD_TABLES:-out/tables} --tune --json out/workloads.json

# The GPU machine's check (benchmarks/device_check.py, docs/device-check.md): the GPU tests, CUDA IPC
# through the daemon, the GPU codecs, commd vs NCCL and Gloo on CUDA tensors, the multi-host benchmarks;
# within 540 s, one JSON of figures in out/device-check.json.  DEVICE_PY=python3 runs it with an
# interpreter that already has torch with CUDA and commd's dependencies (no venv is built then);
# DEVICE_CHECK_ARGS="--parts gpu-tests,cuda-ipc --quick" picks parts.
DEVICE_CHECK_ARGS ?=
device-check: $(if $(DEVICE_PY),,venv)
	$(or $(DEVICE_PY),$(PY)) benchmarks/device_check.py $(DEVICE_CHECK_ARGS)

# The documentation site (docs/, mkdocs.yml), built offline and strictly: a broken link fails it.
# The reference pages (docs/reference/) are generated from the code first.
docs: venv
	$(PY) docs/gen_reference.py && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: venv
	$(VENV)/bin/ruff check commd tests benchmarks

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache *.egg-info
