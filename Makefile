# Two commands on a fresh machine: `make test` and `make bench`; both build .venv when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned torch is installed first; pyproject's range then installs nothing more.
# On a GPU machine: make setup TORCH_SPEC='torch==2.13.0' picks the CUDA wheel from the index.
TORCH_SPEC ?= torch==2.13.0

GPUS ?= 1
ARCH ?=
MODEL ?=
SIZES ?=
STRATEGIES ?=
PRECISION ?=
SCALING ?=
LR_RULE ?=
STEPS ?=
WARMUP ?=
BATCH ?=
SEQ_LEN ?=
OUT ?=
PROFILE ?=
CELL ?=
BASE ?=
CAND ?=
ARGS ?=
# make mutate: mutmut's parallel children (the machine is shared; each child is one pytest process).
MUTATE_JOBS ?= 2

bench_args = --gpus $(GPUS) $(if $(ARCH),--arch $(ARCH)) $(if $(MODEL),--model $(MODEL)) \
	$(if $(SIZES),--sizes $(SIZES)) $(if $(STRATEGIES),--strategies $(STRATEGIES)) \
	$(if $(PRECISION),--precision $(PRECISION)) $(if $(SCALING),--scaling $(SCALING)) \
	$(if $(LR_RULE),--lr-rule $(LR_RULE)) $(if $(STEPS),--steps $(STEPS)) \
	$(if $(WARMUP),--warmup $(WARMUP)) $(if $(BATCH),--batch $(BATCH)) $(if $(SEQ_LEN),--seq-len $(SEQ_LEN)) \
	$(if $(OUT),--out $(OUT)) $(if $(filter 1 yes on true,$(PROFILE)),--profile) $(ARGS)

.PHONY: setup setup-nsys setup-slurm lint test test-slow test-slow-par test-timing test-nsys test-slurm test-all bench plan trace compare gate report bench-ci workloads mutate clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,fp8]"
	@command -v $${CXX:-c++} >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 || \
		echo "note: no C++ compiler (c++, g++, clang++ or \$$CXX) on PATH: torch.compile's inductor needs one on CPU, so --compile on will be refused; apt install g++"
	touch $@

setup: $(BIN)/.installed

# ruff (style, imports, no function-level imports but for heavy/optional dependencies),
# import-linter (the one-way layers and no cycles; contracts in pyproject.toml) and mypy (types;
# [tool.mypy] in pyproject.toml: every module checked, the typed packages strict).
lint: setup
	$(BIN)/ruff check harness workloads tests scripts
	$(BIN)/lint-imports
	$(BIN)/mypy

# Test tiers (README "Tests"): `make test` is the fast tier, `make test-slow` the rest (statistical
# benchmarks, faults, long end-to-end runs, world size 4), `make test-all` both, as CI runs them.
# A tier that selects no test fails (pytest exit 5), never passes quietly.
# Tests without a timing verdict run on TEST_JOBS pytest-xdist workers (a test file stays on one worker,
# so a module's shared sweep runs once); the `timing` tests run alone after them, one at a time.
PYTEST = $(BIN)/python -m pytest -q -p no:cacheprovider
TEST_JOBS ?= 2
PARALLEL = -n $(TEST_JOBS) --dist loadfile
test: setup
	$(PYTEST) $(PARALLEL) -m "not slow and not nsys and not slurm" tests

test-slow: test-slow-par test-timing

test-slow-par: setup
	$(PYTEST) $(PARALLEL) -m "slow and not timing and not nsys and not slurm" tests

test-timing: setup
	$(PYTEST) -m "slow and timing and not nsys and not slurm" tests

# The nsys tier: a real Nsight Systems capture (make setup-nsys first); skips with "n/a: no nsys".
test-nsys: setup
	$(PYTEST) -m nsys -rs tests

setup-nsys:
	bash scripts/setup_nsys.sh

# The slurm tier: sbatch jobs on a private Slurm (munged, slurmctld, two slurmd) that the tier
# starts on this host (make setup-slurm first; root); skips with "n/a: no slurm".
test-slurm: setup
	$(PYTEST) -m slurm -rs tests

setup-slurm:
	bash scripts/setup_slurm.sh

test-all: test test-slow test-nsys test-slurm

bench: setup
	$(BIN)/harness bench $(bench_args)

plan: setup
	$(BIN)/harness plan $(bench_args)

trace: setup
	$(BIN)/harness trace --gpus $(GPUS) $(if $(CELL),--cell $(CELL)) $(if $(OUT),--out $(OUT)) $(ARGS)

report: setup
	$(BIN)/harness report $(OUT)

compare: setup
	$(BIN)/harness compare $(BASE) $(CAND) $(ARGS)

# The CI gate as an A/B on this machine: BASE (a git ref, default the previous commit) checked out
# in a worktree, its CI cells and this checkout's run in turn (ABBA), judged per round.
gate: setup
	$(BIN)/harness gate --base $(or $(BASE),HEAD~1) $(ARGS)

bench-ci: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/bench/test_ci_cells.py --benchmark-only \
		--benchmark-json=$(or $(OUT),results/bench-ci.json)

workloads: setup
	$(BIN)/harness workloads

# Mutation testing of the pure core with the unit tests (docs/mutation.md); not part of CI.
# mutmut comes from the `mutate` extra, installed on first use; mutants/ is its git-ignored work copy,
# started afresh so the score is of this checkout's tests.
mutate: setup
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install --quiet -e ".[dev,mutate]"
	rm -rf mutants
	$(BIN)/mutmut run --max-children $(MUTATE_JOBS)
	$(BIN)/mutmut results
	$(BIN)/python scripts/mutation_score.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .benchmarks mutants
