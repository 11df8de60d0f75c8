"""A reward function that raises: the rollout must fail with its cause, never score 0."""

from collections.abc import Iterator

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def judge(self, task: vf.TaskData, trace: vf.Trace) -> float:
        raise RuntimeError("the rubric's own bug")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> Iterator[BrokenTask]:
        yield BrokenTask(vf.TaskData(prompt="Reverse this text: oops"), self.config.task)


__all__ = ["BrokenTaskset"]
