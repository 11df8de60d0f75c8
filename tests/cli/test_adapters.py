"""`rollgym adapters load|unload|list` against a running stack's registry file (real HTTP, subprocess CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.adapters import content_digest
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread


def rollgym(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollgym.cli", "adapters", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_load_list_unload_through_the_registry(tmp_path: Path) -> None:
    adapter = tmp_path / "step-1"
    adapter.mkdir()
    with scripted_backend("--token-info") as backend:
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted"), name="policy_model")
        with serve_in_thread(model) as url:
            registry = tmp_path / "stack.json"
            registry.write_text(json.dumps({"policy_model": {"url": url, "role": "models"}}))
            where = ("--registry-file", str(registry))

            loaded = rollgym("load", "step-1", str(adapter), *where)
            assert loaded.returncode == 0, loaded.stderr
            step_1 = f"step-1@{content_digest(str(adapter))}"  # the version names the files
            assert f"added successfully. now serving {step_1}" in loaded.stdout
            listed = rollgym("list", *where, "--json")
            assert listed.returncode == 0, listed.stderr
            models = json.loads(listed.stdout)["answer"]["data"]
            assert [(m["id"], m["model_version"]) for m in models] == [("scripted", "scripted"), ("step-1", step_1)]
            unloaded = rollgym("unload", "step-1", *where)
            assert unloaded.returncode == 0 and "now serving scripted" in unloaded.stdout

            again = rollgym("unload", "step-1", *where)
            assert again.returncode == 1 and "cannot be found" in again.stdout and "1 of 1" in again.stderr
            missing = rollgym("load", "x", str(tmp_path / "nowhere"), *where)
            assert missing.returncode == 1 and "[404]" in missing.stdout
            other = rollgym("list", *where, "--model-server", "nope")
            assert other.returncode == 2 and "no server named 'nope'" in other.stderr
    no_registry = rollgym("list", "--registry-file", str(tmp_path / "absent.json"))
    assert no_registry.returncode == 2 and "no such file" in no_registry.stderr and "Traceback" not in no_registry.stderr
