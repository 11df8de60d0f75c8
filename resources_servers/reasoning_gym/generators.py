"""reasoning-gym's generators as this environment uses them: looked up by name, their configs checked
key by key, entries rebuilt from (dataset, config, seed, size, index), answers extracted and scored.

An entry is a pure function of those five values for every generator of reasoning-gym 0.1.25, so a task
row carries them instead of the entry: the server rebuilds the exact entry (metadata with its tuples and
objects intact, which a JSON round trip would not keep: arc_agi's scorer gives 0.05 to its own answer
after one) and scores with the generator's own `score_answer`. `size` is part of the key because a few
generators (acre, list_functions) draw their whole plan from it.

Datasets are cached (building arc_agi reads its data files, 0.6 s) and entries too (puzzle24 takes
0.4 s to make one); each dataset is used by one thread at a time, as a few keep state between items.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import reasoning_gym
from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

# reasoning-gym's own mixture; a rollgym mixture is a file of the generate command instead.
NOT_SERVED = frozenset({"composite"})
# The fields of every generator's config that a task row sets itself.
ROW_FIELDS = ("seed", "size")
ANSWER_TAG = "answer"
ANSWER_BLOCK = re.compile(rf"<{ANSWER_TAG}>(.*?)</{ANSWER_TAG}>", re.DOTALL)
DEFAULT_PROMPT = "default"


class GeneratorError(ValueError):
    """A generator name, config or index that cannot make an entry; `field` names the row field at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class ScorerError(RuntimeError):
    """A generator's scorer raised or returned something that is not a reward: an environment failure."""


def generator_names() -> list[str]:
    """Every generator this environment serves, sorted."""
    return sorted(name for name in DATASETS if name not in NOT_SERVED)


def config_fields(name: str) -> dict[str, Any]:
    """A generator's config keys (without seed and size) and their defaults."""
    config_class = DATASETS[check_name(name)][1]
    fields = {}
    for item in dataclasses.fields(config_class):
        if item.name in ROW_FIELDS:
            continue
        if item.default is not dataclasses.MISSING:
            fields[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:
            fields[item.name] = item.default_factory()
        else:
            fields[item.name] = None
    return fields


def check_name(name: str, field: str = "dataset") -> str:
    if name in DATASETS and name not in NOT_SERVED:
        return name
    if name in NOT_SERVED:
        raise GeneratorError(f"{name!r} is reasoning-gym's own mixture; write a mixture file instead", field)
    close = difflib.get_close_matches(name, generator_names(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise GeneratorError(f"unknown reasoning-gym generator {name!r} ({hint}{len(generator_names())} known; "
                         "`python -m resources_servers.reasoning_gym list` shows them)", field)


def check_config(name: str, config: dict[str, Any], field: str = "dataset_config") -> None:
    """Raise GeneratorError naming `field.KEY` for a key the generator's config does not have."""
    known = config_fields(name)
    for key in config:
        if key in ROW_FIELDS:
            raise GeneratorError(f"{key!r} is not a config key here: a task row and the generate command set "
                                 f"the {key} themselves", f"{field}.{key}")
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise GeneratorError(f"{name} has no config key {key!r} ({hint}keys: {', '.join(known)})",
                                 f"{field}.{key}")


def canonical(config: dict[str, Any]) -> str:
    """The config as one string: the cache key, and what makes two configs the same."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), default=repr)


@dataclass(frozen=True)
class EntryKey:
    dataset: str
    config: str  # canonical(config)
    seed: int
    size: int


class _Dataset:
    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.lock = threading.Lock()


class Generators:
    """Builds, caches and scores reasoning-gym entries; thread-safe (blocking: call it off the event loop)."""

    def __init__(self, max_datasets: int = 64, max_entries: int = 4096) -> None:
        self.max_datasets = max_datasets
        self.max_entries = max_entries
        self._datasets: OrderedDict[EntryKey, _Dataset] = OrderedDict()
        self._entries: OrderedDict[tuple[EntryKey, int], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def dataset(self, name: str, config: dict[str, Any], seed: int, size: int) -> _Dataset:
        """The dataset of (name, config, seed, size), built once; GeneratorError for a bad name or config."""
        check_name(name)
        check_config(name, config)
        key = EntryKey(name, canonical(config), seed, size)
        with self._lock:
            cached = self._datasets.get(key)
            if cached is not None:
                self._datasets.move_to_end(key)
                return cached
        try:
            built = _Dataset(reasoning_gym.create_dataset(name, **config, seed=seed, size=size))
        except (AssertionError, ValueError, TypeError, KeyError) as exc:  # the configs' own validate()
            raise GeneratorError(f"{name} refuses this config: {_cause(exc)}", "dataset_config") from None
        with self._lock:
            self._datasets[key] = built
            while len(self._datasets) > self.max_datasets:
                self._datasets.popitem(last=False)
        return built

    def entry(self, name: str, config: dict[str, Any], seed: int, size: int, index: int) -> dict[str, Any]:
        """The entry (question, answer, metadata) at `index`; GeneratorError when it cannot be made."""
        if not 0 <= index < size:
            raise GeneratorError(f"index {index} is outside the dataset's size {size}", "index")
        dataset = self.dataset(name, config, seed, size)
        key = (EntryKey(name, canonical(config), seed, size), index)
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                return cached
        with dataset.lock:
            try:
                made = dataset.dataset[index]
            except Exception as exc:  # deterministic: the same row fails the same way every time
                # word_ladder shrinks its size when it runs out of words: a fresh dataset for the next row.
                self._forget(key[0])
                raise GeneratorError(f"{name} cannot make entry {index}: {_cause(exc)}", "index") from None
        with self._lock:
            self._entries[key] = made
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return made

    def score(self, name: str, config: dict[str, Any], seed: int, size: int, index: int, answer: str) -> float:
        """The generator's own score of `answer` for the entry, in [0, 1]; ScorerError when the scorer fails."""
        entry = self.entry(name, config, seed, size, index)
        dataset = self.dataset(name, config, seed, size)
        with dataset.lock:
            try:
                score = dataset.dataset.score_answer(answer=answer, entry=entry)
            except Exception as exc:
                raise ScorerError(f"the {name} scorer raised {_cause(exc)}") from None
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ScorerError(f"the {name} scorer returned {score!r}, not a number")
        if not 0.0 <= score <= 1.0:
            raise ScorerError(f"the {name} scorer returned {score!r}, outside [0, 1]")
        return float(score)

    def containment_credit(self, name: str, config: dict[str, Any], seed: int, size: int, index: int,
                           answer: str) -> bool:
        """Whether the generator scores `answer` with reasoning-gym's default scorer's credit for containing
        the oracle answer among other text (`len(oracle) / len(answer)`): what a hedge such as "1, 2, 3"
        earns when one of its answers is right."""
        dataset = self.dataset(name, config, seed, size)
        if type(dataset.dataset).score_answer is not ProceduralDataset.score_answer:
            return False
        oracle = self.entry(name, config, seed, size, index)["answer"]
        return isinstance(oracle, str) and answer != oracle and oracle in answer

    def _forget(self, key: EntryKey) -> None:
        with self._lock:
            self._datasets.pop(key, None)


def _cause(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def answers_of(text: str) -> list[str]:
    """The text of every `<answer>...</answer>` of text (stripped), in order."""
    return [found.strip() for found in ANSWER_BLOCK.findall(text)]


def answer_of(text: str) -> str | None:
    """The text of the last `<answer>...</answer>` (stripped), or None: reasoning-gym's own extraction."""
    return extract_answer(text, tag_name=ANSWER_TAG, strip=True)


def system_prompt(name_or_text: str) -> str:
    """One of reasoning-gym's system prompts by name, or a prompt of one's own that asks for `<answer>` tags."""
    if name_or_text in SYSTEM_PROMPTS:
        return SYSTEM_PROMPTS[name_or_text]
    if f"<{ANSWER_TAG}>" not in name_or_text:
        raise ValueError(f"is neither one of reasoning-gym's prompts ({', '.join(SYSTEM_PROMPTS)}) nor a text "
                         f"that asks for the answer in <{ANSWER_TAG}></{ANSWER_TAG}> tags")
    return name_or_text
