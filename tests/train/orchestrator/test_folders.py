"""Step folders: a consumer never sees half a step, and a killed orchestrator resumes without losing or
repeating a batch. The orchestrator runs as a real separate process against a real loopback stack."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import orjson
import pytest

from rollgym.client import ServerAddress
from rollgym.train.orchestrator.sources import load_sources
from rollgym.train.orchestrator.transports.folders import MARKER, Batch, StepFolders
from tests.train.orchestrator.support import medium_rows, scripted_stack, write_rows



@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, ServerAddress]]:
    with scripted_stack("--latency-ms", "20") as registry:
        yield registry


def test_a_consumer_only_sees_complete_steps(tmp_path):
    folders = StepFolders(tmp_path)
    rollouts = [{"rollout_id": f"r{i}", "group_id": f"g{i // 4}", "reward": 1.0, "advantage": 0.0, "pad": "x" * 2000}
                for i in range(400)]
    seen: dict[int, int] = {}
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            for step in folders.published():
                if step not in seen:
                    seen[step] = len(folders.read(step).rollouts)  # raises if half-written

    reader = threading.Thread(target=consume)
    reader.start()
    try:
        for step in range(1, 21):
            folders.publish(Batch(step, rollouts, {"step": step}))
    finally:
        stop.set()
        reader.join()
    assert seen and set(seen.values()) == {400}
    # A kill mid-write leaves a hidden temporary folder, or a folder without its marker: neither is published.
    (tmp_path / ".step_21.tmp").mkdir()
    (tmp_path / "step_22").mkdir()
    (tmp_path / "step_22" / "batch.jsonl").write_text("{}\n")
    assert folders.published() == list(range(1, 21))
    with pytest.raises(FileNotFoundError, match="no READY marker"):
        folders.read(22)
    assert sorted(p.name for p in folders.discard_partial()) == [".step_21.tmp", "step_22"]
    with pytest.raises(FileExistsError):
        folders.publish(Batch(3, rollouts))


def _digest(folder: Path) -> str:
    return hashlib.sha1((folder / "batch.jsonl").read_bytes()).hexdigest()


def test_killed_orchestrator_resumes_without_losing_or_repeating_a_batch(stack, tmp_path):
    """Also: the tasks dispatched but not yet in a batch when a step was published (oversampling keeps
    some in flight) are sent first after the resume, not skipped."""
    config = {"batch_size": 8, "rollouts_per_example": 2, "max_steps": 6, "max_async_level": 1,
              "max_off_policy_steps": 2, "concurrency": 8, "model_servers": [], "oversampling_factor": 2.0,
              "envs": [{"name": "reverse", "input": write_rows(tmp_path / "tasks.jsonl", medium_rows(30)),
                        "agent": "reverse_text_agent"}]}
    (tmp_path / "config.json").write_bytes(orjson.dumps(config))
    (tmp_path / "registry.json").write_bytes(orjson.dumps({n: a.to_json() for n, a in stack.items()}))
    output = tmp_path / "run"
    folders = StepFolders(output / "steps")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "rollgym.cli", "orchestrate", str(tmp_path / "config.json"),
                                 "--registry-file", str(tmp_path / "registry.json"), "--output", str(output),
                                 "--poll-s", "0.02"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    process = start()
    consumed: dict[int, str] = {}
    ids: list[str] = []
    try:
        for step in (1, 2):
            batch = folders.wait(step, timeout_s=60)
            consumed[step] = _digest(folders.path(step))
            ids += [r["rollout_id"] for r in batch.rollouts]
        folders.finish(1, None)  # the trainer is on step 2
        folders.wait(3, timeout_s=60)  # published ahead of the trainer (max_async_level 1)
        time.sleep(0.3)
        before_kill = {step: _digest(folders.path(step)) for step in folders.published()}
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        assert max(before_kill) == 3  # never more than one step ahead of the trainer
        process = start()
        resumed = process.stdout.readline()  # the first thing a resumed run says, before it generates
        assert resumed == b"resuming: steps 1..3 published, 1..1 finished by the trainer\n", resumed
        folders.finish(2, None)
        for step in range(3, 7):
            batch = folders.wait(step, timeout_s=60)
            consumed[step] = _digest(folders.path(step))
            ids += [r["rollout_id"] for r in batch.rollouts]
            folders.finish(step, None)
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0, out.decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert consumed[3] == before_kill[3]  # the step published before the kill was kept, not regenerated
    assert folders.published() == [1, 2, 3, 4, 5, 6]
    assert len(ids) == len(set(ids)) == 48
    history = [orjson.loads(line) for line in (output / "history.jsonl").read_bytes().splitlines()]
    assert [line["step"] for line in history] == [1, 2, 3, 4, 5, 6]
    assert all((folders.path(step) / MARKER).exists() for step in range(1, 7))
    tasks = load_sources([("reverse", tmp_path / "tasks.jsonl", None)], ["responses_create_params.input"], 42)[0]
    pending = folders.meta(3)["state"]["sources"]["reverse"]["pending"]
    assert pending, "nothing was in flight when step 3 was published"
    used_after = {r["group_id"].rsplit("-d", 1)[0] for step in (4, 5, 6) for r in folders.read(step).rollouts}
    assert {tasks["reverse"].tasks[i].group_id for i in pending} <= used_after


def test_orchestrate_command_says_what_is_wrong(stack, tmp_path):
    (tmp_path / "registry.json").write_bytes(orjson.dumps({n: a.to_json() for n, a in stack.items()}))
    (tmp_path / "bad.yaml").write_text("batch_size: 6\nrollouts_per_example: 4\nenvs: [{name: r, input: t.jsonl}]\n")

    def orchestrate(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rollgym.cli", "orchestrate", *args, "--output",
                               str(tmp_path / "run")], capture_output=True, text=True, timeout=60)

    bad = orchestrate(str(tmp_path / "bad.yaml"), "--registry-file", str(tmp_path / "registry.json"))
    assert bad.returncode == 2 and "bad.yaml: key '(top level)': batch_size (6) must be a multiple" in bad.stderr
    missing = orchestrate(str(tmp_path / "bad.yaml"), "--registry-file", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    (tmp_path / "good.yaml").write_text(f"batch_size: 4\nrollouts_per_example: 2\nenvs: [{{name: r, input: "
                                        f"{write_rows(tmp_path / 't.jsonl', medium_rows(2))}, agent: nobody}}]\n")
    unknown = orchestrate(str(tmp_path / "good.yaml"), "--registry-file", str(tmp_path / "registry.json"))
    assert unknown.returncode == 2 and "agent 'nobody' is not in the stack" in unknown.stderr
