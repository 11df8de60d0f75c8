"""Fixtures for every test folder (tests/, models/, agents/, resources_servers/): a real vLLM server.

`vllm_server` is one vLLM (rollgym.testing.real_vllm) for the whole run, serving the bundled SmolLM2-135M
in fp32 (`vllm_model_dir`, converted once into .cache/vllm/) with the tool-aware template of
models/chat_completions/templates/smollm2_tools.jinja and vLLM's hermes tool-call parser. A test that uses
it is marked `vllm` (select them with `pytest -m vllm`), is skipped with the reason when `make vllm` has
not built `.venv-vllm`, and shows the end of the server's log when it fails. Tests that change what the
server serves (a LoRA, weights) put it back as they found it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

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
    """Every test that uses the real vLLM is marked `vllm`, so `-m vllm` (or `-m "not vllm"`) selects it.

    In one process they run last: the session's one server then starts after every other test and is up only
    while it is used. Spread over processes (`make test`: pytest-xdist, `--dist loadfile`), the units of work
    (`work_unit`) go out in this order: the vLLM files first, then the files that hold slow tests, so that
    the longest units do not come last."""
    uses_vllm = {id(item) for item in items if any(name in getattr(item, "fixturenames", ()) for name in VLLM_FIXTURES)}
    for item in items:
        if id(item) in uses_vllm:
            item.add_marker(pytest.mark.vllm)
    if not hasattr(config, "workerinput"):  # one process (xdist's workers have workerinput)
        items.sort(key=lambda item: id(item) in uses_vllm)  # stable: each group keeps its order
        return
    units = {id(item): work_unit(item.nodeid) for item in items}
    slow_units = {units[id(item)] for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (units[id(item)] != "vllm", units[id(item)] not in slow_units))


def work_unit(nodeid: str) -> str:
    """What goes to one test process whole: a test file (its module fixtures start once); every file whose
    tests use the session's vLLM (one server); the example agents' folder, whose conftest.py starts one
    embedded model for all of them; the tests that start a local Ray cluster."""
    path = nodeid.split("::", 1)[0]
    if _uses_vllm(path):
        return "vllm"
    if path.startswith("agents/proxy_agent/examples/"):
        return "agents/proxy_agent/examples"
    if "ray" in Path(path).stem.split("_"):
        return "ray"
    return path


@functools.cache
def _uses_vllm(path: str) -> bool:
    try:
        return any(name in (REPO_ROOT / path).read_text(errors="replace") for name in VLLM_FIXTURES)
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` with `work_unit` as the unit. (xdist's own `loadgroup` marks do not group on
    pytest 9.2, whose node ids xdist can no longer rename: pytest-xdist issue 1386.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


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
    from rollgym.testing.real_vllm import missing_reason, vllm_python

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    if not any((vllm_python().parent.parent / "lib").glob("python*/site-packages/rollgym_vllm_cpu_reload.py")):
        pytest.skip("the vLLM venv has no rollgym-vllm-cpu-reload plugin (models/chat_completions/vllm_cpu_plugin; "
                    "make vllm installs it): without it a full-weight reload leaves vLLM's lm_head on the old weights")
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
