"""Test support: run a server in-process on a real loopback port, for tests of any server folder.

    with serve_in_thread(WeatherServer()) as url:
        ...  # real HTTP to url

Each server runs its own uvicorn and event loop in a daemon thread, so a test can start several
servers that call each other over real HTTP without spawning processes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import uvicorn

from ..server import BaseServer


@contextmanager
def serve_in_thread(server: BaseServer, *, port: int = 0, timeout_s: float = 20.0) -> Iterator[str]:
    """Serve `server` on 127.0.0.1 in a background thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # Keep-alive as `rollgym run` serves (stack/serve.py): longer than a client's, so a client never sends on a
    # connection the server is closing (uvicorn's 5 s equals httpx's pool expiry: a ReadError under load).
    config = uvicorn.Config(server.build_app(), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=2, timeout_keep_alive=75)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} did not start")
        time.sleep(0.01)
    try:
        yield url
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def final_response(text: str, items: list[dict] | None = None) -> dict:
    """A minimal Responses API response for `/verify`: `items` (tool calls and outputs, if any),
    then an assistant message saying `text`."""
    message = {"type": "message", "id": "msg_final", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}
    return {"id": "resp_final", "object": "response", "created_at": 0, "model": "test", "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "output": [*(items or []), message]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The checkout this package is installed from in editable mode (`pip install -e .`), where the tests run.
REPO_ROOT = Path(__file__).resolve().parents[3]
# The command that runs the scripted backend (options after it: --port, --port-file, --token-info, ...).
SCRIPTED_BACKEND_COMMAND = (sys.executable, "-m", "rollgym.testing.scripted_vllm")


@contextmanager
def scripted_backend(*flags: str, timeout_s: float = 30.0) -> Iterator[str]:
    """Run the scripted backend (rollgym.testing.scripted_vllm, a stand-in for vLLM) as a subprocess; yields its
    /v1 base URL. `flags` are its command-line options (`--token-info`, `--latency-ms 40`, ...)."""
    with tempfile.TemporaryDirectory(prefix="rollgym-backend-") as tmp:
        port_file = Path(tmp) / "port"
        process = subprocess.Popen(
            [*SCRIPTED_BACKEND_COMMAND, "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file), *flags],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not port_file.exists() or not port_file.read_text().strip():
                if process.poll() is not None:
                    raise RuntimeError(f"scripted backend exited with code {process.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError("scripted backend did not start")
                time.sleep(0.02)
            yield f"http://127.0.0.1:{int(port_file.read_text())}/v1"
        finally:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
