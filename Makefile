# make setup : build .venv (profile auto-detected: gpu if nvidia-smi sees a GPU, else cpu; override PROFILE=cpu|gpu)
# make test  : set up if needed, then run the CPU test suite
# make train : the embedded default RL run (python -m rl.train; ARGS='key=value ...' adds Hydra overrides)
PROFILE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
PY := .venv/bin/python
STAMP := .venv/.profile
# make test runs the suite on this many pytest-xdist workers (the CI machine has 2 cores; 0 = one process). Whole
# files go to a worker (--dist loadfile: a module's fixtures are built once), in collection order
# (--no-loadscope-reorder: tests/conftest.py puts the longest test first).
TEST_WORKERS ?= 2

.PHONY: setup test test-slow test-gpu train bench clean

$(STAMP): requirements/cpu.lock requirements/gpu.txt pyproject.toml scripts/install/setup_env.sh
	bash scripts/install/setup_env.sh $(PROFILE)

setup:
	bash scripts/install/setup_env.sh $(PROFILE)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

train: $(STAMP)
	$(PY) -m rl.train $(ARGS)

clean:
	rm -rf .venv build cache runs outputs
