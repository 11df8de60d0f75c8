"""`rollgym train` with apply: weights, killed (SIGKILL) while the replicas reload a step: the same command run
again leaves every replica serving the checkpointed step, resumed, under its version.

The replicas are two scripted vLLM backends (their reload takes 3 s, so the kill lands inside it; a real vLLM
cannot be held there on cue) behind the stack's models/chat_completions, which the run starts and the kill
takes with it; the backends, like vLLM servers, outlive the run. The trainer writes full weights
(tests/train/toy_trainers.py: FullWeightsTrainer).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import orjson
import yaml
from safetensors.numpy import save_file

from rollgym.testing import REPO_ROOT, scripted_backend

TOY = "tests.train.toy_trainers"
WEATHER = REPO_ROOT / "resources_servers" / "weather"


def reference(folder: Path) -> Path:
    folder.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": np.zeros((8, 4), dtype=np.float32),
               "model.norm.weight": np.ones((4,), dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


def plan(tmp_path: Path, backends: list[str], base: Path) -> Path:
    data = {
        "base_model": str(base), "output": str(tmp_path / "run"),
        "stack": {"configs": [str(WEATHER / "configs" / "weather.yaml"),
                              str(REPO_ROOT / "models" / "chat_completions" / "configs" / "chat_completions.yaml")],
                  "overrides": [f"policy_model.base_url=[{','.join(backends)}]", "policy_model.model=scripted",
                                "policy_model.return_token_ids=true"]},
        "weights": {"dir": str(tmp_path / "shm")},
        "stages": [{"name": "full", "collect": {"input": str(WEATHER / "data" / "train.jsonl"), "limit": 1,
                                                "repeats": 2},
                    "optimize": {"trainer": f"{TOY}:FullWeightsTrainer", "data": "sft",
                                 "args": {"reference": str(base)}},
                    "apply": "weights"}],
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def train(path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "rollgym.cli", "train", str(path), "--no-progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def calls(url: str, path: str) -> int:
    return sum(entry["path"] == path for entry in httpx.get(f"{url.removesuffix('/v1')}/scripted/requests").json()["requests"])


def test_a_run_killed_during_a_reload_resumes_with_every_replica_on_the_checkpointed_step(tmp_path: Path) -> None:
    base = reference(tmp_path / "base")
    with ExitStack() as stack:
        backends = [stack.enter_context(scripted_backend("--token-info", "--reload-latency-ms", "3000"))
                    for _ in range(2)]
        path = plan(tmp_path, backends, base)
        first = train(path)
        try:
            deadline = time.monotonic() + 240
            while not all(calls(url, "/collective_rpc") for url in backends):  # both are reloading step 1 now
                assert first.poll() is None, first.stdout.read().decode() if first.stdout else ""
                assert time.monotonic() < deadline, "the run never reached the reload"
                time.sleep(0.05)
            os.killpg(first.pid, signal.SIGKILL)  # the run and the servers it started, mid-reload
        finally:
            first.wait(timeout=30)
        time.sleep(3.5)  # the reloads the kill interrupted end; nobody names their version or resumes the engine
        for url in backends:
            root = url.removesuffix("/v1")
            assert httpx.get(f"{root}/is_paused").json() == {"is_paused": True}
            assert httpx.get(f"{root}/weight_info").json() == {"weight_version": "default"}
        second = train(path)
        output = second.communicate(timeout=300)[0].decode()
        assert second.returncode == 0, output
        history = [orjson.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_bytes().splitlines()]
        line = history[-1]
        assert line["model_version"] == "scripted@policy-e001" and line["weights"]["counted"] is True
        assert line["weights"]["replicas"] == 1 and set(line["weights"]["seconds"]) >= {"check", "stage", "reload"}
        for url in backends:
            root = url.removesuffix("/v1")
            assert httpx.get(f"{root}/is_paused").json() == {"is_paused": False}
            assert httpx.get(f"{root}/weight_info").json() == {"weight_version": "scripted@policy-e001"}
            assert calls(url, "/resume") == 1 and calls(url, "/collective_rpc") == 2
        assert not (tmp_path / "shm").exists()  # what the run staged goes when it stops
        (tmp_path / "bad").mkdir()
        bad = plan(tmp_path / "bad", backends, base)
        data = yaml.safe_load(bad.read_text())
        data["stages"][0]["optimize"]["args"]["shapes"] = {"model.norm.weight": [5]}
        bad.write_text(yaml.safe_dump(data))
        refused = train(bad)
        output = refused.communicate(timeout=300)[0].decode()
        assert refused.returncode != 0 and "wrong shapes: model.norm.weight [5] (served: [4])" in output, output
        for url in backends:  # no replica was touched by the refused step
            assert calls(url, "/collective_rpc") == 2
            assert httpx.get(f"{url.removesuffix('/v1')}/weight_info").json() == {"weight_version": "scripted@policy-e001"}

