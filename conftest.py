"""Fixtures for every test folder (tests/, models/, agents/, resources_servers/): a real vLLM server.

`vllm_server` is one vLLM (rollgym.testing.real_vllm) for the whole run, serving the bundled SmolLM2-135M
in fp32 (`vllm_model_dir`, converted once into .cache/vllm/) with the tool-aware template of
models/chat_completions/templates/smollm2_tools.jinja and vLLM's hermes tool-call parser. A test that uses
it is marked `vllm` (select them with `pytest -m vllm`), is skipped with the reason when `make vllm` has
not built `.venv-vllm`, and shows the end of the server's log when it fails. Tests that change what the
server serves (a LoRA, weights) put it back as they found it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:  # imported where used: a run that uses no vLLM needs none of rollgym's web stack here
    from rollgym.testing.real_vllm import VllmServer

REPO_ROOT = Path(__file__).resolve().parent
VLLM_MODEL_DIR = REPO_ROOT / ".cache" / "vllm" / "smollm2-135m"
TOOLS_TEMPLATE = REPO_ROOT / "models" / "chat_completions" / "templates" / "smollm2_tools.jinja"
# The served model's name (what a request's `model` says for the base weights).
VLLM_MODEL_NAME = "smollm2-135m"
VLLM_FIXTURES = ("vllm_server",)
_LOG_KEY = pytest.StashKey[Path]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses the real vLLM is marked `vllm`, so `-m vllm` (or `-m "not vllm"`) selects it, and
    runs last: the session's one server then starts after every other test and is up only while it is used."""
    uses_vllm = {id(item) for item in items if any(name in getattr(item, "fixturenames", ()) for name in VLLM_FIXTURES)}
    for item in items:
        if id(item) in uses_vllm:
            item.add_marker(pytest.mark.vllm)
    items.sort(key=lambda item: id(item) in uses_vllm)  # stable: each group keeps its order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A failing real-vLLM test's report ends with the server's log (its start too, when that failed)."""
    report = yield
    log_path = item.config.stash.get(_LOG_KEY, None)
    if report.failed and log_path is not None and any(name in getattr(item, "fixturenames", ())
                                                      for name in VLLM_FIXTURES):
        try:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-60:])
        except OSError as exc:
            tail = f"(unreadable: {exc})"
        report.sections.append((f"vLLM server log ({log_path}), its end", tail))
    return report


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    """The bundled model as vLLM serves it (fp32 safetensors, config, tokenizer), written once."""
    from rollgym.testing.real_vllm import missing_reason

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        from rollgym.train.trainers.servable import servable_base
    except ImportError as exc:  # torch or transformers: the [trl] extra
        pytest.skip(f"converting the bundled model needs the trainer's packages: {exc}")
    return servable_base("bundled", VLLM_MODEL_DIR)


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                pytestconfig: pytest.Config) -> Iterator["VllmServer"]:
    """One real vLLM for the run, on a free port, stopped at its end."""
    from rollgym.testing.real_vllm import real_vllm

    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    pytestconfig.stash[_LOG_KEY] = log_path
    with real_vllm(vllm_model_dir, "--chat-template", str(TOOLS_TEMPLATE), "--enable-auto-tool-choice",
                   "--tool-call-parser", "hermes", served_model_name=VLLM_MODEL_NAME, log_path=log_path) as server:
        yield server
