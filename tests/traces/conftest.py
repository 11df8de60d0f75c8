from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The embedded model's own tokenizer (SmolLM2's chat template): what `base_model: bundled` re-tokenizes with."""
    pytest.importorskip("transformers", reason="re-tokenizing needs transformers (the trl extra)")
    from rollgym.traces.tokens import load_tokenizer

    try:
        return load_tokenizer("bundled")
    except FileNotFoundError as exc:
        pytest.skip(f"the bundled SmolLM2 weights are not installed: {exc}")


def phoenix_command() -> list[str] | None:
    """`phoenix serve` from the venv `make phoenix` creates (or $ROLLGYM_PHOENIX, the phoenix executable)."""
    import os
    from pathlib import Path

    from rollgym.testing import REPO_ROOT

    found = os.environ.get("ROLLGYM_PHOENIX") or str(Path(REPO_ROOT) / ".venv-phoenix" / "bin" / "phoenix")
    return [found, "serve"] if Path(found).is_file() else None


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Phoenix server (arize-phoenix, SQLite in a temp folder, loopback only) started as its own process;
    yields its URL once its API answers. Skipped when `make phoenix` has not created its venv."""
    import os
    import subprocess
    import time

    import httpx

    command = phoenix_command()
    if command is None:
        pytest.skip("Phoenix is not installed: `make phoenix` creates .venv-phoenix (or set ROLLGYM_PHOENIX)")
    folder = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(folder), "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(port),
           "PHOENIX_GRPC_PORT": str(free_port()), "PHOENIX_TELEMETRY_ENABLED": "false"}
    env.pop("PYTHONPATH", None)
    with (folder / "phoenix.log").open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # ~20 s on idle cores; minutes on a loaded machine
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"Phoenix exited with {process.returncode}: {(folder / 'phoenix.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/v1/projects", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"Phoenix did not answer in 300 s: {(folder / 'phoenix.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
