"""Filters of degenerate generations, read from a rollout's sampled tokens and their sampling logprobs.

The two of Surogate's `filters[]`, with its keys and defaults:

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
from typing import Annotated, Any, Iterable, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field

from .records import model_token_mask


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


__all__ = ["GibberishFilter", "RepetitionFilter", "RolloutFilter", "flagged_by"]
