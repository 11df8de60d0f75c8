"""Single turn: reverse a word; one exact-match reward and one length reward, weighted."""

from collections.abc import Iterator

import verifiers.v1 as vf

WORDS = ["rollgym", "verifiers", "token", "prefix"]


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.75)
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.25)
    async def same_length(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) == len(task.answer))


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self) -> Iterator[ReverseTask]:
        for word in WORDS:
            yield ReverseTask(ReverseData(prompt=f"Reverse this text: {word}", answer=word[::-1]), self.config.task)


__all__ = ["ReverseTaskset"]
