"""Two nodes of two processes, as a cluster runs them: two torchrun launches (node ranks 0 and 1) meeting at a
c10d rendezvous on loopback, gloo, full weights sharded within each node and replicated across (HSDP, a 2-D
device mesh), the model read by rank 0 alone and broadcast shard by shard. The step's loss, gradients and
updated weights are the one-process step's on the same batch; a trainer resumed from the sharded checkpoint
takes exactly the next step of the one that went on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import rollgym  # noqa: E402
from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_process import launch_command  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer  # noqa: E402

from .hsdp_worker import SETTINGS, batch, recording_gradients, weights  # noqa: E402

WORKER = Path(__file__).with_name("hsdp_worker.py")
TOLERANCE = 1e-5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def test_two_nodes_of_two_processes_take_the_one_process_step_and_resume_exactly(tiny_model, tmp_path) -> None:
    args = GRPOConfig(**SETTINGS, processes=2, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                      rdzv_id="test-nodes")
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(Path(rollgym.__file__).parents[1]), env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    launches = []
    for node in (0, 1):  # what a user runs on each node: the trainer's own command, its node rank changed
        command = launch_command(args, tmp_path, node_rank=node)
        assert "--standalone" not in command and f"--node-rank={node}" in command
        command = command[:command.index("-m", 3)] + [str(WORKER), tiny_model, str(tmp_path)]
        launches.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for launch in launches:
        output, _ = launch.communicate(timeout=180)
        assert launch.returncode == 0, output.decode()[-3000:]
    nodes = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert nodes["layout"] == {"world": 4, "nodes": 2, "mesh": (2, 2), "mesh_dims": ("replicate", "shard"),
                               "placements": ["Replicate", "Shard"]}
    # Only rank 0 read the model (the others built it on the meta device and received their shards), and
    # every process holds the weights and buffers on disk.
    assert nodes["loaded"] == {"loads": [[tiny_model], [], [], []], "weights": True, "buffers": True}

    single = PolicyTrainer(GRPOConfig(**SETTINGS), tiny_model, seed=1)
    single.load(None)
    before = weights(single)
    grads = recording_gradients(single)
    metrics = single.train_batch(batch())
    gaps = {"loss": abs(nodes["metrics"]["loss"] - metrics["loss"]), "grads": max_gap(nodes["grads"], grads[0]),
            "weights": max_gap(nodes["weights"], weights(single)),
            "grad_norm": abs(nodes["metrics"]["grad_norm"] - metrics["grad_norm"])}
    print("2 nodes x 2 processes vs 1 process, max |delta|:", gaps)
    assert all(gap <= TOLERANCE for gap in gaps.values()), gaps
    assert max_gap(weights(single), before) > 100 * TOLERANCE  # the step moved the weights well beyond that
    assert nodes["metrics"]["rollouts"] == metrics["rollouts"] == 12

    # The sharded checkpoint (each process's part of AdamW's state): resumed, the next step is the same one.
    continued, resumed = nodes["continued"], nodes["resumed"]
    assert continued[0] == resumed[0] and nodes["gathered_now"]
    assert sorted(p.name for p in (tmp_path / "between").iterdir()) == ["serving_only.json"]
    assert all(torch.equal(continued[1][name], resumed[1][name]) for name in continued[1])
    assert len(list((tmp_path / "checkpoint" / "optimizer").glob("*.distcp"))) == 4
    single.train_batch(batch()[::-1])
    assert max_gap(continued[1], weights(single)) <= TOLERANCE


def test_the_trainer_is_started_standalone_on_one_node_and_through_the_rendezvous_on_several(tmp_path) -> None:
    python = sys.executable
    target = ["-m", "rollgym.train.trainers.grpo_process", str(tmp_path)]
    assert launch_command(GRPOConfig(), tmp_path) == [python, *target]
    assert launch_command(GRPOConfig(processes=8), tmp_path) == [
        python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", *target]
    nodes = GRPOConfig(processes=8, nnodes=4, node_rank=0, rdzv_endpoint="node0:29400", rdzv_id="run7")
    assert launch_command(nodes, tmp_path, node_rank=3) == [
        python, "-m", "torch.distributed.run", "--nnodes=4", "--node-rank=3", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29400", "--rdzv-id=run7", "--nproc-per-node=8", *target]
