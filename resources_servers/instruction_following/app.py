"""instruction_following: a single-turn writing task with verifiable constraints (IFEval-style).

A task row lists `instructions`, each `{"type": <constraint type>, ...its parameters}`. Each
constraint is checked by a pure function of the final answer. Reward = the fraction of constraints
satisfied; `reward_components` = {"<index>:<type>": 1.0 or 0.0} per constraint.

An unknown constraint type, or a bad parameter, is a bad task row: 422 naming
`instructions[<i>].type` (or the parameter, e.g. `instructions[<i>].min_words`).

The checks only see the form of an answer, so a policy can satisfy them without doing the task; the
answers that do that on their face earn 0 with a reason before any check runs (see `refusal`): no
answer (which meets every "do not" for free), an answer ending in a tool call, words spelled with
look-alike letters of another script, a few words repeated to fill a length, a copy of the prompt.
The checks read the answer in Unicode NFKC form without invisible characters, so a zero-width space
or full-width letters do not hide a forbidden word.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from rollgym import ResourcesServer, RunRequest, Verdict
from rollgym.text import final_answer_text, final_message_text, message_text

# --- the checks: pure functions of the answer ----------------------------------------------------

WORD = re.compile(r"[^\W_]+(?:['’\-][^\W_]+)*")
SENTENCE_END = re.compile(r"[.!?…]+(?=[\s\"'”’)\]]|$)")
BULLET = re.compile(r"^\s*[*-]\s+\S", re.MULTILINE)
PARAGRAPH_BREAK = re.compile(r"\n\s*\n|^\s*\*{3,}\s*$", re.MULTILINE)
TITLE = re.compile(r"<<[^\n<>]*\S[^\n<>]*>>")
HIGHLIGHT = re.compile(r"\*\*(?!\s)[^\n*]+(?<!\s)\*\*|(?<!\*)\*(?!\s)[^\n*]+(?<!\s)\*(?!\*)")
PLACEHOLDER = re.compile(r"\[[^\[\]\n]*\S[^\[\]\n]*\]")
JSON_FENCE = re.compile(r"^```(?:json|JSON)?\s*\n?(.*?)\n?\s*```$", re.DOTALL)


def words(answer: str) -> list[str]:
    """The words of the answer: runs of letters/digits, with inner apostrophes and hyphens."""
    return WORD.findall(answer)


def sentences(answer: str) -> list[str]:
    """The sentences: text split after ., ! or ? (and …), keeping those with a word in them."""
    parts = SENTENCE_END.split(answer)
    return [part for part in parts if WORD.search(part)]


def paragraphs(answer: str) -> list[str]:
    """The paragraphs: text split at blank lines or at lines of `***`, empty ones dropped."""
    return [part for part in PARAGRAPH_BREAK.split(answer) if part.strip()]


def count_keyword(answer: str, keyword: str) -> int:
    """How often `keyword` occurs as a whole word or phrase, case-insensitively ("cat" not in "catalog")."""
    pattern = r"(?<!\w)" + r"\s+".join(re.escape(part) for part in keyword.split()) + r"(?!\w)"
    return len(re.findall(pattern, answer, re.IGNORECASE))


def within(value: int, minimum: int | None, maximum: int | None) -> bool:
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def word_count_ok(answer: str, min_words: int | None = None, max_words: int | None = None) -> bool:
    return within(len(words(answer)), min_words, max_words)


def sentence_count_ok(answer: str, min_sentences: int | None = None, max_sentences: int | None = None) -> bool:
    return within(len(sentences(answer)), min_sentences, max_sentences)


def includes_keywords(answer: str, keywords: list[str]) -> bool:
    return all(count_keyword(answer, keyword) > 0 for keyword in keywords)


def excludes_keywords(answer: str, keywords: list[str]) -> bool:
    return all(count_keyword(answer, keyword) == 0 for keyword in keywords)


def keyword_frequency_ok(answer: str, keyword: str, relation: str, frequency: int) -> bool:
    count = count_keyword(answer, keyword)
    if relation == "at_least":
        return count >= frequency
    if relation == "at_most":
        return count <= frequency
    return count == frequency


def is_json(answer: str) -> bool:
    """The whole answer is one JSON value, optionally in a ```json fence."""
    text = answer.strip()
    fenced = JSON_FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text:
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def bullet_count_ok(answer: str, count: int) -> bool:
    """Exactly `count` lines start with "* " or "- " (markdown bullets)."""
    return len(BULLET.findall(answer)) == count


def all_lowercase(answer: str) -> bool:
    """Some letters and no capital ones."""
    return answer.islower()


def all_uppercase(answer: str) -> bool:
    """Some letters and no small ones."""
    return answer.isupper()


def ends_with(answer: str, phrase: str) -> bool:
    """The answer, less surrounding whitespace, ends with the phrase (case-insensitive)."""
    return answer.strip().lower().endswith(phrase.strip().lower())


def starts_with(answer: str, phrase: str) -> bool:
    """The answer, less surrounding whitespace, starts with the phrase (case-insensitive)."""
    return answer.strip().lower().startswith(phrase.strip().lower())


def paragraph_count_ok(answer: str, count: int) -> bool:
    return len(paragraphs(answer)) == count


def has_no_commas(answer: str) -> bool:
    return "," not in answer and "，" not in answer


def has_title(answer: str) -> bool:
    """A title in double angular brackets: <<like this>>."""
    return TITLE.search(answer) is not None


def highlight_count_ok(answer: str, min_count: int) -> bool:
    """At least `min_count` sections highlighted with markdown, *like this* or **like this**."""
    return len(HIGHLIGHT.findall(answer)) >= min_count


def placeholder_count_ok(answer: str, min_count: int) -> bool:
    """At least `min_count` placeholders in square brackets, [like this]."""
    return len(PLACEHOLDER.findall(answer)) >= min_count


def has_postscript(answer: str, marker: str = "P.S.") -> bool:
    """A line that starts with the marker (e.g. "P.S.", case-insensitive) and has text after it."""
    pieces = [re.escape(piece) for piece in marker.strip().split(".") if piece.strip()]
    dotted = r"\.\s?".join(pieces) + (r"\." if marker.strip().endswith(".") else "")
    return re.search(rf"^\s*{dotted}\s*\S", answer, re.IGNORECASE | re.MULTILINE) is not None


# --- the constraints: a discriminated union on `type` --------------------------------------------


class Constraint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def check(self, answer: str) -> bool:
        raise NotImplementedError


class RangeConstraint(Constraint):
    """Base of the min/max constraints: at least one bound, and min <= max."""

    bounds: ClassVar[tuple[str, str]]

    @model_validator(mode="after")
    def _bounds(self) -> "RangeConstraint":
        low, high = (getattr(self, name) for name in type(self).bounds)
        if low is None and high is None:
            raise ValueError(f"give {type(self).bounds[0]}, {type(self).bounds[1]} or both")
        if low is not None and high is not None and low > high:
            raise ValueError(f"{type(self).bounds[0]} is larger than {type(self).bounds[1]}")
        return self


class WordCountConstraint(RangeConstraint):
    bounds: ClassVar[tuple[str, str]] = ("min_words", "max_words")
    type: Literal["word_count"]
    min_words: int | None = Field(default=None, ge=0)
    max_words: int | None = Field(default=None, ge=0)

    def check(self, answer: str) -> bool:
        return word_count_ok(answer, self.min_words, self.max_words)


class SentenceCountConstraint(RangeConstraint):
    bounds: ClassVar[tuple[str, str]] = ("min_sentences", "max_sentences")
    type: Literal["sentence_count"]
    min_sentences: int | None = Field(default=None, ge=0)
    max_sentences: int | None = Field(default=None, ge=0)

    def check(self, answer: str) -> bool:
        return sentence_count_ok(answer, self.min_sentences, self.max_sentences)


Keyword = Annotated[str, Field(min_length=1, pattern=r"\S")]


class IncludeKeywordsConstraint(Constraint):
    type: Literal["include_keywords"]
    keywords: list[Keyword] = Field(min_length=1)

    def check(self, answer: str) -> bool:
        return includes_keywords(answer, self.keywords)


class ExcludeKeywordsConstraint(Constraint):
    type: Literal["exclude_keywords"]
    keywords: list[Keyword] = Field(min_length=1)

    def check(self, answer: str) -> bool:
        return excludes_keywords(answer, self.keywords)


class KeywordFrequencyConstraint(Constraint):
    type: Literal["keyword_frequency"]
    keyword: Keyword
    relation: Literal["at_least", "at_most", "exactly"]
    frequency: int = Field(ge=0)

    def check(self, answer: str) -> bool:
        return keyword_frequency_ok(answer, self.keyword, self.relation, self.frequency)


class JsonFormatConstraint(Constraint):
    type: Literal["json_format"]

    def check(self, answer: str) -> bool:
        return is_json(answer)


class BulletCountConstraint(Constraint):
    type: Literal["bullet_count"]
    count: int = Field(ge=0)

    def check(self, answer: str) -> bool:
        return bullet_count_ok(answer, self.count)


class AllLowercaseConstraint(Constraint):
    type: Literal["all_lowercase"]

    def check(self, answer: str) -> bool:
        return all_lowercase(answer)


class AllUppercaseConstraint(Constraint):
    type: Literal["all_uppercase"]

    def check(self, answer: str) -> bool:
        return all_uppercase(answer)


class EndsWithConstraint(Constraint):
    type: Literal["ends_with"]
    phrase: Keyword

    def check(self, answer: str) -> bool:
        return ends_with(answer, self.phrase)


class StartsWithConstraint(Constraint):
    type: Literal["starts_with"]
    phrase: Keyword

    def check(self, answer: str) -> bool:
        return starts_with(answer, self.phrase)


class ParagraphCountConstraint(Constraint):
    type: Literal["paragraph_count"]
    count: int = Field(ge=1)

    def check(self, answer: str) -> bool:
        return paragraph_count_ok(answer, self.count)


class NoCommasConstraint(Constraint):
    type: Literal["no_commas"]

    def check(self, answer: str) -> bool:
        return has_no_commas(answer)


class TitleConstraint(Constraint):
    type: Literal["title"]

    def check(self, answer: str) -> bool:
        return has_title(answer)


class HighlightedSectionsConstraint(Constraint):
    type: Literal["highlighted_sections"]
    min_count: int = Field(ge=1)

    def check(self, answer: str) -> bool:
        return highlight_count_ok(answer, self.min_count)


class PlaceholderCountConstraint(Constraint):
    type: Literal["placeholder_count"]
    min_count: int = Field(ge=1)

    def check(self, answer: str) -> bool:
        return placeholder_count_ok(answer, self.min_count)


class PostscriptConstraint(Constraint):
    type: Literal["postscript"]
    marker: str = Field(default="P.S.", pattern=r"^\s*[A-Za-z]+(?:\.\s?[A-Za-z]+)*\.?\s*$")

    def check(self, answer: str) -> bool:
        return has_postscript(answer, self.marker)


CONSTRAINT_CLASSES: tuple[type[Constraint], ...] = (
    WordCountConstraint,
    SentenceCountConstraint,
    IncludeKeywordsConstraint,
    ExcludeKeywordsConstraint,
    KeywordFrequencyConstraint,
    JsonFormatConstraint,
    BulletCountConstraint,
    AllLowercaseConstraint,
    AllUppercaseConstraint,
    EndsWithConstraint,
    StartsWithConstraint,
    ParagraphCountConstraint,
    NoCommasConstraint,
    TitleConstraint,
    HighlightedSectionsConstraint,
    PlaceholderCountConstraint,
    PostscriptConstraint,
)
# "word_count" → WordCountConstraint
CONSTRAINT_TYPES: dict[str, type[Constraint]] = {
    cls.model_fields["type"].annotation.__args__[0]: cls for cls in CONSTRAINT_CLASSES
}


class UnknownConstraint(BaseModel):
    """Where a row with an unknown (or missing) `type` lands, so the 422 names `instructions[i].type`."""

    type: str

    @field_validator("type")
    @classmethod
    def _unknown(cls, value: str) -> str:
        raise ValueError(f"unknown constraint type {value!r}; known types: {', '.join(CONSTRAINT_TYPES)}")


def _constraint_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    cls = CONSTRAINT_TYPES.get(kind) if isinstance(kind, str) else None
    return cls.__name__ if cls is not None else UnknownConstraint.__name__


# Tags are the class names (which rollgym leaves out of error paths), not the type strings, so a bad
# parameter reads `instructions[0].min_words` rather than `instructions[0].word_count.min_words`.
AnyConstraint = Annotated[
    Union[tuple(Annotated[cls, Tag(cls.__name__)] for cls in (*CONSTRAINT_CLASSES, UnknownConstraint))],
    Discriminator(_constraint_tag),
]


class InstructionFollowingTask(RunRequest):
    instructions: list[AnyConstraint] = Field(min_length=1, description="the constraints the answer must meet")


def check_all(answer: str, instructions: list[Constraint]) -> dict[str, float]:
    """{"<index>:<type>": 1.0 if satisfied else 0.0} for each constraint, in order."""
    return {f"{index}:{c.type}": 1.0 if c.check(answer) else 0.0 for index, c in enumerate(instructions)}


def instruction_reward(answer: str, instructions: list[Constraint]) -> tuple[float, dict[str, float]]:
    """(fraction of constraints satisfied, the per-constraint components)."""
    components = check_all(answer, instructions)
    return sum(components.values()) / len(components), components


# An answer of at least this many words whose distinct words are fewer than this share of them repeats
# a few words to meet a length or a frequency (ordinary prose stays above 0.4 at these lengths).
REPETITION_MIN_WORDS = 20
REPETITION_MIN_DISTINCT = 0.3
# An answer of at least this many words, half of whose word trigrams are in the prompt, copies the prompt.
COPY_MIN_WORDS = 6
COPY_SHARE = 0.5
LOOKALIKE_SCRIPTS = {"LATIN", "CYRILLIC", "GREEK"}


def visible_text(answer: str) -> str:
    """The answer as a reader sees it: NFKC (full-width and styled letters as plain ones) less invisible
    format characters (zero-width spaces and joiners, soft hyphens, direction marks)."""
    normal = unicodedata.normalize("NFKC", answer)
    return "".join(c for c in normal if unicodedata.category(c) != "Cf")


def _script(char: str) -> str | None:
    name = unicodedata.name(char, "")
    return name.split(" ", 1)[0] if char.isalpha() and name else None


def lookalike_word(text: str) -> str | None:
    """The first word that mixes Latin with Cyrillic or Greek letters ("еasy" with a Cyrillic е), or None."""
    for word in words(text):
        scripts = {_script(c) for c in word} & LOOKALIKE_SCRIPTS
        if len(scripts) > 1:
            return word
    return None


def _trigrams(text: str) -> list[tuple[str, ...]]:
    found = [w.lower() for w in words(text)]
    return [tuple(found[i:i + 3]) for i in range(len(found) - 2)]


def refusal(answer: str, prompt: str) -> str | None:
    """Why an answer earns 0 without being checked, or None. `answer` is the visible text."""
    found = words(answer)
    if not found:
        return "empty answer (it would meet every negative constraint without doing the task)"
    odd = lookalike_word(answer)
    if odd is not None:
        return f"the word {odd!r} mixes Latin with Cyrillic or Greek look-alike letters"
    distinct = len({w.lower() for w in found})
    if len(found) >= REPETITION_MIN_WORDS and distinct < REPETITION_MIN_DISTINCT * len(found):
        return f"the answer repeats a few words ({distinct} distinct in {len(found)})"
    grams = _trigrams(answer)
    if len(found) >= COPY_MIN_WORDS and grams:
        asked = set(_trigrams(visible_text(prompt)))
        if sum(gram in asked for gram in grams) >= COPY_SHARE * len(grams):
            return "the answer copies the prompt"
    return None


def prompt_text(params: Any) -> str:
    """The task's prompt text: its string input, or the text of its input messages joined."""
    given = params.input
    if isinstance(given, str):
        return given
    return "\n".join(message_text(item) for item in given)


class InstructionFollowingServer(ResourcesServer):
    task_model = InstructionFollowingTask

    async def verify(self, request: InstructionFollowingTask, state: dict[str, Any]) -> Verdict:
        output = request.response.output
        raw = final_answer_text(output)
        answer = visible_text(raw)
        refused = refusal(answer, prompt_text(request.responses_create_params))
        if not raw.strip() and final_message_text(output).strip():
            refused = "no final answer: the response ends with a tool call or its output"
        if refused:
            components = {f"{index}:{c.type}": 0.0 for index, c in enumerate(request.instructions)}
            return Verdict(reward=0.0, components=components,
                           details={"satisfied": 0, "total": len(components), "reason": refused})
        reward, components = instruction_reward(answer, request.instructions)
        details: dict[str, Any] = {"satisfied": int(sum(components.values())), "total": len(components)}
        if reward == 0.0:
            details["reason"] = "no constraint satisfied"
        return Verdict(reward=reward, components=components, details=details)
