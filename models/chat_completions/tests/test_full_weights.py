"""chat_completions reloads full weights on every vLLM backend (weights.py): pause, reload, version, resume.

The backends are the scripted backend in vLLM's shape: its `/pause`, `/resume`, `/is_paused`,
`/collective_rpc`, `/update_weight_version` and `/weight_info` answer as vLLM 0.32's dev-mode routes
(vllm/entrypoints/rl/online/api_router.py, vllm/entrypoints/serve/dev/rpc/api_router.py), and it can fail a
reload on cue, which a real vLLM cannot (tests/e2e/test_vllm_weights.py runs the sequence on a real one).
"""

from __future__ import annotations

import subprocess
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.testing import SCRIPTED_BACKEND_COMMAND, free_port, scripted_backend, serve_in_thread

RELOAD_SEQUENCE = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]


def weights_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    return path


@contextmanager
def pool(urls: list[str], **config: Any) -> Iterator[httpx.Client]:
    model = ChatCompletionsModel(ChatCompletionsConfig(base_url=urls, model="scripted", return_token_ids=True,
                                                       max_retries=0, **config), name="policy_model")
    with serve_in_thread(model) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def root(url: str) -> str:
    return url.removesuffix("/v1")


def weight_calls(url: str) -> list[tuple[str, Any]]:
    log = httpx.get(f"{root(url)}/scripted/requests").json()["requests"]
    return [(entry["path"], entry["body"]) for entry in log if entry["path"] in RELOAD_SEQUENCE]


def versions(client: httpx.Client, n: int) -> list[str]:
    return [client.post("/v1/responses", json={"input": "Reverse this text: bridge"}).json()["model_version"]
            for _ in range(n)]


def test_every_vllm_backend_pauses_reloads_names_the_version_and_resumes(tmp_path: Path) -> None:
    weights = weights_folder(tmp_path / "policy-s001")
    with ExitStack() as stack:
        urls = [stack.enter_context(scripted_backend("--token-info")) for _ in range(2)]
        client = stack.enter_context(pool(urls))
        assert set(versions(client, 2)) == {"scripted"}
        reply = client.post("/update_weights_from_disk",
                            json={"model_path": str(weights), "weight_version": "scripted@policy-s001"})
        assert reply.status_code == 200, reply.text
        assert [(b["base_url"], b["ok"]) for b in reply.json()["backends"]] == [(u, True) for u in urls]
        for url in urls:
            calls = weight_calls(url)
            assert [path for path, _ in calls] == RELOAD_SEQUENCE
            assert calls[0][1] == {"mode": "wait"}  # in-flight generations finish on the old weights
            assert calls[1][1] == {"method": "reload_weights",
                                   "kwargs": {"weights_path": str(weights), "is_checkpoint_format": True}}
            assert calls[3][1] == {"new_version": "scripted@policy-s001"}
            assert httpx.get(f"{root(url)}/weight_info").json() == {"weight_version": "scripted@policy-s001"}
            assert httpx.get(f"{root(url)}/is_paused").json() == {"is_paused": False}
        assert set(versions(client, 4)) == {"scripted@policy-s001"}
        cards = client.get("/v1/models").json()["data"]
        assert cards[0]["model_version"] == "scripted@policy-s001"
        refused = client.post("/update_weights_from_disk", json={"model_path": str(weights), "pause_mode": "later"})
        assert refused.status_code == 422 and "pause_mode" in refused.text


def test_a_backend_that_fails_the_reload_keeps_its_old_weights_and_is_tried_again_next_time(tmp_path: Path) -> None:
    first, second = weights_folder(tmp_path / "s1"), weights_folder(tmp_path / "s2")
    with ExitStack() as stack:
        failing = stack.enter_context(scripted_backend("--token-info", "--fail-reloads", "1"))
        healthy = stack.enter_context(scripted_backend("--token-info"))
        client = stack.enter_context(pool([failing, healthy], weights_check_s=0))
        reply = client.post("/update_weights_from_disk", json={"model_path": str(first), "weight_version": "m@s1"})
        assert reply.status_code == 502, reply.text
        assert f"backends[{failing}]" in reply.text and f"backends[{healthy}]" not in reply.text, reply.text
        # It was resumed and serves its old weights, under their old version; the other serves the new ones.
        assert httpx.get(f"{root(failing)}/is_paused").json() == {"is_paused": False}
        assert httpx.get(f"{root(failing)}/weight_info").json() == {"weight_version": "default"}
        assert set(versions(client, 6)) == {"scripted", "m@s1"}
        assert client.get("/v1/models").json()["data"][0]["model_version"] == "scripted"  # not every backend's
        assert [path for path, _ in weight_calls(failing)] == ["/pause", "/collective_rpc", "/resume"]
        reply = client.post("/update_weights_from_disk", json={"model_path": str(second), "weight_version": "m@s2"})
        assert reply.status_code == 200, reply.text
        assert set(versions(client, 4)) == {"m@s2"}


@contextmanager
def backend_on(port: int, shape: str = "vllm") -> Iterator[subprocess.Popen[bytes]]:
    """A scripted vLLM (or SGLang) on a fixed port (to be restarted there), until the block ends."""
    process = subprocess.Popen([*SCRIPTED_BACKEND_COMMAND, "--host", "127.0.0.1", "--port", str(port), "--token-info",
                                "--shape", shape], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert process.poll() is None and time.monotonic() < deadline, "the scripted backend did not start"
                time.sleep(0.05)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_restarted_backend_is_brought_to_the_current_weights_before_it_gets_traffic(tmp_path: Path) -> None:
    weights = weights_folder(tmp_path / "s1")
    port = free_port()
    restarted = f"http://127.0.0.1:{port}/v1"
    with ExitStack() as stack:
        first = stack.enter_context(backend_on(port))
        other = stack.enter_context(scripted_backend("--token-info"))
        client = stack.enter_context(pool([restarted, other], backend_cooldown_s=0.3))
        assert client.post("/update_weights_from_disk", json={"model_path": str(weights),
                                                              "weight_version": "m@s1"}).status_code == 200
        first.terminate()
        first.wait(timeout=10)
        assert set(versions(client, 3)) == {"m@s1"}  # the other backend answers; the first is marked down
        with backend_on(port):  # restarted: vLLM starts on its base weights, version "default"
            time.sleep(0.4)  # its cool-down ends
            assert set(versions(client, 6)) == {"m@s1"}
            assert httpx.get(f"http://127.0.0.1:{port}/weight_info").json() == {"weight_version": "m@s1"}
            calls = weight_calls(restarted)
            assert [path for path, _ in calls] == RELOAD_SEQUENCE and calls[1][1]["kwargs"]["weights_path"] == str(weights)
            served = httpx.get(f"http://127.0.0.1:{port}/scripted/requests").json()["requests"]
            paths = [entry["path"] for entry in served]
            generated = [i for i, path in enumerate(paths) if path in ("/v1/chat/completions", "/v1/completions")]
            assert generated and min(generated) > paths.index("/resume")  # no traffic before it had the weights


def test_a_restarted_sglang_backend_is_brought_to_the_current_weights_before_it_gets_traffic(tmp_path: Path) -> None:
    weights = weights_folder(tmp_path / "s1")
    port = free_port()
    restarted = f"http://127.0.0.1:{port}/v1"
    with ExitStack() as stack:
        first = stack.enter_context(backend_on(port, "sglang"))
        other = stack.enter_context(scripted_backend("--token-info", "--shape", "sglang"))
        client = stack.enter_context(pool([restarted, other], backend="sglang", backend_cooldown_s=0.3))
        assert client.post("/update_weights_from_disk", json={"model_path": str(weights),
                                                              "weight_version": "m@s1"}).status_code == 200
        first.terminate()
        first.wait(timeout=10)
        assert set(versions(client, 3)) == {"m@s1"}
        with backend_on(port, "sglang"):  # restarted: SGLang starts on its base weights, version "default"
            time.sleep(0.4)
            assert set(versions(client, 6)) == {"m@s1"}
            assert httpx.get(f"http://127.0.0.1:{port}/get_model_info").json()["weight_version"] == "m@s1"
            served = httpx.get(f"http://127.0.0.1:{port}/scripted/requests").json()["requests"]
            paths = [entry["path"] for entry in served]
            reloads = [i for i, path in enumerate(paths) if path == "/update_weights_from_disk"]
            assert len(reloads) == 1 and served[reloads[0]]["body"]["model_path"] == str(weights)
            generated = [i for i, path in enumerate(paths) if path.startswith(("/v1/", "/generate"))
                         and path != "/v1/models"]
            assert generated and min(generated) > reloads[0]  # no traffic before it had the weights


def test_an_openai_backend_cannot_reload_weights(tmp_path: Path) -> None:
    with pool(["http://127.0.0.1:9/v1"], backend="openai") as client:  # refused before any backend is called
        refused = client.post("/update_weights_from_disk", json={"model_path": str(weights_folder(tmp_path / "w"))})
        assert refused.status_code == 501 and "cannot reload weights" in refused.text
