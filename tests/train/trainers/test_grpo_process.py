"""The long-lived trainer process under torchrun: between steps no rank waits in a collective (a collection
can outlast the process group's timeout, which would kill the group and the model it loaded), each
rank reads the step's request itself, and a request written just before a stop is still taken by all."""

from __future__ import annotations

import threading
import time

import orjson
import pytest

pytest.importorskip("torch")

from rollgym.train.trainers import grpo_process  # noqa: E402


def test_no_rank_waits_in_a_collective_for_the_next_request(tmp_path, monkeypatch) -> None:
    import torch.distributed as dist

    from rollgym.train.trainers.grpo_trainer import DistInfo

    def collective(*_args, **_kwargs):
        raise AssertionError("a collective while waiting for the next request")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(DistInfo, "init", lambda self: None)
    monkeypatch.setattr(grpo_process, "die_with_parent", lambda signum: None)
    monkeypatch.setattr(dist, "broadcast_object_list", collective)
    monkeypatch.setattr(dist, "barrier", collective)
    (tmp_path / "requests").mkdir()
    request = {"dataset": str(tmp_path / "none.jsonl"),
               "config": {"base_model": "bundled", "output_dir": str(tmp_path / "step"), "version": "v1",
                          "args": {"learning_rat": 1.0}}}  # fails at once, after the request was read

    def submit_later() -> None:
        time.sleep(0.3)  # rank 1 is already waiting: as the collection runs
        (tmp_path / "requests" / "000000.json").write_bytes(orjson.dumps(request))

    writer = threading.Thread(target=submit_later)
    writer.start()
    assert grpo_process.serve(tmp_path) == 1  # a failed step ends a distributed process
    writer.join()
    assert not (tmp_path / "step" / "failed.json").exists()  # rank 0 reports failures, not rank 1


def test_a_request_written_before_the_stop_is_taken(tmp_path) -> None:
    (tmp_path / "requests").mkdir()
    (tmp_path / "stop").touch()
    assert grpo_process._next_request(tmp_path, 0) is None
    (tmp_path / "requests" / "000000.json").write_bytes(orjson.dumps({"n": 0}))
    assert grpo_process._next_request(tmp_path, 0) == {"n": 0}
