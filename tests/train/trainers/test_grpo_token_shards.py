"""Rollouts are split over processes by tokens, not by index: every sequence in exactly one shard, the shards'
token counts within one rollout's length of each other, the same split on every call (every process computes
it alone), and the trainer's shards (`_own`, what its optimizer steps and π_old take) follow it."""

from __future__ import annotations

import random

import pytest

from rollgym.train.trainers.grpo_batch import TrainSequence, token_shards


def loads(lengths: list[int], shards: list[list[int]]) -> list[int]:
    return [sum(lengths[k] for k in shard) for shard in shards]


def test_a_skewed_batch_is_split_into_equal_token_counts_where_every_other_index_was_not() -> None:
    lengths = [900, 30] * 8  # long and short rollouts alternating: by index, rank 0 drew every long one
    by_index = [[k for k in range(len(lengths)) if k % 2 == rank] for rank in range(2)]
    assert loads(lengths, by_index) == [7200, 240]
    shards = token_shards(lengths, 2)
    assert loads(lengths, shards) == [3720, 3720]
    assert all(shard == sorted(shard) for shard in shards)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_sequence_lands_in_one_shard_and_the_shards_are_balanced(world: int) -> None:
    generator = random.Random(world)
    for _ in range(50):
        lengths = [generator.choice([generator.randint(5, 40), generator.randint(200, 2000)])
                   for _ in range(generator.randint(1, 40))]
        shards = token_shards(lengths, world)
        assert len(shards) == world and sorted(k for shard in shards for k in shard) == list(range(len(lengths)))
        assert max(loads(lengths, shards)) - min(loads(lengths, shards)) <= max(lengths)
        assert token_shards(list(lengths), world) == shards  # deterministic


def test_more_processes_than_sequences_leaves_some_shards_empty() -> None:
    assert token_shards([7, 3], 4) == [[0], [1], [], []]


def test_the_trainers_shards_are_the_token_split_of_each_mini_batch(tiny_model) -> None:
    pytest.importorskip("torch")
    from rollgym.train.trainers.grpo_config import GRPOConfig
    from rollgym.train.trainers.grpo_trainer import PolicyTrainer

    batch = [TrainSequence([1] * 4, [2] * n, [1] * n, [-1.0] * n, advantage=1.0, temperature=1.0)
             for n in [60, 3, 50, 4, 40, 5, 30, 6]]
    trainer = PolicyTrainer(GRPOConfig(finetune="full"), tiny_model)
    owns = []
    for rank in range(2):
        trainer.dist.world, trainer.dist.rank = 2, rank
        owns.append(trainer._own(batch))
    tokens = [sum(batch[i].length for i in own) for own in owns]
    assert sorted(owns[0] + owns[1]) == list(range(len(batch)))
    assert tokens == [115, 115]  # by index: 196 and 34
