"""reasoning_gym: real reasoning-gym generators and scorers, the generate/list commands, and the server
over real HTTP (alone, and behind the simple agent with a model written here)."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from resources_servers.reasoning_gym.__main__ import main
from resources_servers.reasoning_gym.app import ReasoningGymServer, ReasoningGymServerConfig
from resources_servers.reasoning_gym.generators import (
    GeneratorError,
    Generators,
    answer_of,
    generator_names,
)
from resources_servers.reasoning_gym.tasks import Mixture, generate, shares
from rollgym import ModelServer, ResponsesCreateParams, ServerAddress, build_response
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, serve_in_thread

ENV = env_folder(__file__)
ROWS = ENV.rows()
MIXTURE = ENV.path / "mixtures" / "easy.yaml"


def leg_row(**changes: Any) -> dict[str, Any]:
    return {**next(row for row in ROWS if row["dataset"] == "leg_counting"), **changes}


# --- answers and scorers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<answer>42</answer>", "42"),
        ("Think: 2+2.\n<answer> 4 </answer>", "4"),
        ("<answer>1</answer> no wait <answer>2</answer>", "2"),  # the last one counts
        ("<answer>\nnus\n</answer>", "nus"),
        ("The answer is 42.", None),
        ("<answer>42", None),
    ],
)
def test_answer_extraction(text: str, answer: str | None) -> None:
    assert answer_of(text) == answer


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("leg_counting", {"max_animals": 3}),
        ("basic_arithmetic", {"max_digits": 2}),
        ("spell_backward", {}),
        ("arc_agi", {}),  # its metadata holds tuples: a JSON round trip would make its scorer give 0.05
        ("puzzle24", {}),
    ],
)
def test_rebuilt_entry_scores_its_own_answer(name: str, config: dict[str, Any]) -> None:
    generators = Generators()
    entry = generators.entry(name, config, 5, 20, 3)
    assert generators.entry(name, config, 5, 20, 3) is entry  # cached
    assert generators.score(name, config, 5, 20, 3, entry["answer"]) == 1.0
    assert generators.score(name, config, 5, 20, 3, "certainly not this") < 1.0


def test_bad_generator_config_and_index_name_the_field() -> None:
    generators = Generators()
    cases = [
        (("leg_countin", {}, 1, 10, 0), "dataset", "did you mean 'leg_counting'"),
        (("composite", {}, 1, 10, 0), "dataset", "mixture"),
        (("leg_counting", {"max_animalz": 2}, 1, 10, 0), "dataset_config.max_animalz", "did you mean 'max_animals'"),
        (("leg_counting", {"seed": 3}, 1, 10, 0), "dataset_config.seed", "set the seed themselves"),
        (("leg_counting", {"min_animals": 5, "max_animals": 2}, 1, 10, 0), "dataset_config",
         "max_animals must be >= min_animals"),
        (("leg_counting", {}, 1, 10, 10), "index", "outside the dataset's size 10"),
    ]
    for args, field, words in cases:
        with pytest.raises(GeneratorError) as caught:
            generators.entry(*args)
        assert caught.value.field == field and words in str(caught.value)


# --- generating task rows ------------------------------------------------------------------------------


def test_shares_by_largest_remainder() -> None:
    assert shares([2, 1, 1], 8) == [4, 2, 2]
    assert shares([2, 1, 1], 5) == [3, 1, 1]
    assert shares([1, 1, 1], 2) == [1, 1, 0]


def test_generate_is_deterministic_and_splits_never_overlap(tmp_path: Path) -> None:
    def run(out: Path) -> tuple[bytes, bytes]:
        argv = ["generate", "--mixture", str(MIXTURE), "--count", "40", "--output", str(out / "train.jsonl"),
                "--validation", "12", "--validation-output", str(out / "validation.jsonl")]
        assert main(argv) == 0
        return (out / "train.jsonl").read_bytes(), (out / "validation.jsonl").read_bytes()

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert first == second
    train = [json.loads(line) for line in first[0].splitlines()]
    validation = [json.loads(line) for line in first[1].splitlines()]
    assert Counter(row["dataset"] for row in train) == {"leg_counting": 20, "basic_arithmetic": 10, "spell_backward": 10}
    assert Counter(row["dataset"] for row in validation) == {"leg_counting": 6, "basic_arithmetic": 3, "spell_backward": 3}
    questions = [row["responses_create_params"]["input"][1]["content"] for row in train + validation]
    assert len(set(questions)) == len(questions)
    for name in ("leg_counting", "basic_arithmetic", "spell_backward"):
        last_train = max(row["index"] for row in train if row["dataset"] == name)
        assert all(row["index"] > last_train for row in validation if row["dataset"] == name)
    row = train[0]
    assert "<answer>" in row["responses_create_params"]["input"][0]["content"]
    assert row["responses_create_params"]["max_output_tokens"] == 256
    # Each row rebuilds to its own question and answer.
    entry = Generators().entry(row["dataset"], row["dataset_config"], row["seed"], row["size"], row["index"])
    assert entry["question"] == row["responses_create_params"]["input"][1]["content"]
    assert entry["answer"] == row["expected_answer"]


def test_shipped_files_are_what_generate_writes(tmp_path: Path) -> None:
    assert main(["generate", "--mixture", str(MIXTURE), "--count", "5", "--output", str(tmp_path / "e.jsonl")]) == 0
    assert (tmp_path / "e.jsonl").read_bytes() == ENV.examples.read_bytes()
    argv = ["generate", "--mixture", str(ENV.path / "mixtures" / "addition.yaml"), "--count", "64",
            "--output", str(tmp_path / "t.jsonl"), "--validation", "16", "--validation-output", str(tmp_path / "v.jsonl")]
    assert main(argv) == 0
    assert (tmp_path / "t.jsonl").read_bytes() == (ENV.path / "data" / "addition_train.jsonl").read_bytes()
    assert (tmp_path / "v.jsonl").read_bytes() == (ENV.path / "data" / "addition_validation.jsonl").read_bytes()


def test_a_held_out_set_leaves_out_the_questions_of_other_files(tmp_path: Path) -> None:
    """`--exclude`: the shipped gcd test file holds none of the plan's training or validation questions,
    and is what the command in scripts/train/rg-gcd-test.yaml writes."""
    data = ENV.path / "data"
    made = [data / "gcd_train.jsonl", data / "gcd_validation.jsonl"]
    argv = ["generate", "--mixture", str(ENV.path / "mixtures" / "gcd.yaml"), "--count", "128",
            "--output", str(tmp_path / "test.jsonl"), "--exclude", *map(str, made)]
    assert main(argv) == 0
    assert (tmp_path / "test.jsonl").read_bytes() == (data / "gcd_test.jsonl").read_bytes()

    def questions(path: Path) -> set[str]:
        return {json.loads(line)["responses_create_params"]["input"][1]["content"] for line in path.open()}

    before = questions(made[0]) | questions(made[1])
    assert len(before) == 96 and len(questions(tmp_path / "test.jsonl")) == 128
    assert not questions(tmp_path / "test.jsonl") & before
    assert main([*argv[:-2], str(tmp_path / "missing.jsonl")]) == 2


def test_a_generator_listed_twice_draws_other_questions() -> None:
    mixture = Mixture.model_validate({"datasets": [{"name": "leg_counting", "config": {"max_animals": 3}},
                                                   {"name": "leg_counting", "config": {"max_animals": 3}}]})
    rows = generate(mixture, {"train": 10})["train"]
    assert sorted({row["seed"] for row in rows}) == [0, 1_000_000]
    assert len({row["responses_create_params"]["input"][1]["content"] for row in rows}) == 10


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--dataset", "leg_countin"], "unknown reasoning-gym generator 'leg_countin'"),
        (["--dataset", "leg_counting", "--set", "max_animalz=2"], "no config key 'max_animalz'"),
        (["--dataset", "leg_counting", "--config", "{\"min_animals\": 5, \"max_animals\": 2}"],
         "max_animals must be >= min_animals"),
        (["--dataset", "leg_counting", "--config", "[1]"], "--config must be a JSON object"),
        (["--dataset", "leg_counting", "--set", "min_animals=1", "--set", "max_animals=1", "--set", "max_instances=1",
          "--count", "50"], "leg_counting gave only 37 new questions"),
        (["--dataset", "leg_counting", "--system-prompt", "be brief"], "--system-prompt: is neither"),
        (["--dataset", "leg_counting", "--validation", "3"], "--validation N needs --validation-output"),
        (["--dataset", "leg_counting", "--validation", "3", "--validation-output", "OUT"], "the splits go to two files"),
        (["--mixture", "MIXTURE", "--dataset", "leg_counting"], "either --mixture FILE or --dataset NAME"),
        (["--mixture", "BAD_KEY"], "datasets[1].config.foo: basic_arithmetic has no config key 'foo'"),
        (["--mixture", "NO_NAME"], "field 'datasets[0].name': Field required"),
        (["--mixture", "MISSING"], "cannot read it"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str],
                                                   words: str) -> None:
    files = {"MIXTURE": str(MIXTURE), "MISSING": str(tmp_path / "missing.yaml")}
    (tmp_path / "bad_key.yaml").write_text("datasets:\n  - name: leg_counting\n  - name: basic_arithmetic\n"
                                           "    config: {foo: 1}\n")
    (tmp_path / "no_name.yaml").write_text("datasets:\n  - weight: 1\n")
    files.update(BAD_KEY=str(tmp_path / "bad_key.yaml"), NO_NAME=str(tmp_path / "no_name.yaml"),
                 OUT=str(tmp_path / "out.jsonl"))
    argv = [files.get(arg, arg) for arg in argv]
    if "--count" not in argv:
        argv += ["--count", "3"]
    assert main(["generate", *argv, "--output", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_list_shows_every_generator_with_an_example(capsys: pytest.CaptureFixture) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    names = generator_names()
    assert len(names) == 105 and "composite" not in names
    for name in names:
        assert f"\n{name}  [" in f"\n{out}", name
    assert "(no example" not in out
    assert out.count("\n  question: ") == len(names) and out.count("\n  answer: ") == len(names)
    assert main(["list", "leg_counting", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["dataset"] == "leg_counting" and record["config"]["max_animals"] == 10
    assert record["example"]["index"] == 0 and "legs" in record["example"]["responses_create_params"]["input"][1]["content"]
    assert main(["list", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown reasoning-gym generator 'nope'")


# --- the server over HTTP ------------------------------------------------------------------------------


def verify(http: httpx.Client, row: dict[str, Any], text: str) -> httpx.Response:
    return http.post("/verify", json={**row, "response": final_response(text)})


def test_server_end_to_end_over_http() -> None:
    server = ReasoningGymServer(name="reasoning_gym")
    with serve_in_thread(server) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/tools").json() == []
        for row in ROWS:
            assert http.post("/seed_session", json=row).status_code == 200
            good = verify(http, row, f"Step by step...\n<answer>{row['expected_answer']}</answer>")
            assert good.status_code == 200, good.text
            assert good.json()["reward"] == 1.0 and good.json()["extracted"] == row["expected_answer"]
            untagged = verify(http, row, f"The answer is {row['expected_answer']}.").json()
            assert untagged["reward"] == 0.0 and untagged["extracted"] is None
            assert untagged["reason"] == "no <answer>...</answer> in the final message"
            wrong = verify(http, row, "<answer>zzz 1000</answer>").json()
            assert wrong["reward"] < 1.0 and wrong["extracted"] == "zzz 1000"


def test_last_number_when_untagged_is_opt_in() -> None:
    row = next(row for row in ROWS if row["dataset"] == "basic_arithmetic")  # "Calculate 4 - 1."
    server = ReasoningGymServer(ReasoningGymServerConfig(untagged_answer="last_number"), name="reasoning_gym")
    with serve_in_thread(server) as url, httpx.Client(base_url=url, timeout=30) as http:
        untagged = verify(http, row, "4 - 1 = 3").json()
        assert untagged["reward"] == 1.0 and untagged["extracted"] == "3" and untagged["extracted_from"] == "last_number"
        assert verify(http, row, "3 or maybe 2").json()["reward"] == 0.0
        tagged = verify(http, row, "<answer>3</answer> not 5").json()  # tags still win
        assert tagged["reward"] == 1.0 and "extracted_from" not in tagged
        nothing = verify(http, row, "no idea").json()
        assert nothing["reward"] == 0.0 and nothing["reason"] == "no <answer>...</answer> in the final message, and no number"


def test_final_number_reads_finished_replies_only() -> None:
    """A reply cut off at max_output_tokens while restating the question ends on one of its numbers: under
    last_number that scores whenever the answer is one of them (a GRPO run learnt exactly this on lcm)."""
    row = next(row for row in ROWS if row["dataset"] == "basic_arithmetic")  # "Calculate 4 - 1."
    cut = {**final_response("To calculate 4 - 1, take 3"), "status": "incomplete",
           "incomplete_details": {"reason": "max_output_tokens"}}
    finished = {**final_response("4 - 1 = 3"), "status": "completed"}
    for mode, rewards in (("last_number", (1.0, 1.0)), ("final_number", (0.0, 1.0))):
        server = ReasoningGymServer(ReasoningGymServerConfig(untagged_answer=mode), name="reasoning_gym")
        with serve_in_thread(server) as url, httpx.Client(base_url=url, timeout=30) as http:
            answers = [http.post("/verify", json={**row, "response": response}).json() for response in (cut, finished)]
        assert [answer["reward"] for answer in answers] == list(rewards), (mode, answers)
    assert answers[0]["extracted"] is None and "cut off before a final number" in answers[0]["reason"]
    assert answers[1]["extracted"] == "3" and answers[1]["extracted_from"] == "final_number"
    cut_tagged = {**cut, "output": final_response("<answer>3</answer> and then")["output"]}
    with serve_in_thread(ReasoningGymServer(ReasoningGymServerConfig(untagged_answer="final_number"),
                                            name="reasoning_gym")) as url:
        assert httpx.post(f"{url}/verify", json={**row, "response": cut_tagged}, timeout=30).json()["reward"] == 1.0


def test_bad_rows_are_4xx_naming_the_field() -> None:
    row = leg_row()
    cases = [
        ({"dataset": "leg_countin"}, "dataset", "unknown reasoning-gym generator"),
        ({"dataset_config": {**row["dataset_config"], "legs": 3}}, "dataset_config.legs", "no config key 'legs'"),
        ({"dataset_config": {"min_animals": 4, "max_animals": 1}}, "dataset_config", "must be >= min_animals"),
        ({"index": row["size"]}, "index", "outside the dataset's size"),
        ({"index": row["index"] + 1}, "index", "another question than the row's user message"),
        ({"seed": row["seed"] + 1}, "index", "another question"),
        ({"seed": "x"}, "seed", ""),
    ]
    with serve_in_thread(ReasoningGymServer(name="reasoning_gym")) as url, httpx.Client(base_url=url, timeout=30) as http:
        missing = {key: value for key, value in row.items() if key != "dataset"}
        for route in ("/seed_session", "/verify"):
            answer = http.post(route, json={**missing, "response": final_response("<answer>2</answer>")})
            assert answer.status_code == 422 and answer.json()["error"]["field"] == "dataset"
        for change, field, words in cases:
            for route in ("/seed_session", "/verify"):
                answer = http.post(route, json={**row, **change, "response": final_response("<answer>2</answer>")})
                assert answer.status_code == 422, (change, answer.text)
                error = answer.json()["error"]
                assert error["field"] == field and words in error["message"], (change, error)


def test_a_scorer_that_raises_fails_the_verify_with_its_cause() -> None:
    server = ReasoningGymServer(name="reasoning_gym")
    row = leg_row()

    def broken(answer: str, entry: dict[str, Any]) -> float:
        raise ZeroDivisionError("division by zero in the scorer")

    with serve_in_thread(server) as url, httpx.Client(base_url=url, timeout=30) as http:
        built = server.generators.dataset(row["dataset"], row["dataset_config"], row["seed"], row["size"])
        built.dataset.score_answer = broken
        answer = verify(http, row, "<answer>2</answer>")
        assert answer.status_code == 500
        assert answer.json()["error"]["message"] == (
            "ScorerError: the leg_counting scorer raised ZeroDivisionError: division by zero in the scorer")
        built.dataset.score_answer = lambda answer, entry: None
        assert "returned None, not a number" in verify(http, row, "<answer>2</answer>").json()["error"]["message"]


class AnswerKeyModel(ModelServer):
    """Answers each question with `<answer>...</answer>` from a key (the rows' expected answers); a
    question not in the key gets an untagged reply."""

    def __init__(self, key: dict[str, str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = key

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        question = payload["input"][-1]["content"]
        text = f"<answer>{self.key[question]}</answer>" if question in self.key else "I am not sure."
        output = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}]
        return build_response(payload, output, model="key", usage={"input_tokens": 5, "output_tokens": 3})


def test_rollouts_through_the_simple_agent() -> None:
    key = {row["responses_create_params"]["input"][1]["content"]: row["expected_answer"] for row in ROWS[:4]}
    env = ENV.build("reasoning_gym")
    assert isinstance(env, ReasoningGymServer) and isinstance(env.config, ReasoningGymServerConfig)
    with ExitStack() as stack:
        model_url = stack.enter_context(serve_in_thread(AnswerKeyModel(key, name="policy_model")))
        env_url = stack.enter_context(serve_in_thread(env))
        agent = SimpleAgent(
            SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "reasoning_gym"},
                              max_steps=1),
            name="agent",
            registry={"policy_model": ServerAddress(url=model_url, role="models"),
                      "reasoning_gym": ServerAddress(url=env_url, role="resources_servers")},
        )
        http = stack.enter_context(httpx.Client(base_url=stack.enter_context(serve_in_thread(agent)), timeout=30))
        results = [http.post("/run", json=row).json() for row in ROWS]
        assert [(r["status"], r["reward"]) for r in results] == [("ok", 1.0)] * 4 + [("ok", 0.0)]
        assert results[4]["reason"] == "no <answer>...</answer> in the final message"
        env.generators.dataset(ROWS[0]["dataset"], ROWS[0]["dataset_config"], ROWS[0]["seed"],
                               ROWS[0]["size"]).dataset.score_answer = lambda answer, entry: 1 / 0
        failed = http.post("/run", json=ROWS[0]).json()
        assert failed["status"] == "env_error" and failed["reward"] is None
        assert "the leg_counting scorer raised ZeroDivisionError" in failed["error"]


def test_config_builds_both_servers() -> None:
    assert ENV.build("reasoning_gym").config.scoring_workers == 2
    assert ENV.build("reasoning_gym", "reasoning_gym.resources_servers.reasoning_gym.untagged_answer=last_number"
                     ).config.untagged_answer == "last_number"
    assert ENV.build("reasoning_gym_agent").config.max_steps == 1
