"""models/chat_completions in front of a real vLLM (the session's `vllm_server`, conftest.py): the bundled
SmolLM2-135M in fp32, its tool-aware template, processed logprobs.

What the fake backend (rollgym.testing.scripted_vllm) cannot show: the prompt and generated token ids vLLM
reports are the ones its tokenizer and template give; its sampling logprobs are the trainer's fp32 logprobs
of the same tokens at the same temperature (within TOLERANCE, measured here); a weather rollout is one
token sequence across turns (`prefix_ok`); a PEFT adapter hot-loads and answers under its own version;
tool calls and `<think>` reasoning come out as items; `/v1/score` gives the trainer's logprobs. All on one
server, with few tokens.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WeatherServer
from rollgym.adapters import content_digest
from rollgym.client import ServerAddress
from rollgym.testing import serve_in_thread
from rollgym.testing.real_vllm import VllmServer

# The largest |vLLM logprob - trainer logprob| allowed per token: both run the same fp32 weights, with
# different kernels; measured here at 3-6e-5 (models/chat_completions/README.md, "Against a real vLLM").
TOLERANCE = 5e-4
WEATHER = json.loads((Path(__file__).parents[2] / "resources_servers/weather/data/example.jsonl")
                     .read_text().splitlines()[0])
FORCED = {"type": "function", "name": "get_weather"}
TOOLS_TEMPLATE = Path(__file__).parents[2] / "models/chat_completions/templates/smollm2_tools.jinja"


def model_server(server: VllmServer, **config: Any) -> ChatCompletionsModel:
    return ChatCompletionsModel(ChatCompletionsConfig(
        base_url=server.url, model=server.model, backend="vllm", return_token_ids=True, logprobs_mode="processed",
        max_retries=0, timeout_s=300, **config), name="policy_model")


@pytest.fixture(scope="module")
def stack(vllm_server: VllmServer) -> Iterator[dict[str, httpx.Client]]:
    """chat_completions in front of the real vLLM, the weather environment and an agent: their clients."""
    with ExitStack() as stack:
        model_url = stack.enter_context(serve_in_thread(model_server(vllm_server)))
        weather_url = stack.enter_context(serve_in_thread(WeatherServer(name="weather")))
        agent = SimpleAgent(
            SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"}, max_steps=2),
            name="agent", registry={"policy_model": ServerAddress(url=model_url, role="models"),
                                    "weather": ServerAddress(url=weather_url, role="resources_servers")})
        agent_url = stack.enter_context(serve_in_thread(agent))
        yield {"model": stack.enter_context(httpx.Client(base_url=model_url, timeout=300)),
               "agent": stack.enter_context(httpx.Client(base_url=agent_url, timeout=300)),
               "vllm": stack.enter_context(httpx.Client(base_url=vllm_server.root, timeout=300))}


@pytest.fixture(scope="module")
def trainer_model() -> Any:
    """The trainer's model: the bundled GGUF dequantized to fp32, as `rollgym train` loads it."""
    import torch

    from rollgym.train.trainers.policy import load_base

    model, _ = load_base("bundled")
    torch.set_num_threads(1)
    return model.eval()


def trainer_logprobs(model: Any, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The GRPO trainer's own logprobs of `completion` after `prompt` (its TokenLogprobs module, fp32)."""
    import torch

    from rollgym.train.trainers.token_logprobs import token_logprobs_module

    ids = torch.tensor([prompt + completion])
    start = len(prompt) - 1
    with torch.no_grad():
        out = token_logprobs_module()(model, "fp32")(
            input_ids=ids, attention_mask=torch.ones_like(ids),
            positions=torch.arange(start, start + len(completion)), targets=torch.tensor(completion),
            temperatures=torch.full((len(completion),), float(temperature)))
    return out.tolist()


def respond(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def token_item(response: dict[str, Any]) -> dict[str, Any]:
    [item] = [item for item in response["output"] if item.get("generation_token_ids") is not None]
    return item


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampling_logprobs_are_the_trainers(stack: dict[str, httpx.Client], trainer_model: Any,
                                            temperature: float) -> None:
    response = respond(stack["model"], {"input": "Name three colours.", "max_output_tokens": 12,
                                        "temperature": temperature, "seed": 7})
    item = token_item(response)
    prompt, generated, logprobs = item["prompt_token_ids"], item["generation_token_ids"], item["generation_log_probs"]
    # The prompt is vLLM's rendering of the chat (its template, its tokenizer), as /tokenize gives it.
    rendered = stack["model"].post("/tokenize", json={"input": "Name three colours."}).json()["tokens"]
    assert prompt == rendered
    assert len(generated) == len(logprobs) > 0 and all(lp <= 0.0 for lp in logprobs)
    assert item["sampling"] == {"temperature": temperature, "top_p": 1.0, "top_k": 0, "logprobs": "processed"}
    measured = gap(logprobs, trainer_logprobs(trainer_model, prompt, generated, temperature))
    print(f"T={temperature}: max |vLLM - trainer| over {len(generated)} tokens = {measured:.2e}")
    assert measured < TOLERANCE


def test_weather_rollout_is_one_token_sequence(stack: dict[str, httpx.Client]) -> None:
    # The first turn is forced to call the tool (vLLM's hermes structural tag: the call is written as the
    # template shows one); the agent then lets the model answer, on a token-id prompt (/v1/completions)
    # that extends the first turn's tokens.
    parsed_before = stack["model"].get("/backends").json()["parsing"]["generations"]
    row = json.loads(json.dumps(WEATHER))
    row["responses_create_params"].update(tool_choice=FORCED, max_output_tokens=64, temperature=0.0, seed=3)
    # strict: vLLM holds the arguments to the schema (the tiny model would write a schema of its own otherwise).
    row["responses_create_params"]["tools"][0]["strict"] = True
    reply = stack["agent"].post("/run", json=row)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert result["status"] == "ok", result.get("error")
    kinds = [item["type"] for item in result["response"]["output"]]
    assert kinds[:2] == ["function_call", "function_call_output"] and kinds[-1] == "message", kinds
    call = result["response"]["output"][0]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)
    assert result["prefix_ok"] is True and len(result["sequences"]) == 1
    sequence = result["sequences"][0]
    first, second = [item for item in result["response"]["output"] if item.get("generation_token_ids")]
    previous = first["prompt_token_ids"] + first["generation_token_ids"]
    assert second["prompt_token_ids"][:len(previous)] == previous
    assert sequence["prompt_ids"] + sequence["completion_ids"] == second["prompt_token_ids"] + second["generation_token_ids"]
    # The tool's answer is in the sequence as environment tokens (mask 0), decoded by vLLM's tokenizer.
    added = [t for t, mask in zip(sequence["completion_ids"], sequence["completion_mask"]) if mask == 0]
    text = stack["model"].post("/detokenize", json={"tokens": added}).json()["text"]
    output = result["response"]["output"][1]["output"]
    # The model ended its turn itself (<|im_end|> is its last token): only the template's newline was added.
    assert first["generation_token_ids"][-1] == 2
    assert text == f"\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # The second turn went through /v1/completions, its raw text parsed here.
    assert stack["model"].get("/backends").json()["parsing"]["generations"] == parsed_before + 1


def test_a_constrained_tokens_logprob_is_after_vllms_grammar_mask(stack: dict[str, httpx.Client],
                                                                   trainer_model: Any) -> None:
    # Why the trainer gives tokens sampled under a grammar no behaviour ratio (grpo_batch.behaviour_logprobs):
    # vLLM's logprob there is of the distribution renormalised over what the grammar admitted, log π − log Z,
    # never below the model's own log π, and above it wherever the grammar cut off some of the mass.
    body = json.loads(json.dumps(WEATHER["responses_create_params"]))
    body["tools"][0]["strict"] = True
    body.update(tool_choice=FORCED, max_output_tokens=48, temperature=1.0, seed=11)
    item = token_item(respond(stack["model"], body))
    generated, logprobs = item["generation_token_ids"], item["generation_log_probs"]
    assert item["generation_constrained"] == [1] * len(generated)
    forced = item.get("generation_forced") or [0] * len(generated)
    own = trainer_logprobs(trainer_model, item["prompt_token_ids"], generated, 1.0)
    sampled = [(mu, pi) for mu, pi, f in zip(logprobs, own, forced) if not f]
    assert sampled and all(mu >= pi - TOLERANCE for mu, pi in sampled)
    above = [mu - pi for mu, pi in sampled if mu - pi > 0.05]
    print(f"{len(above)} of {len(sampled)} sampled tokens' μ above π, by {sum(above) / max(len(above), 1):.2f} nats")
    assert above
    from rollgym.train.trainers.grpo_batch import behaviour_logprobs

    sequence = {"completion_logprobs": logprobs, "completion_constrained": item["generation_constrained"]}
    assert all(x != x for x in behaviour_logprobs(sequence))  # NaN: π_old stands in for μ


def test_reasoning_and_tool_calls_are_parsed_on_both_paths(vllm_server: VllmServer) -> None:
    # A regex (vLLM's structured outputs) makes the tiny model think, then call the tool (turn 1: the chat
    # endpoint, vLLM's hermes parser and the <think> tags read here), then think and answer (turn 2: a
    # token-id prompt on /v1/completions, its raw text parsed here by the think and hermes parsers).
    think = r"<think>\n[a-z ]{8,40}\n</think>\n\n"
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}"\}\}\n</tool_call>'
    calling = model_server(vllm_server, extra_body={"structured_outputs": {"regex": think + call}})
    answering = model_server(vllm_server, extra_body={"structured_outputs": {"regex": think + r"It is [a-z]{3,10}\."}})
    params = {key: WEATHER["responses_create_params"][key] for key in ("input", "tools")}
    with serve_in_thread(calling) as calling_url, serve_in_thread(answering) as answering_url:
        first = respond(httpx.Client(base_url=calling_url, timeout=300),
                        {**params, "max_output_tokens": 64, "temperature": 0.0})
        assert [item["type"] for item in first["output"]] == ["reasoning", "function_call"], first["output"]
        reasoning, function_call = first["output"]
        assert reasoning["summary"][0]["text"].strip() and "<think>" not in reasoning["summary"][0]["text"]
        assert function_call["name"] == "get_weather" and json.loads(function_call["arguments"])["city"][0].isupper()
        turn = [*params["input"], *first["output"],
                {"type": "function_call_output", "call_id": function_call["call_id"], "output": "sunny, 22 C"}]
        answering_client = httpx.Client(base_url=answering_url, timeout=300)
        second = respond(answering_client, {"input": turn, "tools": params["tools"], "max_output_tokens": 64,
                                            "temperature": 0.0})
        assert answering_client.get("/backends").json()["parsing"] == {
            "tool_parser": "hermes", "generations": 1, "failures": 0}
    assert [item["type"] for item in second["output"]] == ["reasoning", "message"], second["output"]
    assert second["output"][1]["content"][0]["text"].startswith("It is ")
    before = function_call["prompt_token_ids"] + function_call["generation_token_ids"]
    assert second["output"][-1]["prompt_token_ids"][:len(before)] == before


def test_a_lora_hot_loads_and_answers_under_its_version(stack: dict[str, httpx.Client], vllm_model_dir: Path,
                                                        tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base_model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    # init_lora_weights=False: B is random too, so the adapter changes the answers from the first token.
    peft = get_peft_model(base_model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False)).eval()
    adapter = tmp_path / "tiny"
    peft.save_pretrained(adapter)
    body = {"input": "Say something.", "max_output_tokens": 8, "temperature": 1.0, "seed": 11}
    base = token_item(respond(stack["model"], body))
    loaded = stack["model"].post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(adapter)})
    assert loaded.status_code == 200, loaded.text
    try:
        version = f"tiny@{content_digest(str(adapter))}"
        assert loaded.json()["model_version"] == version
        assert "tiny" in [card["id"] for card in stack["vllm"].get("/v1/models").json()["data"]]
        response = respond(stack["model"], {**body, "model": "tiny"})
        assert response["model_version"] == version
        adapted = token_item(response)
        assert adapted["model_version"] == version and adapted["prompt_token_ids"] == base["prompt_token_ids"]
        assert adapted["generation_token_ids"] != base["generation_token_ids"]
        # The adapter's answer has the PEFT model's logprobs: vLLM applied the adapter as trained.
        measured = gap(adapted["generation_log_probs"], trainer_logprobs(
            peft, adapted["prompt_token_ids"], adapted["generation_token_ids"], 1.0))
        print(f"LoRA: max |vLLM - PEFT| = {measured:.2e}")
        assert measured < TOLERANCE
    finally:
        unloaded = stack["model"].post("/v1/unload_lora_adapter", json={"lora_name": "tiny"})
        assert unloaded.status_code == 200, unloaded.text
    assert "tiny" not in [card["id"] for card in stack["vllm"].get("/v1/models").json()["data"]]


def test_score_is_the_trainers_logprobs(stack: dict[str, httpx.Client], trainer_model: Any) -> None:
    item = token_item(respond(stack["model"], {"input": "Count to five.", "max_output_tokens": 10,
                                               "temperature": 1.0, "seed": 5}))
    prompt, completion = item["prompt_token_ids"], item["generation_token_ids"]
    reply = stack["model"].post("/v1/score", json={"prompt_token_ids": prompt, "completion_token_ids": completion})
    assert reply.status_code == 200, reply.text
    scored = reply.json()["logprobs"]
    assert gap(scored, item["generation_log_probs"]) < TOLERANCE
    measured = gap(scored, trainer_logprobs(trainer_model, prompt, completion, 1.0))
    print(f"/v1/score: max |vLLM - trainer| = {measured:.2e}")
    assert measured < TOLERANCE


def shape(value: Any) -> Any:
    """A JSON value's shape: objects keep their keys (a token as a key, `token_id:N` or `N`, becomes `<token>`),
    lists their first element's shape, the rest a type name."""
    if isinstance(value, dict):
        return {("<token>" if key.removeprefix("token_id:").isdigit() else key): shape(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def differences(real: Any, fake: Any, where: str = "") -> list[str]:
    """Where the fake's shape is not the real one's: keys either lacks, or types that differ."""
    if isinstance(real, dict) and isinstance(fake, dict):
        found = [f"{where}.{key}: only the real vLLM has it" for key in real.keys() - fake.keys()]
        found += [f"{where}.{key}: only the fake has it" for key in fake.keys() - real.keys()]
        for key in real.keys() & fake.keys():
            found += differences(real[key], fake[key], f"{where}.{key}")
        return found
    if isinstance(real, list) and isinstance(fake, list):
        return differences(real[0], fake[0], f"{where}[0]") if real and fake else []
    return [] if real == fake else [f"{where}: {real} in the real vLLM, {fake} in the fake"]


def exchanges(root: str, model: str, prompt: list[int]) -> dict[str, tuple[int, Any]]:
    """The same requests to a vLLM-shaped server: name -> (status, JSON body's shape or the text's type)."""
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    token_info = {"logprobs": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    calls = {
        "models": ("GET", "/v1/models", None),
        "chat": ("POST", "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 3,
                                                  "temperature": 0.0, **token_info}),
        "chat_tool_call": ("POST", "/v1/chat/completions", {
            "model": model, "messages": messages, "tools": [tool], "max_tokens": 40, "temperature": 0.0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, **token_info}),
        "completions": ("POST", "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True}),
        "prompt_logprobs": ("POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                                        "prompt_logprobs": 0, "temperature": 1.0}),
        "context_too_long": ("POST", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "hi " * 2100}], "max_tokens": 1}),
        "tokenize_chat": ("POST", "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": True,
                                                "tools": [tool]}),
        "tokenize_text": ("POST", "/tokenize", {"model": model, "prompt": "hello", "add_special_tokens": False}),
        "detokenize": ("POST", "/detokenize", {"model": model, "tokens": prompt[:3]}),
        "load_lora_missing": ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent/x"}),
        "unload_lora_unknown": ("POST", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}),
    }
    out = {}
    with httpx.Client(base_url=root, timeout=300) as client:
        for name, (method, path, body) in calls.items():
            reply = client.request(method, path, json=body)
            try:
                out[name] = (reply.status_code, shape(reply.json()))
            except ValueError:
                out[name] = (reply.status_code, "text")
    return out


def test_the_fake_answers_in_the_real_vllms_shapes(vllm_server: VllmServer, stack: dict[str, httpx.Client]) -> None:
    from rollgym.testing import scripted_backend

    prompt = stack["model"].post("/tokenize", json={"text": "The weather in Paris is"}).json()["tokens"]
    real = exchanges(vllm_server.root, vllm_server.model, prompt)
    with scripted_backend("--max-model-len", "2048") as fake_url:
        fake = exchanges(fake_url.removesuffix("/v1"), "scripted", prompt)
    found = []
    for name in real:
        if real[name][0] != fake[name][0]:
            found.append(f"{name}: HTTP {real[name][0]} from the real vLLM, {fake[name][0]} from the fake")
        found += [f"{name}{difference}" for difference in differences(real[name][1], fake[name][1])]
    assert not found, "\n".join(found)


CONVERSATIONS = {
    "no system": [{"role": "user", "content": "Hi"}],
    "system and tools": [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny, 22 C"},
        {"role": "tool", "tool_call_id": "b", "content": "rain, 14 C"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
        {"role": "user", "content": "Thanks"}],
    "developer and tools": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "tools, no system": [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None,
                         "tool_calls": [{"id": "c", "type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "snow"}],
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@lru_cache(maxsize=1)
def smollm2_template() -> str:
    """The bundled GGUF's own chat template (its metadata, read once, without loading the model)."""
    import gguf

    from rollgym.train.trainers.policy import bundled_gguf

    field = gguf.GGUFReader(bundled_gguf()).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def embedded_rendering(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """What the embedded servers render: the tools lowered to text (rollgym.tool_calls), then the model's own
    template, compiled as the embedded server compiles templates (transformers' way)."""
    from models.llamacpp.chat_format import compile_template
    from rollgym.tool_calls import plain_tool_messages

    template, knows_tools = compile_template(smollm2_template())
    assert not knows_tools  # SmolLM2's own template renders no tools: the reason for ours
    return template.render(messages=plain_tool_messages(messages, tools), add_generation_prompt=True)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_the_tools_template_renders_as_the_embedded_servers_do(name: str) -> None:
    from models.llamacpp.chat_format import compile_template
    from rollgym.tool_calls import native_tool_messages

    tools = None if name == "no system" else [CHAT_TOOL]
    template, knows_tools = compile_template(TOOLS_TEMPLATE.read_text())
    assert knows_tools
    messages = CONVERSATIONS[name]
    rendered = template.render(messages=native_tool_messages(messages), tools=tools, add_generation_prompt=True)
    assert rendered == embedded_rendering(messages, tools)


def test_vllm_renders_with_the_tools_template(stack: dict[str, httpx.Client]) -> None:
    messages = CONVERSATIONS["system and tools"]
    by_template = stack["vllm"].post("/tokenize", json={"messages": messages, "tools": [CHAT_TOOL],
                                                        "add_generation_prompt": True}).json()["tokens"]
    by_text = stack["vllm"].post("/tokenize", json={"prompt": embedded_rendering(messages, [CHAT_TOOL]),
                                                    "add_special_tokens": False}).json()["tokens"]
    assert by_template == by_text
