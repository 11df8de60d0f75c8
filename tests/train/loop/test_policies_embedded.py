"""Two policies, one program, on the real embedded model (SmolLM2-135M on llama.cpp): the relay environment's
caller and answerer (resources_servers/relay), each asking for its own model name through proxy_agent, trained
by the real grpo trainer as two LoRA adapters on one served base (`policies:` in the plan).

- The model server answers each policy's calls with the adapter loaded under its name and stamps `policy` and
  `model_version` on what it generates; a call under a name no policy claims is a 404 the agent sees.
- A run killed inside an epoch (after the caller's step was applied, during the answerer's apply) and run again
  serves each policy's own last applied adapter, does not redo a finished step, and each policy's trainer goes
  on from its own checkpoint: its optimizer step counter continues where that policy's stopped."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest
import yaml

pytest.importorskip("llama_cpp", reason="the embedded model needs llama-cpp-python (make install builds it)")
pytest.importorskip("peft", reason="the grpo trainer needs peft")
try:
    from models.llamacpp.engine import bundled_model_path

    bundled_model_path()
except Exception as exc:  # noqa: BLE001 - any reason the weights are missing
    pytest.skip(f"the bundled SmolLM2 weights are not installed: {exc}", allow_module_level=True)

from openai import AsyncOpenAI, NotFoundError  # noqa: E402

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig  # noqa: E402
from models.llamacpp.app import LlamaCppConfig, LlamaCppModel  # noqa: E402
from resources_servers.relay.app import RelayServer  # noqa: E402
from rollgym import ResourcesServerConfig  # noqa: E402
from rollgym.adapters import content_digest  # noqa: E402
from rollgym.client import ServerAddress  # noqa: E402
from rollgym.data.jsonl import read_whole_lines  # noqa: E402
from rollgym.testing import REPO_ROOT, serve_in_thread  # noqa: E402
from rollgym.train.loop import apply as apply_module  # noqa: E402
from rollgym.train.loop.epochs import TrainLoop  # noqa: E402
from rollgym.train.loop.plan import load_plan  # noqa: E402

pytestmark = pytest.mark.slow

RELAY = REPO_ROOT / "resources_servers/relay"
TASK = orjson.loads((RELAY / "data/example.jsonl").read_bytes().splitlines()[0])


async def ask_critic(task: dict[str, Any], endpoint: Any) -> str:
    """A program that asks for a model no policy claims: it gets the 404 and says what it read."""
    client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    try:
        await client.chat.completions.create(model="critic", messages=[{"role": "user", "content": "hi"}])
    except NotFoundError as exc:
        return f"404: {exc}"
    finally:
        await client.close()
    return "answered"


@pytest.fixture(scope="module")
def policy_server() -> Iterator[str]:
    model = LlamaCppModel(LlamaCppConfig(n_ctx=512, policies={"caller": {}, "answerer": {"roles": ["reporter"]}}),
                          name="policy_model")
    with serve_in_thread(model, timeout_s=120) as url:
        yield url


def test_each_call_is_its_policy_and_an_unknown_name_is_refused(policy_server: str) -> None:
    ask = {"input": "Say 42.", "max_output_tokens": 3, "temperature": 0.0}
    caller = httpx.post(f"{policy_server}/v1/responses", json={**ask, "model": "caller"}, timeout=120)
    by_role = httpx.post(f"{policy_server}/v1/responses", json={**ask, "model": "x", "metadata": {"role": "reporter"}},
                         timeout=120)
    assert caller.status_code == by_role.status_code == 200
    assert {item["policy"] for item in caller.json()["output"]} == {"caller"}
    assert {item["policy"] for item in by_role.json()["output"]} == {"answerer"}  # its role label claims it
    base = httpx.get(f"{policy_server}/v1/models").json()["data"][0]["id"]
    assert {item["model_version"] for item in caller.json()["output"]} == {base}  # no adapter yet: the base weights
    unknown = httpx.post(f"{policy_server}/v1/responses", json={**ask, "model": "critic"}, timeout=120)
    assert unknown.status_code == 404 and "'critic'" in unknown.text and "caller" in unknown.text


def test_the_agent_sees_the_refusal_of_an_unknown_model(policy_server: str) -> None:
    with ExitStack() as stack:
        registry = {"policy_model": ServerAddress(policy_server, "models"),
                    "relay": ServerAddress(stack.enter_context(serve_in_thread(
                        RelayServer(ResourcesServerConfig(), name="relay"))), "resources_servers")}
        agent = ProxyAgent(ProxyAgentConfig(
            model_server={"name": "policy_model"}, resources_server={"name": "relay"}, models=["caller", "critic"],
            agent={"kind": "callable", "target": f"{__name__}:ask_critic"}), name="relay_agent", registry=registry)
        url = stack.enter_context(serve_in_thread(agent))
        result = httpx.post(f"{url}/run", json=TASK, timeout=120).json()
    # The proxy passed the name on; the model server refused it, and the agent read why: no silent base answer.
    assert result["agent_answer"].startswith("404") and "no policy serves model 'critic'" in result["agent_answer"]
    assert result["status"] == "agent_error" and result["reward"] is None


def plan_file(tmp_path: Path) -> Path:
    sampling = {"temperature": 0.7, "max_output_tokens": 4}
    plan = {
        "output": str(tmp_path / "run"), "seed": 1,
        "stack": {"configs": [str(RELAY / "configs/relay.yaml")], "overrides": ["policy_model.n_ctx=512"],
                  "concurrency": 2},
        "policies": [{"name": "caller"}, {"name": "answerer", "args": {"learning_rate": 5.0e-4}}],
        "validation": {"input": str(RELAY / "data/validation.jsonl"), "limit": 1, "repeats": 1, "every": 2,
                       "params": sampling},
        "stages": [{"name": "grpo", "epochs": 2,
                    "collect": {"input": str(RELAY / "data/train.jsonl"), "limit": 1, "repeats": 2,
                                "params": sampling},
                    "curate": {"keep_flat_groups": True},  # a step every epoch, whatever the rewards
                    "optimize": {"trainer": "grpo", "args": {"learning_rate": 1.0e-3, "threads": 1,
                                                             "lora": {"r": 4, "alpha": 8, "layers": "top:2"}}},
                    "apply": "lora"}],
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def test_two_policies_train_apart_and_a_killed_run_resumes_each(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = plan_file(tmp_path)
    run = tmp_path / "run"
    real_apply = apply_module.Serving.apply_policy

    def killed_in_epoch_2(self: Any, policy: str, artefact: Any) -> float:
        if policy == "answerer" and artefact is not None and artefact.version == "answerer-e002":
            raise KeyboardInterrupt  # the kill: after the answerer's step finished, before it was served
        return real_apply(self, policy, artefact)

    monkeypatch.setattr(apply_module.Serving, "apply_policy", killed_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        TrainLoop(load_plan(path), progress=False).run()
    phases = orjson.loads((run / "epoch-002/phases.json").read_bytes())
    assert {"caller/apply", "answerer/optimize"} <= set(phases) and "answerer/apply" not in phases
    first_answerer_step = orjson.loads((run / "epoch-002/answerer/train/artefact.json").read_bytes())

    monkeypatch.setattr(apply_module.Serving, "apply_policy", real_apply)
    TrainLoop(load_plan(path), progress=False).run()
    history = [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines()]
    assert [line["epoch"] for line in history] == [0, 1, 2]
    # The answerer's finished step was not redone: the same artefact, recorded before the kill.
    assert orjson.loads((run / "epoch-002/answerer/train/artefact.json").read_bytes()) == first_answerer_step
    for policy in ("caller", "answerer"):
        one, two = (line["policies"][policy] for line in history[1:])
        # Each policy's own adapter, served under its own name, is the version its calls carry.
        for epoch, line in ((1, one), (2, two)):
            adapter = run / f"epoch-{epoch:03d}/{policy}/train/checkpoint/adapter"
            assert line["model_version"] == f"{policy}@{content_digest(str(adapter))}"
        # Its trainer went on from its own checkpoint: the optimizer step counter continues (the answerer's
        # process was started again by the resumed run, and restored its state from epoch 1's checkpoint).
        assert two["trainer"]["optimizer_step"] == one["trainer"]["optimizer_step"] + two["trainer"]["steps"]
        assert two["step"] == 2 and two["validation"]["rollouts"] == 1 and "validation" not in one
    assert history[1]["policies"]["caller"]["model_version"] != history[1]["policies"]["answerer"]["model_version"]
    # What each epoch collected: every call stamped with its policy and that policy's served version.
    collected = orjson.loads((run / "epoch-002/phases.json").read_bytes())["collect"]["model_versions"]
    assert collected == {p: history[1]["policies"][p]["model_version"] for p in ("caller", "answerer")}
    for row in read_whole_lines(run / "epoch-002/rollouts.jsonl"):
        calls = [item for item in row["output"] if "generation_token_ids" in item]
        assert [item["policy"] for item in calls] == ["caller", "answerer"]
        assert [item["model_version"] for item in calls] == [collected["caller"], collected["answerer"]]
        assert [s["policy"] for s in row["sequences"]] == ["caller", "answerer"]
    state = orjson.loads((run / "state.json").read_bytes())
    assert {p: s["steps"] for p, s in state["policies"].items()} == {"caller": 2, "answerer": 2}
