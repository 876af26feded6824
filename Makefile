# Two commands do everything on a fresh machine:
#   make demo   fine-tunes a small model on the embedded default task
#   make test   lint + the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: venv demo demo-rl demo-agent test test-durations test-slow test-faults test-gpu test-llama-cpp lint format clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/tunesmith demo

demo-rl: venv
	$(VENV)/bin/tunesmith demo rl

demo-agent: venv
	$(VENV)/bin/tunesmith demo agent

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Two pytest workers (TEST_WORKERS), each given whole test files (their module fixtures are
# built once): the CI machine has two cores, and many tests use one. (Keeping the Ray files on
# one worker was measured slower: 18m53s against 17m01s, test_durations.md.)
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# `make test` measured: its wall time, load average and slowest tests written to
# benchmarks/results/test_durations.md (LABEL=before|after|... keeps runs side by side).
LABEL ?= latest
test-durations: venv
	@load="$$(cut -d' ' -f1-3 /proc/loadavg)"; start=$$(date +%s); \
	$(MAKE) --no-print-directory test PYTEST_ARGS="--junitxml=$(CURDIR)/.test-durations.xml"; \
	status=$$?; $(PY) benchmarks/test_durations.py --junit .test-durations.xml \
		--wall $$(( $$(date +%s) - start )) --load-start "$$load" --label $(LABEL); exit $$status

test-slow: venv
	$(PY) -m pytest -q -m slow

# Tests that need CUDA and vllm (the vLLM rollout engine); each skips with the reason without.
test-gpu: venv
	$(PY) -m pytest -q -rs -m gpu

# llama.cpp itself loads our GGUF files (tests/models/test_gguf_llama_cpp.py): installs the
# llama-cpp extra first, which builds llama.cpp from source (measured 17 min on 2 cores; once).
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
test-llama-cpp: venv
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" \
		$(PY) -m pip install --quiet -e ".[llama-cpp]"
	$(PY) -m pytest -q -m llama_cpp tests/models/test_gguf_llama_cpp.py tests/models/test_mixtral_gguf.py

# The whole reliability suite (24 SIGKILL seeds, torchrun cases...), its outcomes recorded in
# benchmarks/results/reliability.json, then RELIABILITY.md regenerated from them.
test-faults: venv
	TUNESMITH_FAULTS_RESULTS=benchmarks/results/reliability.json $(PY) -m pytest -q -m "not slow" \
		tests/faults --ignore=tests/faults/test_reliability_report.py
	$(PY) -m tests.faults.report
	$(PY) -m pytest -q tests/faults/test_reliability_report.py

clean:
	rm -rf $(VENV) build *.egg-info
