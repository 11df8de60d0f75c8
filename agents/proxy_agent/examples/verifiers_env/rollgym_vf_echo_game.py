"""Multi-turn: the Env speaks between turns. Each round it asks for a word reversed and checks
the reply; the reward is the fraction of rounds answered right."""

from collections.abc import Iterator

import verifiers.v1 as vf

ROUNDS = [["abc", "rollgym"], ["tokens", "prefix"], ["mask", "grpo"]]


class GameData(vf.TaskData):
    words: list[str]


class GameTask(vf.Task[GameData, vf.State, vf.TaskConfig]):
    pass


class EchoGameConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class EchoGameEnv(vf.Env[EchoGameConfig]):
    async def run(self, task, agents):
        words = task.data.words
        right = 0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for index, word in enumerate(words):
                right += segment.last_reply.strip() == word[::-1]
                if index + 1 == len(words) or segment.terminated:
                    break
                segment = await interaction.turn(f"Reverse this text: {words[index + 1]}")
        interaction.trace.record_reward("rounds_won", right / len(words), 1.0)


class GameTaskset(vf.Taskset[GameTask, vf.TasksetConfig]):
    def load(self) -> Iterator[GameTask]:
        for words in ROUNDS:
            yield GameTask(GameData(prompt=f"Reverse this text: {words[0]}", words=words), self.config.task)


__all__ = ["EchoGameEnv", "GameTaskset"]
