"""mcq: letter extraction, the reward, task validation, and the server over real HTTP."""

from __future__ import annotations


import httpx
import pytest

from resources_servers.mcq.app import McqServer, extract_choice, mcq_reward
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, serve_in_thread

ENV = env_folder(__file__)
DATA = ENV.examples

CITIES = {"A": "London", "B": "Paris", "C": "Rome", "D": "Berlin"}


@pytest.mark.parametrize(
    ("answer", "extracted"),
    [
        # Formats that name B.
        ("(B)", "B"),
        ("Answer: B", "B"),
        ("**B**", "B"),
        ("The answer is B.", "B"),
        ("B) Paris", "B"),
        ("B. Paris", "B"),
        ("\\boxed{B}", "B"),
        ("$\\boxed{\\text{(B)}}$", "B"),
        ("The correct answer is $\\textbf{(B)}$.", "B"),
        ("B", "B"),
        ("b", "B"),
        ("(b)", "B"),
        ("b) Paris", "B"),
        ("answer: b", "B"),
        ("**Answer:** B", "B"),
        ("**Final Answer**:\n\nB", "B"),
        ("ANSWER: B", "B"),
        ("final answer = B", "B"),
        ("My answer: **(B) Paris**", "B"),
        ("The correct option is (B).", "B"),
        ("Paris", "B"),                                         # the option's text, verbatim
        ("The answer is Paris.", "B"),
        ("It is not London; it is Paris.", "B"),
        ("Option B is correct.", "B"),
        ("A is wrong and C is wrong, so B.", "B"),              # last standalone letter
        ("I would choose B.", "B"),                             # "I" the pronoun is not option I
        ("A good guess would be B.", "B"),                      # "A" the article is not option A
        ("Looking at the answer choices, B stands out.", "B"),
        ("A) London\nB) Paris\nC) Rome\nD) Berlin\nAnswer: B", "B"),  # options repeated, then the answer
        ("Options: A) London, B) Paris, C) Rome, D) Berlin. I pick B.", "B"),
        ("What is the capital?\nA) London\nB) Paris\nC) Rome\nD) Berlin", None),  # echoing the options is no choice
        # An explicit answer statement wins over a later letter, and the last statement wins.
        ("Answer: B. (C would be wrong: Rome is in Italy.)", "B"),
        ("I first thought C, but the final answer is B", "B"),
        ("The answer is C. No wait, the answer is B.", "B"),
        ("First \\boxed{C}, corrected: \\boxed{B}", None),  # boxes that disagree: no answer (as in math)
        # Other letters, and nothing.
        ("The answer is A.", "A"),
        ("a", "A"),
        ("Answer: c)", "C"),
        ("rome!", "C"),
        ("I'd say D.", "D"),
        ("the answer is a prime number", None),                 # lower-case "a" inside prose is a word
        ("a cat sat on the mat", None),
        ("I don't know.", None),
        ("", None),
        ("Answer: E", None),                                    # not an option letter
    ],
)
def test_extract_choice(answer: str, extracted: str | None) -> None:
    assert extract_choice(answer, CITIES) == extracted


@pytest.mark.parametrize(
    ("answer", "extracted"),
    [
        ("Vitamin C", "A"),                  # the letter inside an option's text is not a choice
        ("The answer is Vitamin D.", "B"),
        ("It's Both A and B", "D"),
        ("D) Both A and B", "D"),
        ("I believe Vitamin C is right", "A"),
    ],
)
def test_option_texts_that_contain_letters(answer: str, extracted: str) -> None:
    options = {"A": "Vitamin C", "B": "Vitamin D", "C": "Iron", "D": "Both A and B"}
    assert extract_choice(answer, options) == extracted


def test_ten_options_with_letter_i() -> None:
    options = {letter: f"choice number {i}" for i, letter in enumerate("ABCDEFGHIJ")}
    assert extract_choice("I think the answer is J", options) == "J"
    assert extract_choice("Answer: I think it's E", options) == "E"
    assert extract_choice("The answer is I.", options) == "I"
    assert extract_choice("I", options) == "I"


@pytest.mark.parametrize(
    ("answer", "reward", "extracted"),
    [("Answer: B", 1.0, "B"), ("Answer: C", 0.0, "C"), ("no idea", 0.0, None), ("Paris", 1.0, "B")],
)
def test_reward(answer: str, reward: float, extracted: str | None) -> None:
    assert mcq_reward(answer, CITIES, "B") == (reward, extracted)




def test_server_end_to_end_over_http() -> None:
    rows = ENV.rows()
    assert len(rows) == 5
    with serve_in_thread(McqServer(name="mcq")) as url, httpx.Client(base_url=url) as http:
        assert http.get("/tools").json() == []
        for row in rows:
            assert http.post("/seed_session", json=row).status_code == 200
            right = row["expected_answer"]
            wrong = next(letter for letter in row["options"] if letter != right)
            good = http.post("/verify", json={**row, "response": final_response(f"Let me think.\nAnswer: {right}")}).json()
            assert good["reward"] == 1.0 and good["extracted"] == right
            text = http.post("/verify", json={**row, "response": final_response(row["options"][right])}).json()
            assert text["reward"] == 1.0 and text["extracted"] == right
            bad = http.post("/verify", json={**row, "response": final_response(f"Answer: {wrong}")}).json()
            assert bad["reward"] == 0.0 and bad["extracted"] == wrong
            none = http.post("/verify", json={**row, "response": final_response("I am not sure.")}).json()
            assert none["reward"] == 0.0 and none["extracted"] is None

        params = rows[0]["responses_create_params"]

        def refused(body: dict) -> str:
            answer = http.post("/seed_session", json={"responses_create_params": params, **body})
            assert answer.status_code == 422, answer.text
            return answer.json()["error"]["field"]

        options = {"A": "yes", "B": "no"}
        assert refused({"options": options, "expected_answer": "C"}) == "expected_answer"
        assert refused({"options": options, "expected_answer": ""}) == "expected_answer"
        assert refused({"options": options}) == "expected_answer"
        assert refused({"expected_answer": "A"}) == "options"
        assert refused({"options": {"A": "only one"}, "expected_answer": "A"}) == "options"
        assert refused({"options": {k: k for k in "ABCDEFGHIJK"}, "expected_answer": "A"}) == "options"
        assert refused({"options": {"A": "yes", "BB": "no"}, "expected_answer": "A"}) == "options"
        assert refused({"options": {"A": "yes", "B": " "}, "expected_answer": "A"}) == "options"
        assert refused({"options": {"A": "yes", "B": 2}, "expected_answer": "A"}) == "options.B"
        # A lower-case expected letter is the same letter.
        lower = {"responses_create_params": params, "options": options, "expected_answer": "b"}
        assert http.post("/seed_session", json=lower).status_code == 200
        assert http.post("/verify", json={**lower, "response": final_response("B")}).json()["reward"] == 1.0
        message = http.post("/seed_session", json={"responses_create_params": params, "options": options,
                                                   "expected_answer": "C"}).json()["error"]["message"]
        assert message == "field 'expected_answer': Value error, must be one of the option letters A, B, got 'C'"


def test_config_builds_both_servers() -> None:
    assert isinstance(ENV.build("mcq"), McqServer)
    assert ENV.build("mcq_agent").config.max_steps == 1
