"""A real vLLM server as a subprocess, for tests and scripts that must check what vLLM itself answers.

    with real_vllm("/path/to/hf-folder", "--chat-template", "t.jinja") as server:
        server.url     # http://127.0.0.1:PORT/v1 (server.root without /v1)
        server.model   # the served model name

vLLM runs from a venv of its own (`make vllm`: `.venv-vllm`, the CPU build, which pins its own torch and
transformers), on a free loopback port, with the runtime LoRA routes and the development routes
(`/collective_rpc`, `/pause`, `/update_weight_version`, ...) on. Its output goes to a log file, which
the error says when it does not start and `VllmServer.log_tail` returns. On two busy cores it is ready
in about 100 s; its first generation compiles for another ~16 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from ..processes import die_with_parent
from . import REPO_ROOT, free_port

# Where `make vllm` builds vLLM's venv.
VLLM_VENV = REPO_ROOT / ".venv-vllm"
# How rollgym's tests serve: fp32 (the trainer's precision, so logprobs compare), a context that holds a
# rollout, LoRA hot-loading, and the logprobs of the distribution sampled from (temperature applied).
DEFAULT_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--enable-lora", "--max-lora-rank", "16",
                "--logprobs-mode", "processed_logprobs")
# 1 GiB of KV cache is plenty for a small model; the development routes; runtime LoRA (un)loading.
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM: its root URL, the served model's name, its process id and its log file."""

    root: str
    model: str
    pid: int
    log_path: Path

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL (what `base_url` of models/chat_completions takes)."""
        return f"{self.root}/v1"

    def log_tail(self, lines: int = 60) -> str:
        return _tail(self.log_path, lines)


def vllm_python(venv: str | os.PathLike[str] | None = None) -> Path:
    return Path(venv or VLLM_VENV) / "bin" / "python"


def missing_reason(venv: str | os.PathLike[str] | None = None) -> str | None:
    """Why no real vLLM can be started from `venv` (None: it can)."""
    python = vllm_python(venv)
    if not python.exists():
        return f"no vLLM venv at {python.parent.parent} (make vllm builds it)"
    if not any((python.parent.parent / "lib").glob("python*/site-packages/vllm/__init__.py")):
        return f"{python.parent.parent} has no vllm package (make vllm builds it)"
    return None


@contextmanager
def real_vllm(model_dir: str | os.PathLike[str], *args: str, served_model_name: str | None = None,
              venv: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
              log_path: str | os.PathLike[str] | None = None, startup_timeout_s: float = 900.0,
              default_args: tuple[str, ...] = DEFAULT_ARGS) -> Iterator[VllmServer]:
    """Start vLLM's OpenAI-compatible server on `model_dir` (a Hugging Face folder) on a free port and yield
    a `VllmServer` once `/health` answers; stop it (and its engine process) on exit.

    `args` are more command-line options (`--chat-template FILE`, `--tool-call-parser hermes`, ...) after
    `default_args`; `env` more environment (over DEFAULT_ENV). The served name is `served_model_name`, else
    the folder's name. RuntimeError, with the log's tail, when it exits or is not ready in `startup_timeout_s`.
    """
    reason = missing_reason(venv)
    if reason is not None:
        raise RuntimeError(reason)
    model_dir = Path(model_dir).resolve()
    name = served_model_name or model_dir.name
    port = free_port()
    if log_path is None:
        handle, log_name = tempfile.mkstemp(prefix=f"rollgym-vllm-{port}-", suffix=".log")
        os.close(handle)
        log_path = log_name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [str(vllm_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), *default_args, *args]
    # vLLM's own venv decides what it imports: this process's path (rollgym's checkout) stays out.
    child_env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    child_env.update(DEFAULT_ENV)
    child_env.update(env or {})
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        # Its own process group, so that stopping it stops the engine process it starts too.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=child_env, cwd=str(model_dir.parent), start_new_session=True,
                                   preexec_fn=die_with_parent)
    root = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, root, log_path, startup_timeout_s)
        yield VllmServer(root=root, model=name, pid=process.pid, log_path=log_path)
    finally:
        _stop(process)


def _wait_healthy(process: subprocess.Popen, root: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {process.returncode} before it was ready; its log "
                               f"({log_path}) ends:\n{_tail(log_path, 40)}")
        try:
            with urllib.request.urlopen(f"{root}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM was not ready after {timeout_s:g} s; its log ({log_path}) ends:\n"
                               f"{_tail(log_path, 40)}")
        time.sleep(1.0)


def _stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to its process group (vLLM shuts its engine down), SIGKILL after `grace_s`."""
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break  # the whole group is gone
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The server exited; an engine process it left behind in its group goes with SIGKILL.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    process.wait()


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


__all__ = ["DEFAULT_ARGS", "DEFAULT_ENV", "VLLM_VENV", "VllmServer", "missing_reason", "real_vllm", "vllm_python"]
