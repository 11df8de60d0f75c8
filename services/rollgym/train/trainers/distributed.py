"""This process's place in the trainer's data-parallel group (torchrun's WORLD_SIZE, RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE): its device, joining the process group, the device mesh full weights are sharded over,
and the reductions of a step's measurements over processes.
"""

from __future__ import annotations

import os
from typing import Any


_MESHES: dict[Any, Any] = {}
_GROUPS: dict[str, Any] = {}


class DistInfo:
    """This process's place in the data-parallel group (one process: rank 0 of 1)."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # torchrun starts as many processes on every node (--nproc-per-node), numbered node by node.
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world)))
        if self.local_world < 1 or self.world % self.local_world:
            raise ValueError(f"WORLD_SIZE {self.world} is not a multiple of LOCAL_WORLD_SIZE {self.local_world}")
        self.nodes = self.world // self.local_world

    @property
    def device(self) -> Any:
        """This process's device: its own GPU (the one NCCL reduces on), else the CPU (gloo)."""
        import torch

        return torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu")

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def init(self) -> None:
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            # Bind this process's GPU first: otherwise every rank's NCCL calls (broadcast_object_list
            # included) land on cuda:0.
            torch.cuda.set_device(self.local_rank)
        if self.distributed and not dist.is_initialized():
            if torch.cuda.is_available():
                # device_id binds the group to this rank's GPU at once (NCCL connects eagerly, and no
                # collective guesses the device from the current one).
                dist.init_process_group("nccl", device_id=self.device)
            else:
                dist.init_process_group("gloo")

    def mesh(self) -> Any:
        """The device mesh FSDP2 shards full weights over: one node, None (flat: every process holds
        1/WORLD_SIZE of each weight); several, HSDP, a 2-D mesh (nodes × processes per node) named
        ("replicate", "shard"): each weight sharded over a node's processes, whose fast links carry the
        all-gathers and reduce-scatters of every layer, and replicated across nodes, which exchange only
        the gradients' all-reduce once per step."""
        if self.nodes == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        # One per process: each mesh makes process groups (NCCL communicators, with their GPU memory), and a
        # process builds a new trainer whenever a step starts from another state or other settings.
        key = (self.device.type, self.nodes, self.local_world)
        if key not in _MESHES:
            _MESHES[key] = init_device_mesh(self.device.type, (self.nodes, self.local_world),
                                            mesh_dim_names=("replicate", "shard"))
        return _MESHES[key]

    def side_group(self) -> Any:
        """A gloo group of every process beside the step's (made once per process, by every process at the same
        point): background checkpoint writes coordinate on it, so their collectives never meet the step's."""
        if "gloo" not in _GROUPS:
            import torch.distributed as dist

            _GROUPS["gloo"] = dist.new_group(backend="gloo")
        return _GROUPS["gloo"]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def all_sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, "sum")

    def all_min(self, values: list[float]) -> list[float]:
        return self._reduce(values, "min")

    def all_max(self, values: list[float]) -> list[float]:
        return self._reduce(values, "max")

    def _reduce(self, values: list[float], how: str) -> list[float]:
        if not self.distributed:
            return values
        import torch
        import torch.distributed as dist

        op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[how]
        # On the process group's device: NCCL refuses CPU tensors.
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()


__all__ = ["DistInfo"]
