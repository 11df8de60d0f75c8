"""mcq: a single-turn multiple-choice question; the model names one option letter.

Reward 1.0 when the letter read from the final answer is `expected_answer`, else 0.0 (also when no
letter can be read). The letter is read, in this order of precedence:

1. the last `\\boxed{...}`: "\\boxed{B}", "\\boxed{\\text{(B)}}";
2. the last explicit answer statement that names an option: "Answer: B", "The answer is (B).",
   "**Final answer:** B", "The correct option is B", "The answer is Paris" (an option's text);
3. a label opening the answer, when it is the only line that opens with one: "B) Paris",
   "(B) Paris", "**B**", "B.", "b)";
4. the last standalone capital letter among the option letters ("Option C is right.", "I pick C."),
   ignoring letters inside quoted option texts, "A"/"I" used as a word ("A cat", "I think"), and
   words such as "B-cell"; a lower-case letter counts only in brackets, "(b)";
5. the option whose text the answer quotes last, verbatim (case-insensitive).

A lower-case letter counts only where it stands alone: the whole answer ("b"), a bracket "(b)", a
label "b)", or an answer statement that ends with it ("Answer: b"), never "the answer is a prime".
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from rollgym import ResourcesServer, RunRequest, Verdict
from rollgym.text import final_message_text, last_boxed

LETTER_KEY = re.compile(r"[A-Z]")

# Words after a capital "A" or "I" that make it an option letter rather than an article or pronoun
# ("A is correct" vs "A cat", "I think").
LETTER_VERBS = {"is", "was", "seems", "appears", "looks", "matches", "fits", "remains", "would", "should", "must"}
# Words that make a capital "I" in "I would", "I should" a pronoun after all.
PRONOUN_VERBS = {"would", "should", "must"}

ANSWER_STATEMENT = re.compile(
    r"""\b(?:(?:final|correct|right|best|my)\s+(?:answer|option|choice)|answer)\b
        (?:\s*(?:is|would\s+be|should\s+be|must\s+be|will\s+be|=)\b)?""",
    re.IGNORECASE | re.VERBOSE,
)
# Markup and filler between an answer statement and the letter: "**: the option (B)".
LEADING_NOISE = re.compile(
    r"""^(?:[\s*_`"'“”‘’:=\-–—>\[\](){}]+|(?:is|the|option|choice|letter|answer|be)\b)*""",
    re.IGNORECASE,
)
LATEX_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mathit|mbox|emph)\s*\{([^{}]*)\}")
LABEL_LINE = re.compile(r"^[\s*_`>#\-]*[(\[]?([A-Za-z])(?:[)\].:]|\*\*|\s*$)")
STANDALONE_CAPITAL = re.compile(r"(?<![A-Za-z0-9'’\\-])([A-Z])(?![A-Za-z0-9'’]|[-.][A-Za-z])")
BRACKETED_LOWER = re.compile(r"\(([a-z])\)")


class McqTask(RunRequest):
    options: dict[str, str] = Field(min_length=2, max_length=10, description="letter → option text")
    expected_answer: str = Field(description="the letter of the correct option")

    @field_validator("options")
    @classmethod
    def _letter_keys(cls, options: dict[str, str]) -> dict[str, str]:
        for key, text in options.items():
            if not LETTER_KEY.fullmatch(key):
                raise ValueError(f"option keys must be single capital letters A-Z, got {key!r}")
            if not text.strip():
                raise ValueError(f"option {key} has no text")
        return options

    @field_validator("expected_answer")
    @classmethod
    def _one_of_the_options(cls, value: str, info: ValidationInfo) -> str:
        letter = value.strip().upper()
        options = info.data.get("options")
        if options is None:  # options were invalid: that error is reported on its own
            return letter
        if letter not in options:
            raise ValueError(f"must be one of the option letters {', '.join(options)}, got {value!r}")
        return letter


def _normalize_text(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .!?;:'\"“”‘’*_`")


def clean(answer: str) -> str:
    """The answer with LaTeX text wrappers and math delimiters removed: "$\\textbf{(B)}$" → "(B)"."""
    text = answer
    for _ in range(3):  # nested wrappers: \text{\textbf{B}}
        text = LATEX_WRAPPER.sub(r"\1", text)
    return text.replace("$", " ").replace("\\(", " ").replace("\\)", " ")




def _is_word_use(letter: str, following: str) -> bool:
    """Whether a capital A or I followed by `following` is the article or the pronoun."""
    if letter not in "AI":
        return False
    word = re.match(r"\s+([a-z]+)", following)
    if word is None:
        return False
    verb = word.group(1)
    if letter == "I" and verb in PRONOUN_VERBS:
        return True
    return verb not in LETTER_VERBS


def _opens_with_option_text(fragment: str, options: dict[str, str]) -> str | None:
    normalized = _normalize_text(fragment)
    # Longest first, so "Paris, Texas" wins over "Paris".
    for letter, text in sorted(options.items(), key=lambda item: -len(item[1])):
        option_text = _normalize_text(text)
        if len(option_text) >= 2 and normalized.startswith(option_text):
            rest = normalized[len(option_text):]
            if not rest or not rest[0].isalnum():
                return letter
    return None


def resolve_fragment(fragment: str, options: dict[str, str], *, pronoun_check: bool = False) -> str | None:
    """The option a fragment opens with: a letter ("B", "(B) ...", "b.") or an option's text."""
    fragment = fragment[:300]
    # An option's text first, so "Vitamin C" or "Both A and B" is not read as C or A; tried before
    # and after the filler words are dropped ("The Eiffel Tower" starts with "the").
    chosen = _opens_with_option_text(fragment.strip(" \t*_`\"'“”‘’:=>([{"), options)
    fragment = LEADING_NOISE.sub("", fragment, count=1)
    if chosen is None and fragment:
        chosen = _opens_with_option_text(fragment, options)
    if chosen is not None or not fragment:
        return chosen
    match = re.match(r"([A-Za-z])(?![A-Za-z0-9'’])", fragment)
    if match is None or match.group(1).upper() not in options:
        return None
    letter, following = match.group(1), fragment[1:]
    if letter.isupper():
        if (pronoun_check or letter == "I") and _is_word_use(letter, following):
            return None
        return letter
    # Lower case only when it stands alone: the end, or punctuation, not another word ("a prime").
    return letter.upper() if re.match(r"\s*$|[)\].,;:!?*_`\"'”’]", following) else None


def _statement_fragment(text: str, end: int) -> str:
    """What follows an answer statement: the rest of its line, or the next line after "Answer:"."""
    line, _, after = text[end:].partition("\n")
    if ":" in line and not LEADING_NOISE.sub("", line, count=1).strip():
        return after.lstrip().split("\n", 1)[0]
    return line


def _mask_option_texts(text: str, options: dict[str, str]) -> str:
    """Blank out quoted option texts, so the letters inside "Vitamin C" or "Both A and B" do not count."""
    for option in sorted(options.values(), key=len, reverse=True):
        if len(option.strip()) >= 2:
            pattern = re.compile(r"(?<!\w)" + re.escape(option.strip()) + r"(?!\w)", re.IGNORECASE)
            text = pattern.sub(lambda m: " " * len(m.group(0)), text)
    return text


def _mask_option_list(text: str, options: dict[str, str]) -> str:
    """Blank out a repeated list of the options ("A) London ... D) Berlin"), when two or more are
    listed with their labels: listing the options is not choosing the last one."""
    listed: list[tuple[int, int]] = []
    letters: set[str] = set()
    for letter, option in options.items():
        pattern = rf"[(\[]?\b{letter}\s*[)\].:]\s*(?i:{re.escape(option.strip())})(?!\w)"
        for match in re.finditer(pattern, text):
            listed.append(match.span())
            letters.add(letter)
    if len(letters) < 2:
        return text
    for start, end in listed:
        text = text[:start] + " " * (end - start) + text[end:]
    return text


def extract_choice(answer: str, options: dict[str, str]) -> str | None:
    """The option letter the answer chooses, or None. See the module docstring for the order."""
    text = clean(answer)[-8000:]
    if not text.strip():
        return None
    # 1. The last \boxed{}.
    boxed = last_boxed(text)
    if boxed is not None:
        chosen = resolve_fragment(boxed, options)
        if chosen is not None:
            return chosen
    # 2. The last explicit answer statement that names an option.
    for statement in reversed(list(ANSWER_STATEMENT.finditer(text))):
        chosen = resolve_fragment(_statement_fragment(text, statement.end()), options)
        if chosen is not None:
            return chosen
    # 3. A label opening the answer ("B) Paris"), when no other line opens with one.
    lines = [line for line in text.splitlines() if line.strip()]
    labelled = [i for i, line in enumerate(lines) if (m := LABEL_LINE.match(line)) and m.group(1).upper() in options]
    if labelled == [0]:
        chosen = resolve_fragment(lines[0], options, pronoun_check=True)
        if chosen is not None:
            return chosen
    # 4. The last standalone letter.
    masked = _mask_option_texts(_mask_option_list(text, options), options)
    candidates: list[tuple[int, str]] = []
    for match in STANDALONE_CAPITAL.finditer(masked):
        letter = match.group(1)
        if letter in options and not _is_word_use(letter, masked[match.end():match.end() + 40]):
            candidates.append((match.start(), letter))
    for match in BRACKETED_LOWER.finditer(masked):
        if match.group(1).upper() in options:
            candidates.append((match.start(), match.group(1).upper()))
    if candidates:
        return max(candidates)[1]
    # 5. The option whose text is quoted last.
    unlisted = _mask_option_list(text, options)
    quoted: list[tuple[int, int, str]] = []
    for letter, option in options.items():
        pattern = re.compile(r"(?<!\w)" + re.escape(option.strip()) + r"(?!\w)", re.IGNORECASE)
        for match in pattern.finditer(unlisted):
            quoted.append((match.end(), len(option), letter))
    return max(quoted)[2] if quoted else None


def mcq_reward(answer: str, options: dict[str, str], expected: str) -> tuple[float, str | None]:
    """(1.0 if the chosen letter is `expected` else 0.0, the chosen letter or None)."""
    chosen = extract_choice(answer, options)
    return (1.0 if chosen == expected else 0.0), chosen


class McqServer(ResourcesServer):
    task_model = McqTask

    async def verify(self, request: McqTask, state: dict[str, Any]) -> Verdict:
        answer = final_message_text(request.response.output)
        reward, chosen = mcq_reward(answer, request.options, request.expected_answer)
        return Verdict(reward=reward, details={"extracted": chosen})
