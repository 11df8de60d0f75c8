"""`rollgym view` in a real headless browser (Debian's chromium + chromedriver, driven by selenium),
over a real collection: the scripted backend's stack collects weather and reverse_text rollouts.

Each page is checked for what a person would see, screenshotted, and the browser console must stay
free of errors. Screenshots go to $ROLLGYM_VIEW_SCREENSHOTS when set (else the test's tmp folder).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import orjson
import pytest

from rollgym.client import ServerAddress, ServerClient
from rollgym.rollouts.collector import CollectOptions, Collector
from rollgym.testing import serve_in_thread
from rollgym.view.app import ViewServer
from rollgym.view.runs import Catalog
from rollgym.view.tokens import choose_vocabulary

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("Debian's chromium and chromium-driver are not installed (as root: apt-get install chromium "
                "chromium-driver; `make test` does it where it can)", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


async def collect(registry: dict[str, ServerAddress], agent: str, tasks: Path, output: Path, **options: Any) -> None:
    client = ServerClient(registry, timeout_s=30.0, max_retries=0)
    try:
        opts = CollectOptions(input=tasks, output=output, concurrency=4, progress=False, **options)
        await Collector(client, agent, opts, log=lambda message: None).run()
    finally:
        await client.close()


@pytest.fixture(scope="module")
def collection(scripted_agents: dict[str, ServerAddress], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A collection folder: weather (tool calls) and reverse_text rollouts, 2 repeats each, and one
    task whose agent was down (a failure with its cause); plus a training folder's history."""
    out = tmp_path_factory.mktemp("view-collection")
    weather_tasks = REPO / "resources_servers" / "weather" / "data" / "example.jsonl"
    asyncio.run(collect(scripted_agents, "weather_agent", weather_tasks, out / "weather.jsonl", repeats=2))
    reverse_tasks = REPO / "resources_servers" / "reverse_text" / "data" / "example.jsonl"
    asyncio.run(collect(scripted_agents, "reverse_text_agent", reverse_tasks, out / "reverse_text.jsonl", repeats=2))
    down = out / "down.jsonl"
    row = orjson.loads(weather_tasks.read_bytes().splitlines()[0])
    row["responses_create_params"]["input"][-1]["content"] = "What is the weather in Atlantis?"
    down.write_bytes(orjson.dumps(row) + b"\n")
    dead = {"weather_agent": ServerAddress("http://127.0.0.1:9", "agents")}
    asyncio.run(collect(dead, "weather_agent", down, out / "weather.jsonl", max_attempts=1))
    down.unlink()
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000", "--no-first-run"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def shots_folder(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("ROLLGYM_VIEW_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_pages_in_a_headless_browser(collection: Path, browser: Any, tmp_path: Path) -> None:
    shots = shots_folder(tmp_path)
    training = tmp_path / "train"
    training.mkdir()
    (training / "history.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [
        {"epoch": e, "stage": "sft", "model_version": f"lora-{e}",
         "train": {"mean_reward": 0.2 + 0.1 * e, "loss": 0.1 / (e + 1), "grad_norm": 0.3, "clip_fraction": 0.01 * e},
         "validation": {"mean_reward": 0.15 + 0.1 * e}, "phases_s": {"collect": 10.0 - e, "optimize": 4.0}}
        for e in range(4)]))
    catalog = Catalog([collection, training])
    labels = {run.label.rsplit("/", 1)[-1]: run.id for run in catalog.runs.values()}
    weather = labels["weather.jsonl"]
    wait = WebDriverWait(browser, 30)

    def show(hash_: str) -> None:
        """Go to a page and wait until the page says it has drawn it (hash changes redraw in place)."""
        browser.get(f"{url}/{hash_}")
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") == hash_)

    def css(selector: str) -> list[Any]:
        return browser.find_elements(By.CSS_SELECTOR, selector)

    with serve_in_thread(ViewServer(catalog, vocabulary=choose_vocabulary("auto"))) as url:
        # Runs: every file with its figures and charts.
        show("#/")
        cards = css(".card.run")
        assert len(cards) == 2 and "mean reward" in cards[0].text and "pass@2" in cards[0].text
        assert len(css(".run .chart canvas")) >= 6 and css('.chart[data-chart="reward histogram"] .uplot')
        browser.save_screenshot(str(shots / "1-runs.png"))

        # Rollouts table: 10 weather rollouts, the failure with its cause beside them.
        show(f"#/run/{weather}")
        assert len(css("tr.rollout")) == 10
        failures = css("table.failures")[0].text
        assert "agent_error" in failures and "127.0.0.1:9" in failures, failures
        browser.save_screenshot(str(shots / "2-rollouts.png"))

        # Filters and sorting: only rollouts with reward 1, slowest first.
        show(f"#/run/{weather}?reward_min=1&sort=latency&desc=true")
        headers = [th.text.rstrip(" ▲▼") for th in css("table.rollouts th")]
        rows = [dict(zip(headers, (cell.text for cell in row.find_elements(By.TAG_NAME, "td"))))
                for row in css("tr.rollout")]
        assert rows and {row["reward"] for row in rows} == {"1"}, rows
        latencies = [float(row["latency s"]) for row in rows]
        assert latencies == sorted(latencies, reverse=True)

        # One rollout: the tool call with its arguments, and tokens coloured by logprob.
        show(f"#/run/{weather}/rollout/0")
        call = css(".msg.tool_call")[0]
        assert call.find_element(By.CSS_SELECTOR, ".tool-name").text == "get_weather"
        assert '"city"' in call.find_element(By.CSS_SELECTOR, "pre.arguments").text
        assert css(".msg.tool_output")[0].text
        sampled = css(".tok.sampled")
        colour = sampled[0].value_of_css_property("background-color")
        assert colour.startswith("rgb") and colour not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)"), colour
        assert css(".tok.env") and css(".turn")
        assert "sampled by 'scripted'" in css(".token-view")[0].text or "no tokenizer" in css(".token-view")[0].text
        browser.save_screenshot(str(shots / "3-rollout.png"))
        browser.execute_script("document.querySelector('.token-view').scrollIntoView()")
        browser.save_screenshot(str(shots / "3-tokens.png"))

        # One group: its two rollouts side by side with rewards and advantages.
        href = css(".card a[href*='/group/']")[0].get_attribute("href")
        show(href[href.index("#"):])
        assert len(css(".member")) == 2 and "advantage" in css(".member")[0].text
        browser.save_screenshot(str(shots / "4-group.png"))

        # A training run: reward per epoch, the trainer's figures and the phase timings.
        show("#/training/t0")
        assert css('.chart[data-chart="reward per epoch"] canvas')
        assert css('.chart[data-chart="trainer per step"] canvas')
        assert css('.chart[data-chart="clipped and masked tokens"] canvas')
        table = css(".training table.epochs")[0].text
        assert "phases_s.collect" in table and "lora-3" in table and "train.grad_norm" in table
        browser.save_screenshot(str(shots / "5-training.png"))

        errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]
        assert not errors, errors
    print(f"\nscreenshots: {shots}")
