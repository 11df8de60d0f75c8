"""The filters of rollouts and groups, one home for both training modes (curation in mode: epochs, the
orchestrator in mode: async and `rollgym orchestrate`).

**Difficulty** (`DifficultyConfig`, `difficulty_verdict`): a group whose rewards are all alike teaches GRPO
nothing; the orchestrator drops it as easy or hard and a stage's collect refills it.

**Degenerate generations**, read from a rollout's sampled tokens and their sampling logprobs: the two of
Surogate's `filters[]` (a stage's `curate.filters`, the orchestrator's `filters`), with its keys and defaults:

- `repetition`: `window` consecutive sampled tokens each drawn with probability above `prob_threshold`
  (logprob > log(prob_threshold)): the model is looping with near certainty. A token the model did not sample
  (the environment's, or one a grammar forced) ends a run.
- `gibberish`: a sampled token whose id is above `token_id_threshold` (a rare BPE piece) drawn with a logprob
  below the uniform distribution's less `logprob_offset` (-log(vocab_size) - logprob_offset): sampled at
  high entropy. `vocab_size` is the policy's vocabulary size; rollgym cannot know it from a rollout, so the
  filter asks for it.

`enforce: false` (the default, as Surogate's) flags and counts; `enforce: true` also keeps the rollout out of
training. The logprobs read are those the model server recorded (`sampling.logprobs`: raw, at temperature 1,
or processed, of the distribution sampled from).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Iterable, Literal, Mapping, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from ..config import StrictModel
from .records import model_token_mask


class DifficultyConfig(StrictModel):
    """Difficulty filtering, one section for both modes: groups that teach nothing are replaced by fresh ones.
    mode: async (`orchestrator.difficulty`) drops a finished group as easy or hard by its rewards and may send
    its task again; mode: epochs (`stages[i].collect.difficulty`, loop/dynamic_sampling.py) refills the groups
    curation drops for no reward spread. Each mode refuses the keys only the other applies."""

    enabled: bool = Field(default=False, description="replace groups that teach nothing")
    # mode: async
    reward_min: float = Field(default=0.0, description="a group whose rewards are all <= this is 'hard'")
    reward_max: float = Field(default=1.0, description="a group whose rewards are all >= this is 'easy'")
    easy_threshold: float | None = Field(default=None, description="a group whose mean reward is >= this is 'easy'")
    hard_threshold: float | None = Field(default=None, description="a group whose mean reward is <= this is 'hard'")
    easy_fraction: float = Field(default=0.0, ge=0, le=1, description="chance an easy-pool task is sent again "
                                                                      "at each pass over the tasks")
    hard_fraction: float = Field(default=0.0, ge=0, le=1, description="chance a hard-pool task is sent again "
                                                                      "at each pass over the tasks")
    # mode: epochs (the async orchestrator's own oversampling_factor is a key of its section)
    oversampling_factor: float = Field(default=1.0, ge=1.0, description="epochs: tasks collected per group still "
                                       "missing")
    max_refill_rounds: int = Field(default=2, ge=0, description="epochs: extra collections per epoch at most")

    ASYNC_KEYS: ClassVar[tuple[str, ...]] = ("reward_min", "reward_max", "easy_threshold", "hard_threshold",
                                             "easy_fraction", "hard_fraction")
    EPOCHS_KEYS: ClassVar[tuple[str, ...]] = ("oversampling_factor", "max_refill_rounds")

    def other_mode_keys(self, mode: str) -> list[str]:
        """The keys set away from their default here that only the other mode applies (`mode`: "async" or
        "epochs"); a dumped section lists every key at its default."""
        other = self.EPOCHS_KEYS if mode == "async" else self.ASYNC_KEYS
        return [key for key in other if getattr(self, key) != type(self).model_fields[key].default]


def difficulty_verdict(rewards: Sequence[float], difficulty: DifficultyConfig) -> Literal["easy", "hard"] | None:
    """'easy' or 'hard' for a group's rewards the difficulty filter drops (None: it keeps them)."""
    if not difficulty.enabled or not rewards:
        return None
    mean = sum(rewards) / len(rewards)
    if min(rewards) >= difficulty.reward_max or (
            difficulty.easy_threshold is not None and mean >= difficulty.easy_threshold):
        return "easy"
    if max(rewards) <= difficulty.reward_min or (
            difficulty.hard_threshold is not None and mean <= difficulty.hard_threshold):
        return "hard"
    return None


class RepetitionFilter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["repetition"]
    enforce: bool = Field(default=False, description="keep flagged rollouts out of training (else: count only)")
    window: int = Field(default=3000, ge=1, description="consecutive high-probability sampled tokens that flag")
    prob_threshold: float = Field(default=0.99, gt=0.0, lt=1.0, description="a token's probability above this "
                                                                             "counts toward the window")

    def flags(self, sequence: Mapping[str, Any]) -> bool:
        floor = math.log(self.prob_threshold)
        run = 0
        for sampled, logprob in zip(model_token_mask(sequence), sequence["completion_logprobs"]):
            run = run + 1 if sampled and logprob is not None and logprob > floor else 0
            if run >= self.window:
                return True
        return False


class GibberishFilter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["gibberish"]
    enforce: bool = Field(default=False, description="keep flagged rollouts out of training (else: count only)")
    vocab_size: int = Field(ge=2, description="the policy's vocabulary size (the uniform logprob is -log of it)")
    token_id_threshold: int = Field(default=100000, ge=0, description="token ids above this are candidates")
    logprob_offset: float = Field(default=2.0, description="how far below the uniform logprob a candidate must be")

    def flags(self, sequence: Mapping[str, Any]) -> bool:
        floor = -math.log(self.vocab_size) - self.logprob_offset
        return any(sampled and token > self.token_id_threshold and logprob is not None and logprob < floor
                   for sampled, token, logprob in zip(model_token_mask(sequence), sequence["completion_ids"],
                                                      sequence["completion_logprobs"]))


RolloutFilter = Annotated[Union[RepetitionFilter, GibberishFilter], Field(discriminator="type")]


def flagged_by(filters: Iterable[RepetitionFilter | GibberishFilter],
               sequences: Iterable[Mapping[str, Any]]) -> list[RepetitionFilter | GibberishFilter]:
    """The filters that flag a rollout: any of its token `sequences` (segments) trips them."""
    sequences = list(sequences)
    return [each for each in filters if any(each.flags(sequence) for sequence in sequences)]


def judge(filters: Sequence[RepetitionFilter | GibberishFilter],
          sequences: Iterable[Mapping[str, Any]]) -> tuple[list[str], str | None]:
    """(the types of every filter that flags a rollout's token sequences, the first enforced one or None)."""
    hits = flagged_by(filters, sequences) if filters else []
    return sorted({each.type for each in hits}), next((each.type for each in hits if each.enforce), None)


__all__ = ["DifficultyConfig", "GibberishFilter", "RepetitionFilter", "RolloutFilter", "difficulty_verdict",
           "flagged_by", "judge"]
