"""The conversation panel of a rollout of several segments, over real HTTP: an openai-SDK agent behind the
proxy agent runs two sub-agents and then its weather loop (three segments, two conversations of their own);
the page gets each segment with its own model calls, the sub-agents' questions under their own segments and
not under the first call's input; and, in a headless browser when chromium is installed, the panel shows
them so (screenshot in $ROLLGYM_VIEW_SCREENSHOTS when set)."""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WeatherServer
from rollgym.client import ServerAddress
from rollgym.testing import scripted_backend, serve_in_thread
from rollgym.view.app import ViewServer
from rollgym.view.conversation import conversation_view
from rollgym.view.runs import Catalog

QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A rollouts file with one three-segment rollout of the proxy agent's `branching` fixture agent."""
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        registry = {"policy_model": ServerAddress(stack.enter_context(serve_in_thread(model)), "models"),
                    "weather": ServerAddress(stack.enter_context(serve_in_thread(WeatherServer(name="weather"))),
                                             "resources_servers")}
        config = ProxyAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"},
                                  agent={"kind": "callable",
                                         "target": "agents.proxy_agent.tests.fixture_agents:branching"})
        url = stack.enter_context(serve_in_thread(ProxyAgent(config, name="proxy_agent", registry=registry)))
        row = {"responses_create_params": {"input": [{"role": "user", "content": QUESTION}]},
               "city": "Paris", "expected": ["sunny", "22"], "rollout_id": "branching-1"}
        reply = httpx.post(f"{url}/run", json=row, timeout=60)
        assert reply.status_code == 200, reply.text
    path = tmp_path_factory.mktemp("conversation") / "rollouts.jsonl"
    path.write_bytes(orjson.dumps(reply.json()) + b"\n")
    yield path


def texts(items: list[dict[str, Any]]) -> list[str]:
    out = []
    for item in items:
        content = item.get("content")
        if item.get("type", "message") == "message":
            out.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content or []))
        else:
            out.append(item["type"])
    return out


def question(items: list[dict[str, Any]]) -> str:
    """The last user message's text among a call's input items."""
    return [text for item, text in zip(items, texts(items)) if item.get("role") == "user"][-1]


def test_each_segment_comes_with_its_own_calls(rollouts: Path) -> None:
    with serve_in_thread(ViewServer(Catalog([rollouts]))) as url, httpx.Client(base_url=url, timeout=30) as client:
        data = client.get("/api/runs/r0/rollouts/0").json()
    view = data["conversation"]
    assert view == conversation_view(data["rollout"])
    segments = view["segments"]
    assert len(segments) == len(data["tokens"]["sequences"]) == 3
    by_question = {question(s["calls"][0]["input"]): s for s in segments}
    assert set(by_question) == {"Sub-task 1: say hello", "Sub-task 2: say hello", QUESTION}
    main = by_question[QUESTION]
    # The weather loop: its tool call, then a call that sent only what it added (the tool's output).
    assert len(main["calls"]) == 2 and len(main["calls"][1]["input"]) == 1
    assert texts(main["calls"][0]["output"]) == ["function_call"]
    assert texts(main["calls"][1]["input"]) == ["function_call_output"]
    for sub in ("Sub-task 1: say hello", "Sub-task 2: say hello"):
        [call] = by_question[sub]["calls"]
        assert texts(call["output"]) and "function_call" not in texts(call["output"])
    later = [s for s in segments if s["index"] > 0]
    assert all(s["reason"] for s in later) and {s["conversation"] for s in segments} == {0, 1, 2}
    # No token ids are repeated in the panel's data: they are the token view's.
    assert not any("generation_token_ids" in item for s in segments for c in s["calls"] for item in c["output"])
    # One conversation keeps the plain panel.
    single = {**data["rollout"], "sequences": data["rollout"]["sequences"][:1]}
    assert conversation_view(single) is None


def test_the_panel_in_a_headless_browser(rollouts: Path, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
    if not (chromium and driver_path):
        pytest.skip("Debian's chromium and chromium-driver are not installed (`make browser`)")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,1700", "--no-first-run"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
    shots = Path(os.environ.get("ROLLGYM_VIEW_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    try:
        with serve_in_thread(ViewServer(Catalog([rollouts]))) as url:
            browser.get(f"{url}/#/run/r0/rollout/0")
            WebDriverWait(browser, 30).until(
                lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") == "#/run/r0/rollout/0")
            segments = browser.find_elements(By.CSS_SELECTOR, ".conversation.segmented .conv-segment")
            assert len(segments) == 3
            own = {segment.find_elements(By.CSS_SELECTOR, ".msg.user pre")[0].text: segment for segment in segments}
            assert set(own) == {"Sub-task 1: say hello", "Sub-task 2: say hello", QUESTION}
            assert own[QUESTION].find_elements(By.CSS_SELECTOR, ".msg.tool_call")
            assert not own["Sub-task 1: say hello"].find_elements(By.CSS_SELECTOR, ".msg.tool_call")
            assert "began:" in segments[1].text
            # the panel's top below the page's fixed header
            browser.execute_script("window.scrollTo(0, document.querySelector('.conversation').offsetTop - 90)")
            browser.save_screenshot(str(shots / "conversation-panel.png"))
    finally:
        browser.quit()
