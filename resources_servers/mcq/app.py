"""mcq: a single-turn multiple-choice question; the model names one option letter.

Reward 1.0 when the letter read from the final answer is `expected_answer`, else 0.0 (also when no
letter can be read). The letter is read, in this order of precedence:

1. the `\\boxed{...}` (every box naming the same option): "\\boxed{B}", "\\boxed{\\text{(B)}}";
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

What is read is the final answer as a reader sees it: the last assistant message (none when the
response ends with a tool call), less its `<think>` reasoning, in Unicode's compatibility form
(full-width and mathematical letters are letters), without invisible characters, with a Greek or
Cyrillic capital that stands alone read as the Latin letter it looks like. Every 0 has a `reason`;
these earn 0 whatever letter they hold: an answer only inside `<think>`; several options given as
the answer ("A or B", "\\boxed{A, B}", "B (or maybe C)", "A B C D", boxes that disagree, answer
statements naming three or more options); an answer that only restates the prompt; "not B" (a
negated letter is not a choice).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from rollgym import ResourcesServer, RunRequest, Verdict
from rollgym.text import boxed_contents, final_answer_text, final_message_text, message_text, without_reasoning

LETTER_KEY = re.compile(r"[A-Z]")

# Words after a capital "A" or "I" that make it an option letter rather than an article or pronoun
# ("A is correct" vs "A cat", "I think").
LETTER_VERBS = {"is", "was", "seems", "appears", "looks", "matches", "fits", "remains", "would", "should", "must",
                "or", "and", "nor", "vs"}  # "A or B" names two options: no article stands before "or"
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
# A capital letter standing alone: no letter or digit of any script beside it ("Вторая" holds no B).
STANDALONE_CAPITAL = re.compile(r"(?<![^\W_])(?<!['’\\-])([A-Z])(?![^\W_])(?!['’])(?![-.][^\W\d_])")
BRACKETED_LOWER = re.compile(r"\(([a-z])\)")
# "not B", "isn't C", "rule out D": a letter named to be excluded is not a choice.
NEGATED = re.compile(r"(?:\b(?:not|never|except|excluding|exclude|eliminate|rule\s+out|ruled\s+out)|n't)"
                     r"\s+(?:(?:option|choice|answer)\s+)?[(\[*_`\"'“‘]*$", re.IGNORECASE)
# Greek and Cyrillic letters that look like Latin ones: read as the Latin letter when they stand alone
# ("Answer: Β" is B to a reader; "B or С" names two options).
LOOKALIKES = str.maketrans("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧАВЕКМНОРСТХІЈЅаеорсхуіјѕ", "ABEZHIKMNOPTYXABEKMHOPCTXIJSaeopcxyijs")
LONE_LOOKALIKE = re.compile(r"(?<![^\W_])([ΑΒΕΖΗΙΚΜΝΟΡΤΥΧАВЕКМНОРСТХІЈЅаеорсхуіјѕ])(?![^\W_])")
# What may stand between two options for them to be given together: "A or B", "A, B", "(B) or (C)",
# "B (or maybe C)", "A/B", "A B C D".
JOIN_TOKEN = re.compile(r"\s+|[*_`\"'“”‘’]+|[()\[\]]|[,/|&+]|and/or\b|(?:either|or|and|nor|vs|maybe|possibly|"
                        r"perhaps|probably|also|even)\b\.?", re.IGNORECASE)
CONNECTOR = re.compile(r"[,/|&+]|\b(?:or|and|nor|vs|maybe|possibly|perhaps|probably)\b", re.IGNORECASE)
MAX_STATEMENT_OPTIONS = 2  # "C. No wait, the answer is B" is a correction; three options named is a spray


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


def readable(answer: str) -> str:
    """The answer as a reader sees it: compatibility form ("Ｂ", "𝐁" → "B"), no invisible characters
    (zero-width spaces, stray combining marks), a lone Greek or Cyrillic look-alike read as its Latin letter."""
    text = unicodedata.normalize("NFKC", answer)
    text = "".join(c for c in text if unicodedata.category(c) not in ("Cf", "Mn", "Me"))
    return LONE_LOOKALIKE.sub(lambda m: m.group(1).translate(LOOKALIKES), text)


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


def _mentions(text: str, options: dict[str, str]) -> list[tuple[int, int, str]]:
    """(start, end, letter) of every option the text names: its text verbatim, a standalone capital letter
    (not the article or the pronoun, not negated), a bracketed lower-case one; in order."""
    found: list[tuple[int, int, str]] = []
    taken = [False] * len(text)
    for letter, option in sorted(options.items(), key=lambda item: -len(item[1])):
        if len(option.strip()) < 2:
            continue
        for match in re.finditer(r"(?<!\w)" + re.escape(option.strip()) + r"(?!\w)", text, re.IGNORECASE):
            if not any(taken[match.start():match.end()]):
                found.append((match.start(), match.end(), letter))
                taken[match.start():match.end()] = [True] * (match.end() - match.start())
    for pattern in (STANDALONE_CAPITAL, BRACKETED_LOWER):
        for match in pattern.finditer(text):
            letter = match.group(1).upper()
            negated = NEGATED.search(text[max(0, match.start() - 40):match.start()])
            if letter not in options or taken[match.start(1)] or negated:
                continue
            if pattern is STANDALONE_CAPITAL and _is_word_use(letter, text[match.end():match.end() + 40]):
                continue
            found.append((match.start(1), match.end(1), letter))
    return sorted(found)


def _joined(gap: str) -> bool:
    """Whether the text between two options gives them together ("A or B", "(B) or (C)", "A B")."""
    tokens = JOIN_TOKEN.findall(gap)
    if "".join(tokens) != gap:
        return False
    return not re.search(r"[()\[\]]", gap) or bool(CONNECTOR.search(gap))


def given_together(text: str, options: dict[str, str], at: int = 0) -> list[str]:
    """The options given together with the one named at or after `at` in text ("A or B" → [A, B])."""
    mentions = _mentions(text, options)
    chains: list[list[tuple[int, int, str]]] = []
    for mention in mentions:
        if chains and _joined(text[chains[-1][-1][1]:mention[0]]):
            chains[-1].append(mention)
        else:
            chains.append([mention])
    for chain in chains:
        if chain[-1][1] > at:
            return sorted({letter for _, _, letter in chain})
    return []


def read_choice(answer: str, options: dict[str, str]) -> tuple[str | None, str | None]:
    """(the option letter the answer chooses, None) or (None, why none is read). The answer is the final
    message's text less its reasoning; see the module docstring for the order and what earns nothing."""
    text = clean(readable(answer)).strip()[-8000:]
    if not text:
        return None, "empty answer"

    def one(letter: str | None, fragment: str, at: int = 0) -> tuple[str | None, str | None]:
        together = given_together(fragment, options, at)
        if len(together) > 1:
            return None, f"several options given as the answer: {', '.join(together)}"
        return letter, None

    # 1. The last \boxed{} (boxes that name different options are no answer).
    boxes = [box for box in boxed_contents(text) if box.strip()]
    if boxes:
        chosen = [resolve_fragment(box, options) for box in boxes]
        named = sorted({letter for letter in chosen if letter})
        if len(named) > 1:
            return None, f"several boxed answers that disagree: {', '.join(named)}"
        if chosen[-1] is not None:
            return one(chosen[-1], boxes[-1])
    # 2. The last explicit answer statement that names an option.
    stated: list[tuple[str, str]] = []
    for statement in ANSWER_STATEMENT.finditer(text):
        fragment = _statement_fragment(text, statement.end())
        chosen = resolve_fragment(fragment, options)
        if chosen is not None:
            stated.append((chosen, fragment))
    if len({letter for letter, _ in stated}) > MAX_STATEMENT_OPTIONS:
        return None, f"answer statements for several options: {', '.join(sorted({letter for letter, _ in stated}))}"
    if stated:
        return one(*stated[-1])
    # 3. A label opening the answer ("B) Paris"), when no other line opens with one.
    lines = [line for line in text.splitlines() if line.strip()]
    labelled = [i for i, line in enumerate(lines) if (m := LABEL_LINE.match(line)) and m.group(1).upper() in options]
    if labelled == [0]:
        chosen = resolve_fragment(lines[0], options, pronoun_check=True)
        if chosen is not None:
            return one(chosen, lines[0])
    # 4. The last standalone letter (not negated: "not B").
    masked = _mask_option_texts(_mask_option_list(text, options), options)
    candidates: list[tuple[int, str]] = []
    for match in STANDALONE_CAPITAL.finditer(masked):
        letter = match.group(1)
        if (letter in options and not _is_word_use(letter, masked[match.end():match.end() + 40])
                and not NEGATED.search(masked[max(0, match.start() - 40):match.start()])):
            candidates.append((match.start(), letter))
    for match in BRACKETED_LOWER.finditer(masked):
        if match.group(1).upper() in options and not NEGATED.search(masked[max(0, match.start() - 40):match.start()]):
            candidates.append((match.start(), match.group(1).upper()))
    if candidates:
        at, letter = max(candidates)
        return one(letter, _mask_option_list(text, options), at)
    # 5. The option whose text is quoted last.
    unlisted = _mask_option_list(text, options)
    quoted: list[tuple[int, int, str, int]] = []
    for letter, option in options.items():
        pattern = re.compile(r"(?<!\w)" + re.escape(option.strip()) + r"(?!\w)", re.IGNORECASE)
        for match in pattern.finditer(unlisted):
            if not NEGATED.search(unlisted[max(0, match.start() - 40):match.start()]):
                quoted.append((match.end(), len(option), letter, match.start()))
    if quoted:
        _, _, letter, at = max(quoted)
        return one(letter, unlisted, at)
    return None, "no option chosen"


def extract_choice(answer: str, options: dict[str, str]) -> str | None:
    """The option letter the answer chooses, or None. See the module docstring for the order."""
    return read_choice(answer, options)[0]


def prompt_text(params: Any) -> str:
    """The task's prompt: its string input, or the text of its input messages joined."""
    given = params.input
    if isinstance(given, str):
        return given
    return "\n".join(message_text(item) for item in given)


def _squeezed(text: str) -> str:
    return " ".join(readable(text).lower().split())


def restates_prompt(answer: str, prompt: str, options: dict[str, str]) -> bool:
    """Whether the answer is only a stretch of the prompt, longer than any option (the question and its
    options copied back, or the instructions): whatever letter such a copy holds, it was given, not chosen."""
    copied = _squeezed(answer)
    return len(copied) > max(40, *(len(text) + 10 for text in options.values())) and copied in _squeezed(prompt)


def mcq_verdict(answer: str, options: dict[str, str], expected: str, prompt: str = "") -> tuple[float, dict[str, Any]]:
    """(reward, details) for a final answer: 1.0 when it chooses `expected`; else 0.0 with a `reason`."""
    if not answer.strip():
        return 0.0, {"extracted": None, "reason": "empty answer"}
    text = without_reasoning(answer)
    if not text.strip():
        return 0.0, {"extracted": None, "reason": "the answer is only inside <think> reasoning"}
    if prompt and restates_prompt(text, prompt, options):
        return 0.0, {"extracted": None, "reason": "the answer restates the prompt"}
    chosen, why = read_choice(text, options)
    if chosen is None:
        return 0.0, {"extracted": None, "reason": why}
    if chosen != expected:
        return 0.0, {"extracted": chosen, "reason": f"chose {chosen}, not the expected option"}
    return 1.0, {"extracted": chosen}


def mcq_reward(answer: str, options: dict[str, str], expected: str) -> tuple[float, str | None]:
    """(1.0 if the chosen letter is `expected` else 0.0, the chosen letter or None)."""
    reward, details = mcq_verdict(answer, options, expected)
    return reward, details["extracted"]


class McqServer(ResourcesServer):
    task_model = McqTask

    async def verify(self, request: McqTask, state: dict[str, Any]) -> Verdict:
        output = request.response.output
        answer = final_answer_text(output)
        if not answer.strip() and final_message_text(output).strip():
            # An answer written before a tool call, with none after it, is no final answer.
            return Verdict(reward=0.0, details={"extracted": None, "reason": "no final answer: the response ends "
                                                "with a tool call or its output"})
        reward, details = mcq_verdict(answer, request.options, request.expected_answer,
                                      prompt_text(request.responses_create_params))
        return Verdict(reward=reward, details=details)
