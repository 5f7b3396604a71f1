# Install, demo, test and benchmark targets (the README's quick start uses `make demo` and `make test`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0

export PATH := $(abspath $(BIN)):$(PATH)
export PREFECT_HOME ?= $(abspath .prefect)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true
export DVC_NO_ANALYTICS := 1
export SACREBLEU ?= $(abspath .sacrebleu)

.PHONY: install test test-quick demo run bench bench-decode clean-venv

install: $(VENV)/.installed

# torch first with an exact pin (a loose requirement pulls a multi-GB CUDA build), then the stack with uv
# (the same pins as `pip install -c constraints.txt -e ".[dev,hf,s3]"` in ~10 s instead of ~3 minutes on 2 cores).
# uv reads no pip.conf: where only pip's configured index is reachable, pip installs the stack instead.
UV_VERSION := 0.13.9
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q "uv==$(UV_VERSION)" && $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode \
		-c constraints.txt -e ".[dev,hf,s3]" || $(BIN)/pip install -q -c constraints.txt -e ".[dev,hf,s3]"
	touch $@

# Two pytest-xdist workers (TEST_WORKERS=0: one process). Each file's tests run on one worker, so a module's
# fixtures are built once; the files holding slow tests are handed out first (tests/conftest.py).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test: install
	$(PYTEST) tests

# The everyday loop: every test not marked slow (the slow ones build pipelines, run torchrun or serve models).
test-quick: install
	$(PYTEST) -m "not slow" tests

# The main job: the whole DAG on the demo profile through the Prefect flow (temporary Prefect server,
# MLflow in ./.mlflow, no servers to start). It switches the workspace to the demo profile as `nmt profile demo`
# does (params.yaml written from profiles/demo.yaml; `nmt profile tiny` and `dvc repro` switch back from the run cache).
# Two torch threads, fixed rather than one per core: CPU results depend on the thread count, so every machine
# trains the same model (on the same kind of CPU). On a 2-core machine that is busy with other work, two threads
# can run several times slower than one: there, `NMT_THREADS=1 OMP_NUM_THREADS=1 make demo` (other figures).
demo: install
	NMT_THREADS=$${NMT_THREADS:-2} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(BIN)/python -m flows.pipeline --profile demo

# The whole DAG on the current params.yaml through the Prefect flow (`nmt run` = python -m flows.pipeline).
run: install
	$(BIN)/nmt run

bench: install
	$(BIN)/python benchmarks/train.py

# The whole `nmt translate --engine ctranslate2` process vs a plain CTranslate2 script, on a float32 export of
# the demo model (after `make demo`) and the Multi30k test set of the data mirror (benchmarks/decode.py --data).
bench-decode: install
	$(BIN)/nmt export --format ctranslate2 --model runs/demo/model/averaged.pt --output runs/demo/ct2-float32
	$(BIN)/python benchmarks/decode.py process --export runs/demo/ct2-float32

clean-venv:
	rm -rf $(VENV)
