"""Continuous batching in the transformers model server, over real HTTP, on a small random-init Llama with the
bundled model's tokenizer (a Hugging Face folder written once per module): a request's tokens and logprobs are
the same batched as alone, a late request joins a running batch, a full queue is answered 429 with
Retry-After, and a full-weight reload changes the outputs and the model_version (a bad checkpoint, nothing).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the transformers model server needs torch")
pytest.importorskip("transformers", reason="the transformers model server needs transformers")

from rollgym.testing import serve_in_thread  # noqa: E402

from models.transformers.app import TransformersConfig, TransformersModel  # noqa: E402

pytestmark = pytest.mark.slow


def write_llama(folder: Path, tokenizer: Any, *, seed: int, hidden: int = 64, layers: int = 2) -> Path:
    """A random-init Llama-shaped checkpoint with `tokenizer`, as save_pretrained writes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # logits spread enough that temperature and top-p move the sampled distribution
        model.lm_head.weight.mul_(40)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from rollgym.train.trainers.policy import load_base

    try:  # the bundled model's tokenizer (the weights are random)
        _, tokenizer = load_base("bundled")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("tiny")
    return write_llama(root / "tiny", tokenizer, seed=0), write_llama(root / "tiny-step", tokenizer, seed=1)


@pytest.fixture(scope="module")
def served(checkpoints: tuple[Path, Path]) -> Any:
    model = TransformersModel(TransformersConfig(model_path=str(checkpoints[0]), n_ctx=256, max_batch=8, seed=3),
                              name="policy_model")
    with serve_in_thread(model, timeout_s=120) as url:
        yield model, url


def record(response: dict[str, Any]) -> dict[str, Any]:
    return next(item for item in response["output"] if "generation_token_ids" in item)


async def post_all(url: str, bodies: list[dict[str, Any]], delays: list[float] | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def one(body: dict[str, Any], delay: float) -> httpx.Response:
            await asyncio.sleep(delay)
            return await http.post("/v1/responses", json=body)

        return await asyncio.gather(*(one(b, d) for b, d in zip(bodies, delays or [0.0] * len(bodies))))


PROMPTS = ["Name three colours.", "Write one short sentence about the sea and the sky at dawn, with a boat.",
           "Say hi.", "Count from one to ten in words, then back down to one.", "Why?"]


def test_a_request_batched_gets_the_tokens_and_logprobs_it_gets_alone(served: Any) -> None:
    """Requests of other lengths and settings around it, some joining mid-way: the same tokens, and logprobs
    within float rounding, as when it runs alone (a seed's draws are its own)."""
    model, url = served
    probes = [{"input": "Name three colours.", "temperature": 0.8, "top_p": 0.9, "seed": 11, "max_output_tokens": 12},
              {"input": "Say hi.", "temperature": 0, "max_output_tokens": 10}]
    alone = [asyncio.run(post_all(url, [body]))[0].json() for body in probes]
    others = [{"input": text, "temperature": 1.0, "top_k": 50, "max_output_tokens": 4 + 5 * i}
              for i, text in enumerate(PROMPTS)]
    bodies = others[:3] + probes + others[3:]
    waves = model.queue.waves
    replies = asyncio.run(post_all(url, bodies, delays=[0, 0, 0, 0.05, 0.1, 0.15, 0.2]))
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    assert model.queue.waves - waves < len(bodies) and model.queue.largest_wave > 1, "the requests were not batched"
    for body, single, batched in zip(probes, alone, [replies[3].json(), replies[4].json()]):
        one, many = record(single), record(batched)
        assert many["generation_token_ids"] == one["generation_token_ids"], body
        assert many["generation_log_probs"] == pytest.approx(one["generation_log_probs"], abs=1e-4), body
        assert len(one["generation_token_ids"]) == body["max_output_tokens"]  # the random model never stops early


def test_a_repeated_prompt_shares_the_batch_s_prefill_and_samples_as_alone(served: Any) -> None:
    """A GRPO group: the same prompt four times (own seeds) while another prompt decodes. Its K/V are computed
    once and copied; each request's tokens are those it gets alone, logprobs within float rounding."""
    model, url = served
    group = [{"input": "Count from one to ten in words.", "temperature": 1.0, "seed": 20 + i, "max_output_tokens": 9}
             for i in range(4)]
    alone = [record(asyncio.run(post_all(url, [body]))[0].json()) for body in group[:2]]
    shared = model.queue.shared_prompts
    other = {"input": "Why?", "temperature": 1.0, "seed": 5, "max_output_tokens": 30}
    replies = asyncio.run(post_all(url, [other, *group], delays=[0, 0.05, 0.05, 0.05, 0.05]))
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    assert model.queue.shared_prompts - shared >= 3
    for one, reply in zip(alone, replies[1:3]):
        many = record(reply.json())
        assert many["generation_token_ids"] == one["generation_token_ids"]
        assert many["generation_log_probs"] == pytest.approx(one["generation_log_probs"], abs=1e-4)


def test_a_late_request_joins_the_running_batch(served: Any) -> None:
    """A short request sent while a long one decodes is answered before the long one ends, in the same batch."""
    model, url = served
    long = {"input": "Tell a long story.", "temperature": 1.0, "seed": 1, "max_output_tokens": 200}
    short = {"input": "Say hi.", "temperature": 1.0, "seed": 2, "max_output_tokens": 3}

    async def scenario() -> tuple[float, float, int]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            started = time.perf_counter()
            first = asyncio.create_task(http.post("/v1/responses", json=long))
            while not model.queue.rows:
                await asyncio.sleep(0.002)
            waves = model.queue.waves
            reply = await http.post("/v1/responses", json=short)
            short_done = time.perf_counter() - started
            assert reply.status_code == 200 and not first.done()
            joined = model.queue.waves - waves
            assert (await first).status_code == 200
            return short_done, time.perf_counter() - started, joined

    short_done, long_done, new_waves = asyncio.run(scenario())
    assert short_done < long_done and new_waves == 0


def test_overload_is_429_with_retry_after(checkpoints: tuple[Path, Path]) -> None:
    """One slot, no waiting room: a request while the slot decodes is refused with Retry-After, not queued forever."""
    model = TransformersModel(TransformersConfig(model_path=str(checkpoints[0]), n_ctx=256, max_batch=1, max_queue=0),
                              name="policy_model")
    with serve_in_thread(model, timeout_s=120) as url:
        async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                first = asyncio.create_task(http.post("/v1/responses", json={"input": "Go on.", "max_output_tokens": 200}))
                while not model.queue.rows:
                    await asyncio.sleep(0.002)
                refused = await http.post("/v1/responses", json={"input": "Me too.", "max_output_tokens": 2})
                health = await http.get("/health")
                return await first, refused, health

        first, refused, health = asyncio.run(scenario())
    assert first.status_code == 200
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1 and "capacity" in refused.json()["error"]["message"]
    assert health.json()["running"] == 1


def test_a_full_weight_reload_changes_outputs_and_version(served: Any, checkpoints: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    """POST /update_weights_from_disk with another checkpoint: new logprobs, a new model_version on answers,
    /v1/models and /health; a folder that is not a checkpoint, or one of another shape, is a 400 that changes
    nothing; reloading the first checkpoint gives back the first answers."""
    model, url = served
    body = {"input": "Say hi.", "temperature": 0, "max_output_tokens": 8}
    with httpx.Client(base_url=url, timeout=120) as http:
        before = http.post("/v1/responses", json=body).json()
        for bad in (tmp_path, write_llama(tmp_path / "wide", model.engine.tokenizer, seed=2, hidden=32)):
            refused = http.post("/update_weights_from_disk", json={"model_path": str(bad)})
            assert refused.status_code == 400 and refused.json()["error"]["field"] == "model_path", refused.text
        unchanged = http.post("/v1/responses", json=body).json()
        assert record(unchanged)["generation_token_ids"] == record(before)["generation_token_ids"]
        assert unchanged["model_version"] == before["model_version"]

        loaded = http.post("/update_weights_from_disk", json={"model_path": str(checkpoints[1])})
        assert loaded.status_code == 200, loaded.text
        version = loaded.json()["model_version"]
        assert version != before["model_version"] and version.startswith(before["model_version"] + "@")
        after = http.post("/v1/responses", json=body).json()
        assert after["model_version"] == record(after)["model_version"] == version
        assert record(after)["generation_log_probs"] != pytest.approx(record(before)["generation_log_probs"], abs=1e-3)
        assert http.get("/v1/models").json()["data"][0]["model_version"] == version
        assert http.get("/health").json()["model_version"] == version

        back = http.post("/update_weights_from_disk", json={"model_path": str(checkpoints[0]), "weight_version": "v0"})
        assert back.json()["model_version"] == "v0"
        again = http.post("/v1/responses", json=body).json()
        assert record(again)["generation_token_ids"] == record(before)["generation_token_ids"]
        assert record(again)["generation_log_probs"] == pytest.approx(record(before)["generation_log_probs"], abs=1e-5)
        assert again["model_version"] == "v0"


def test_a_request_that_waits_through_a_reload_reports_the_new_weights(served: Any,
                                                                       checkpoints: tuple[Path, Path]) -> None:
    """A request queued behind a weight reload (itself behind a running request) is sampled by the new weights and
    says so: its model_version is the reload's, not the one it found on arrival."""
    model, url = served

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            running = asyncio.create_task(http.post("/v1/responses", json={"input": "Go on.", "max_output_tokens": 200}))
            while not model.queue.rows:
                await asyncio.sleep(0.002)
            reload = asyncio.create_task(http.post("/update_weights_from_disk", json={
                "model_path": str(checkpoints[1]), "weight_version": "w1"}))
            while not any(job.call is not None for job in list(model.queue._jobs)):  # noqa: SLF001
                await asyncio.sleep(0.002)
            assert not running.done()
            waited = await http.post("/v1/responses", json={"input": "Say hi.", "max_output_tokens": 3})
            return await running, await reload, waited

    running, reload, waited = asyncio.run(scenario())
    assert reload.status_code == 200 and running.json()["model_version"] != "w1"
    assert waited.json()["model_version"] == record(waited.json())["model_version"] == "w1"
    with httpx.Client(base_url=url, timeout=120) as http:  # the first weights back, for whatever runs next
        assert http.post("/update_weights_from_disk", json={"model_path": str(checkpoints[0])}).status_code == 200


def test_steps_and_calls_run_fp32_matmuls_in_fp32_whatever_the_process_set(served: Any) -> None:
    """A trainer in the same process (co-locate mode) may have set TF32 for its steps: the server's forward
    passes and its calls still run at full fp32 ('highest'), and the process's setting is back after each."""
    model, url = served
    seen: list[str] = []
    hook = model.engine.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_float32_matmul_precision()))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        reply = asyncio.run(post_all(url, [{"input": "Say hi.", "temperature": 0, "max_output_tokens": 3}]))[0]
        assert reply.status_code == 200, reply.text
        in_call = asyncio.run(_on_worker(model, torch.get_float32_matmul_precision))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
        hook.remove()
    assert len(seen) >= 3 and set(seen) == {"highest"}  # the prefill and each decode step
    assert in_call == "highest"


async def _on_worker(model: Any, call: Any) -> Any:
    return await model.queue.run(call)
