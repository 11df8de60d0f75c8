"""The transformers model server on the bundled SmolLM2-135M (fp32 on CPU), over real HTTP: token records,
processed logprobs checked against an independent forward pass, next-turn prompts, bad input, PEFT adapters.

One model load for the module; generations are a few tokens.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the transformers model server needs torch")
pytest.importorskip("transformers", reason="the transformers model server needs transformers")
pytest.importorskip("peft", reason="adapters need peft")
try:
    from rollgym.train.trainers.policy import bundled_gguf

    bundled_gguf()
except FileNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

from safetensors.numpy import save_file  # noqa: E402

from rollgym.testing import serve_in_thread  # noqa: E402

from models.transformers.app import TransformersConfig, TransformersModel  # noqa: E402
from models.transformers.engine import processed_logprobs  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER = [{"type": "function", "name": "get_weather", "strict": False, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
# SmolLM2-135M: 30 blocks, hidden 576, 9 query heads and 3 key/value heads of 64, MLP 1536.
SHAPES = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
          "self_attn.o_proj": (576, 576), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
          "mlp.down_proj": (576, 1536)}


def write_adapter(folder: Path, *, seed: int = 0, hidden: int = 576, blocks: int = 30, rank: int = 4) -> Path:
    """A PEFT LoRA folder as PEFT saves it; `hidden` other than 576 makes one for another base model."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tensors = {}
    for block in range(blocks):
        for module, (out, inp) in SHAPES.items():
            out, inp = (hidden if out == 576 else out), (hidden if inp == 576 else inp)
            prefix = f"base_model.model.model.layers.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.uniform(-1, 1, (rank, inp)).astype(np.float32) / np.sqrt(inp)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.08, (out, rank)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": sorted({m.split(".")[-1] for m in SHAPES}), "task_type": "CAUSAL_LM"}))
    return folder


@pytest.fixture(scope="module")
def served() -> Any:
    model = TransformersModel(TransformersConfig(n_ctx=1024, max_batch=8), name="policy_model")
    with serve_in_thread(model, timeout_s=300) as url:
        yield model, url


@pytest.fixture
def client(served: Any) -> Any:
    model, url = served
    with httpx.Client(base_url=url, timeout=300) as client:
        yield client
    for name in [adapter.name for adapter in model.adapters.all()]:  # each test starts from the base weights
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def respond(client: httpx.Client, **body: Any) -> dict[str, Any]:
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def record(response: dict[str, Any]) -> dict[str, Any]:
    """The generated item that carries the token record."""
    return next(item for item in response["output"] if item.get("generation_token_ids") is not None)


@torch.inference_mode()
def teacher_forced(model: Any, prompt: list[int], generation: list[int], *, temperature: float, top_p: float,
                   top_k: int = 0) -> tuple[list[float], list[float]]:
    """(processed, raw) logprobs of `generation` after `prompt`, from one forward pass over the whole sequence."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + generation], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    chosen = torch.tensor(generation, device=device).unsqueeze(-1)
    rows = len(generation)
    processed = processed_logprobs(logits, torch.full((rows,), temperature, device=device),
                                   torch.full((rows,), top_p, device=device), [top_k] * rows)
    raw = torch.log_softmax(logits, dim=-1)
    return processed.gather(-1, chosen).squeeze(-1).tolist(), raw.gather(-1, chosen).squeeze(-1).tolist()


def test_batched_generations_carry_exact_tokens_and_processed_logprobs(served: Any) -> None:
    """Three requests generated in one wave (left-padded prompts of different lengths, a KV cache): each one's
    logprobs are those of the distribution it was sampled from, as one plain forward pass over its tokens gives
    them; a seed reproduces a generation whatever it shares the wave with."""
    model, url = served
    bodies = [
        {"input": "Name three colours.", "temperature": 0.7, "top_p": 0.9, "seed": 5, "max_output_tokens": 6},
        {"input": "Write one short sentence about the sea and the sky at dawn.", "temperature": 1.3, "seed": 6,
         "max_output_tokens": 6, "top_k": 20},
        {"input": "Say hi.", "temperature": 0, "max_output_tokens": 6},
    ]

    async def together(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            replies = await asyncio.gather(*(http.post("/v1/responses", json=body) for body in items))
        assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
        return [reply.json() for reply in replies]

    waves = model.queue.waves
    results = asyncio.run(together(bodies))
    assert model.queue.waves - waves < len(bodies), "the requests were not batched"
    engine = model.engine
    for body, response in zip(bodies, results):
        item = record(response)
        prompt, generation, logprobs = item["prompt_token_ids"], item["generation_token_ids"], item["generation_log_probs"]
        assert 0 < len(generation) == len(logprobs) <= body["max_output_tokens"]
        assert response["usage"]["output_tokens"] == len(generation)
        assert response["usage"]["input_tokens"] == len(prompt)
        assert prompt == engine.render([{"role": "user", "content": body["input"]}], None)
        assert all(item["model_version"] == response["model_version"] == response["model"] for item in response["output"])
        greedy = body["temperature"] == 0
        assert item["sampling"] == {"temperature": float(body["temperature"]), "top_p": body.get("top_p", 1.0),
                                    "top_k": body.get("top_k", 0), "logprobs": "raw" if greedy else "processed"}
        processed, raw = teacher_forced(engine.model, prompt, generation, temperature=body["temperature"] or 1.0,
                                        top_p=body.get("top_p", 1.0), top_k=body.get("top_k", 0))
        assert logprobs == pytest.approx(raw if greedy else processed, abs=2e-3)
        if not greedy:  # temperature and truncation moved them: these are not the raw logprobs
            assert max(abs(a - b) for a, b in zip(logprobs, raw)) > 1e-2
    alone = respond(httpx.Client(base_url=url, timeout=300), **bodies[0])
    assert record(alone)["generation_token_ids"] == record(results[0])["generation_token_ids"]
    assert record(alone)["generation_log_probs"] == pytest.approx(record(results[0])["generation_log_probs"], abs=2e-3)


def test_a_forced_call_then_the_next_turn_extends_the_tokens(client: httpx.Client, served: Any) -> None:
    """A named tool_choice forces the call's opening (flagged in generation_forced); the echoed items make the next
    prompt the previous prompt + generation + the tool result's tokens, exactly."""
    first = respond(client, input="What is the weather in Paris?", tools=WEATHER, temperature=0.8, seed=1,
                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=24)
    item = record(first)
    engine = served[0].engine
    opening = engine.tokenize('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    generation, forced = item["generation_token_ids"], item["generation_forced"]
    assert generation[: len(opening)] == opening and forced[: len(opening)] == [1] * len(opening)
    calls = [o for o in first["output"] if o["type"] == "function_call"]
    if first["status"] == "completed":  # the JSON object closed: the close tag and the end of turn were forced
        closing = engine.closing_ids
        assert generation[-len(closing):] == closing and forced[-len(closing):] == [1] * len(closing)
        assert 0 in forced[len(opening): -len(closing)]  # the city was sampled
        assert calls and isinstance(json.loads(calls[0]["arguments"])["city"], str)
    echoed = list(first["output"])
    if calls:
        assert calls[0]["name"] == "get_weather" and first["output"][-1] is item
        echoed.append({"type": "function_call_output", "call_id": calls[0]["call_id"], "output": '{"sky": "sunny"}'})
    else:  # the model did not close the call within the budget: the next turn is a user message
        echoed.append({"role": "user", "content": "Go on."})
    second = respond(client, input=[{"role": "user", "content": "What is the weather in Paris?"}, *echoed],
                     tools=WEATHER, temperature=0.8, seed=2, max_output_tokens=4)
    head = item["prompt_token_ids"] + item["generation_token_ids"]
    new_prompt = record(second)["prompt_token_ids"]
    assert new_prompt[: len(head)] == head and len(new_prompt) > len(head)
    tail = served[0].engine.detokenize(new_prompt[len(head):])
    assert ("sunny" if calls else "Go on.") in tail


@pytest.mark.parametrize(("body", "field"), [
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "top_p": 1.5}, "top_p"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "tools": WEATHER, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "top_k": -1}, "top_k"),
    ({"input": 42}, "input"),
])
def test_bad_requests_are_4xx_naming_the_field(client: httpx.Client, body: dict[str, Any], field: str) -> None:
    reply = client.post("/v1/responses", json=body)
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["field"] == field


def test_chat_completions_models_and_chat_errors(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()["data"]
    assert [card["id"] for card in models] == ["SmolLM2-135M-Instruct.fp32"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                      "max_tokens": 5, "logprobs": True, "temperature": 0.5})
    assert chat.status_code == 200, chat.text
    answer = chat.json()
    choice = answer["choices"][0]
    assert 0 < len(choice["token_ids"]) == len(choice["logprobs"]["content"]) <= 5
    assert answer["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert answer["model_version"] == "SmolLM2-135M-Instruct.fp32" and answer["prompt_token_ids"]
    for body, field in (({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
                        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
                        ({"messages": [{"role": "user", "content": "hi"}], "seed": "x"}, "seed")):
        reply = client.post("/v1/chat/completions", json=body)
        assert 400 <= reply.status_code < 500 and reply.json()["error"]["field"] == field, reply.text
    long = client.post("/v1/responses", json={"input": "word " * 1100, "max_output_tokens": 4})
    assert long.status_code == 200 and long.json()["status"] == "incomplete"


def test_peft_adapters_load_select_and_unload(client: httpx.Client, tmp_path: Path) -> None:
    prompt = {"input": "Name three colours.", "temperature": 0, "max_output_tokens": 5}
    base = respond(client, **prompt)
    base_version = base["model_version"]
    adapter = write_adapter(tmp_path / "step-1")
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "step-1", "lora_path": str(adapter)})
    assert loaded.status_code == 200, loaded.text
    version = loaded.json()["model_version"]
    assert version.startswith("step-1@") and loaded.json()["policy"] == version
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [base_version, "step-1"]

    tuned = respond(client, **prompt)  # the latest adapter is the policy
    assert tuned["model"] == "step-1" and {item["model_version"] for item in tuned["output"]} == {version}
    assert record(tuned)["generation_log_probs"] != pytest.approx(record(base)["generation_log_probs"], abs=1e-2)
    again_base = respond(client, model=base_version, **prompt)
    assert again_base["model_version"] == base_version
    assert record(again_base)["generation_log_probs"] == pytest.approx(record(base)["generation_log_probs"], abs=1e-4)

    # Replaced in place by other weights: a new version; the old weights were freed after the requests before it.
    other = write_adapter(tmp_path / "step-2", seed=1)
    inplace = client.post("/v1/load_lora_adapter", json={"lora_name": "step-1", "lora_path": str(other),
                                                         "load_inplace": True})
    assert inplace.status_code == 200 and inplace.json()["model_version"] not in (version, base_version)
    assert respond(client, **prompt)["model_version"] == inplace.json()["model_version"]

    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "step-1"})
    assert unloaded.status_code == 200 and unloaded.json()["policy"] == base_version
    back = respond(client, **prompt)
    assert back["model_version"] == base_version
    assert record(back)["generation_log_probs"] == pytest.approx(record(base)["generation_log_probs"], abs=1e-4)


def test_failed_adapter_loads_are_4xx_and_change_nothing(client: httpx.Client, tmp_path: Path) -> None:
    prompt = {"input": "Name three colours.", "temperature": 0, "max_output_tokens": 5}
    before = respond(client, **prompt)
    cases = {
        "missing": (tmp_path / "nowhere", 404, "does not exist"),
        "not-peft": (tmp_path, 404, "adapter_config.json"),
        "other-base": (write_adapter(tmp_path / "other", hidden=960, blocks=2), 400, "cannot load the adapter"),
    }
    for name, (path, status, words) in cases.items():
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert reply.status_code == status, (name, reply.text)
        assert words in reply.text and "Traceback" not in reply.text, (name, reply.text)
        assert reply.json()["error"]["field"] == "lora_path"
    missing = client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400 and "lora_path" in missing.text
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "never"}).status_code == 404
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [before["model"]]
    after = respond(client, **prompt)
    assert record(after)["generation_log_probs"] == pytest.approx(record(before)["generation_log_probs"], abs=1e-4)


@pytest.mark.parametrize(("path", "dtype", "name"), [
    ("models/SmolLM2-135M-Instruct.Q4_1.gguf", torch.float32, "SmolLM2-135M-Instruct.fp32"),
    ("models/qwen2.5-0.5b-instruct-q8_0.gguf", torch.bfloat16, "qwen2.5-0.5b-instruct.bf16"),
    ("x/Llama-3.2-1B.F16.gguf", torch.float16, "Llama-3.2-1B.fp16"),
    ("x/plain.gguf", torch.float32, "plain.fp32"),
    ("Qwen/Qwen2.5-0.5B-Instruct", torch.bfloat16, "Qwen/Qwen2.5-0.5B-Instruct"),  # an id names its own weights
])
def test_the_base_is_named_after_the_weights_it_serves(path: str, dtype: Any, name: str) -> None:
    """A GGUF is dequantized when loaded: its quantization tag gives way to the precision served."""
    from models.transformers.app import served_name

    assert served_name(path, dtype) == name
