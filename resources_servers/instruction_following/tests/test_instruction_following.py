"""instruction_following: every constraint (a passing and a failing answer), the reward, task
validation, and the server over real HTTP."""

from __future__ import annotations


import httpx
import pytest
from pydantic import TypeAdapter

from resources_servers.instruction_following.app import (
    CONSTRAINT_TYPES,
    AnyConstraint,
    InstructionFollowingServer,
    instruction_reward,
    paragraphs,
    sentences,
    words,
)
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, serve_in_thread

ENV = env_folder(__file__)
DATA = ENV.examples

CONSTRAINT = TypeAdapter(AnyConstraint)

# (constraint, an answer that meets it, an answer that does not)
CASES: list[tuple[dict, str, str]] = [
    ({"type": "word_count", "min_words": 3}, "one two three", "one two"),
    ({"type": "word_count", "max_words": 4}, "it's a well-known fact", "one two three four five"),
    ({"type": "word_count", "min_words": 2, "max_words": 3}, "two words", "a b c d"),
    ({"type": "sentence_count", "min_sentences": 2}, "It rained. We stayed in!", "It rained all day."),
    ({"type": "sentence_count", "max_sentences": 1}, "Pi is about 3.14 today.", "One. Two? Three!"),
    ({"type": "include_keywords", "keywords": ["cat", "dog"]}, "The Cat chased the dog.", "The cat slept; a catalog fell."),
    ({"type": "exclude_keywords", "keywords": ["easy"]}, "This is uneasy but doable.", "This is Easy."),
    ({"type": "keyword_frequency", "keyword": "run", "relation": "at_least", "frequency": 2}, "Run, run, run!", "I run daily."),
    ({"type": "keyword_frequency", "keyword": "run", "relation": "at_most", "frequency": 1}, "I run; I am a runner.", "run run"),
    ({"type": "keyword_frequency", "keyword": "new york", "relation": "exactly", "frequency": 1}, "I love New\nYork.", "no city"),
    ({"type": "json_format"}, '{"title": "Emma", "year": 1815}', 'Here it is: {"title": "Emma"}'),
    ({"type": "json_format"}, '```json\n{"a": [1, 2]}\n```', "```json\n{a: 1}\n```"),
    ({"type": "bullet_count", "count": 2}, "Intro\n* first\n- second", "* first\n* second\n* third"),
    ({"type": "all_lowercase"}, "all small letters, 100%.", "Not all small."),
    ({"type": "all_uppercase"}, "ALL CAPS, *REALLY*!", "ALL CAPS but one."),
    ({"type": "ends_with", "phrase": "Is there anything else I can help with?"},
     "Done.\nIs there anything else I can help with?  ", "Is there anything else I can help with? Bye."),
    ({"type": "starts_with", "phrase": "Dear"}, "  dear Sir,", "Hello, dear Sir"),
    ({"type": "paragraph_count", "count": 3}, "One.\n\nTwo.\n***\nThree.", "One.\nStill one.\n\nTwo."),
    ({"type": "no_commas"}, "No commas here.", "Yes, a comma."),
    ({"type": "title"}, "<<A Poem>>\nRoses.", "A Poem\nRoses <<>>."),
    ({"type": "highlighted_sections", "min_count": 2}, "*one* and **two**", "* bullet\n* another bullet\n*one*"),
    ({"type": "placeholder_count", "min_count": 2}, "Dear [name], at [address].", "Dear [name], at [ ]."),
    ({"type": "postscript"}, "Thanks.\n\nP.S. See you soon.", "Thanks. PS see you. P.S."),
    ({"type": "postscript", "marker": "P.P.S"}, "Bye.\nP.P.S remember the milk", "Bye.\nP.S. remember the milk"),
]


def test_every_constraint_type_has_a_case() -> None:
    assert len(CONSTRAINT_TYPES) >= 12
    assert {case[0]["type"] for case in CASES} == set(CONSTRAINT_TYPES)


@pytest.mark.parametrize(("constraint", "passing", "failing"), CASES, ids=[f"{i}-{c[0]['type']}" for i, c in enumerate(CASES)])
def test_constraint(constraint: dict, passing: str, failing: str) -> None:
    checker = CONSTRAINT.validate_python(constraint)
    assert checker.check(passing) is True
    assert checker.check(failing) is False


def test_counting_helpers() -> None:
    assert words("It's a well-known fact: 3 cats.") == ["It's", "a", "well-known", "fact", "3", "cats"]
    assert len(sentences("Hi. How are you?! Fine… thanks")) == 4
    assert len(sentences("Version 2.5 is out.")) == 1
    assert [p.strip() for p in paragraphs("a\n\n\n b \n***\n\nc\n")] == ["a", "b", "c"]


def test_reward_is_the_fraction_satisfied() -> None:
    instructions = [CONSTRAINT.validate_python(c) for c in (
        {"type": "all_lowercase"}, {"type": "no_commas"}, {"type": "word_count", "max_words": 3},
        {"type": "ends_with", "phrase": "bye"},
    )]
    reward, components = instruction_reward("hello, good bye", instructions)
    assert reward == 0.75
    assert components == {"0:all_lowercase": 1.0, "1:no_commas": 0.0, "2:word_count": 1.0, "3:ends_with": 1.0}
    assert instruction_reward("Hello, there my friend.", instructions) == (
        0.0, {"0:all_lowercase": 0.0, "1:no_commas": 0.0, "2:word_count": 0.0, "3:ends_with": 0.0})


# Known-good answers for the five example rows, in order.
GOOD = [
    "meet the bottle that goes everywhere you do. made from double-walled stainless steel it keeps water cold "
    "for a full day and coffee hot all morning. the leak-proof lid snaps shut so your bag stays dry and the "
    "wide mouth makes it simple to clean and refill.",
    "<<Application for Junior Software Engineer>>\nDear [hiring manager name],\n"
    "I am writing to apply for the junior software engineer role at [company name].\n***\n"
    "During my studies I built web services in Python and contributed to [open source project].\n***\n"
    "Thank you for your time. I look forward to hearing from you.\nP.S. My portfolio is at [portfolio link].",
    "* It strengthens your heart and lungs.\n* It improves your mood and sleep.\n"
    "* It builds muscle and protects your bones.\n* It lowers the risk of chronic disease.\n"
    "Is there anything else I can help with?",
    '```json\n{"title": "Pride and Prejudice", "author": "Jane Austen", "year": 1813}\n```',
    "RUNNER, YOU WERE BUILT FOR THIS DAY. *EVERY STEP* BRINGS YOU CLOSER TO THE FINISH. "
    "KEEP YOUR HEAD UP AND *CROSS THAT FINISH LINE* STRONG!",
]




def test_server_end_to_end_over_http() -> None:
    rows = ENV.rows()
    assert len(rows) == 5
    with serve_in_thread(InstructionFollowingServer(name="instruction_following")) as url, \
            httpx.Client(base_url=url) as http:
        assert http.get("/tools").json() == []
        for row, good_answer in zip(rows, GOOD):
            assert http.post("/seed_session", json=row).status_code == 200
            good = http.post("/verify", json={**row, "response": final_response(good_answer)}).json()
            assert good["reward"] == 1.0, good["reward_components"]
            assert list(good["reward_components"]) == [f"{i}:{c['type']}" for i, c in enumerate(row["instructions"])]
            assert good["satisfied"] == good["total"] == len(row["instructions"])
        # A known-bad answer, exactly: row 0 wants lowercase, no commas, 30-80 words, "steel" and "leak-proof".
        bad = http.post("/verify", json={**rows[0], "response": final_response("a bottle made of steel.")}).json()
        assert bad["reward"] == 0.5
        assert bad["reward_components"] == {"0:all_lowercase": 1.0, "1:no_commas": 1.0, "2:word_count": 0.0,
                                            "3:include_keywords": 0.0}
        assert bad["satisfied"] == 2 and bad["total"] == 4
        empty = http.post("/verify", json={**rows[2], "response": final_response("")}).json()
        # An empty answer would meet "never say easy" for free: it is refused, every component 0, with the reason.
        assert empty["reward"] == 0.0 and set(empty["reward_components"].values()) == {0.0}
        assert empty["reason"].startswith("empty answer")

        params = rows[0]["responses_create_params"]

        def refused(instructions: object) -> str:
            answer = http.post("/seed_session", json={"responses_create_params": params, "instructions": instructions})
            assert answer.status_code == 422, answer.text
            return answer.json()["error"]["field"]

        assert refused([{"type": "no_commas"}, {"type": "rhyme_scheme"}]) == "instructions[1].type"
        assert refused([{"count": 3}]) == "instructions[0].type"
        assert refused([{"type": 7}]) == "instructions[0].type"
        assert refused([{"type": "word_count", "min_words": -1}]) == "instructions[0].min_words"
        assert refused([{"type": "word_count", "min_wrds": 5}]) == "instructions[0].min_wrds"
        assert refused([{"type": "word_count"}]) == "instructions[0]"
        assert refused([{"type": "bullet_count"}]) == "instructions[0].count"
        assert refused([{"type": "keyword_frequency", "keyword": "x", "relation": "more", "frequency": 1}]) \
            == "instructions[0].relation"
        assert refused([]) == "instructions"
        assert refused("no_commas") == "instructions"
        missing = http.post("/seed_session", json={"responses_create_params": params})
        assert missing.status_code == 422 and missing.json()["error"]["field"] == "instructions"
        message = http.post("/seed_session", json={"responses_create_params": params,
                                                   "instructions": [{"type": "rhyme_scheme"}]}).json()["error"]["message"]
        assert message.startswith("field 'instructions[0].type': Value error, unknown constraint type 'rhyme_scheme'")


def test_config_builds_both_servers() -> None:
    assert isinstance(ENV.build("instruction_following"), InstructionFollowingServer)
    assert ENV.build("instruction_following_agent").config.max_steps == 1
