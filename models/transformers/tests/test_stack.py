"""Weather rollouts through a stack started from the configs, with the transformers server as the policy:
`rollgym collect-rollouts` against the agent, and every turn's tokens extending the turn before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the transformers model server needs torch")
pytest.importorskip("transformers", reason="the transformers model server needs transformers")
try:
    from rollgym.train.trainers.policy import bundled_gguf

    bundled_gguf()
except FileNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

from rollgym import Stack, load_stack  # noqa: E402
from rollgym.schema import RolloutLine  # noqa: E402
from rollgym.testing import REPO_ROOT  # noqa: E402
from rollgym.data.records import output_items  # noqa: E402

pytestmark = pytest.mark.slow

CONFIGS = ["resources_servers/weather/configs/weather.yaml", "models/transformers/configs/transformers.yaml"]
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def registry_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = load_stack([REPO_ROOT / path for path in CONFIGS], ["policy_model.n_ctx=1024"])
    assert config.servers["policy_model"].folder == "transformers"
    running = Stack(config)
    registry = running.start(timeout_s=300)
    path = tmp_path_factory.mktemp("stack") / "registry.json"
    path.write_text(json.dumps({name: address.to_json() for name, address in registry.items()}))
    try:
        yield path
    finally:
        running.stop()


def test_weather_rollouts_carry_token_records_that_extend_each_other(registry_file: Path, tmp_path: Path) -> None:
    output = tmp_path / "weather.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "rollgym.cli", "collect-rollouts", "--registry-file", str(registry_file),
         "--agent", "weather_agent", "--input", str(REPO_ROOT / "resources_servers/weather/data/example.jsonl"),
         "--output", str(output), "--no-progress", "--limit", "2", "--repeats", "2", "--concurrency", "4",
         "--max-output-tokens", "32", "--param", f"tool_choice={json.dumps(FORCED)}", "--param", "temperature=1.0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rollouts = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rollouts) == 4
    for rollout in rollouts:
        RolloutLine.model_validate(rollout)
        assert rollout["status"] in ("ok", "max_steps", "truncated"), rollout.get("error")
        assert 0.0 <= rollout["reward"] <= 1.0
        generated = [item for item in output_items(rollout) if item.get("generation_token_ids") is not None]
        assert generated and generated[0]["generation_forced"][0] == 1  # the forced call's opening
        previous: list[int] | None = None
        for item in generated:
            assert len(item["generation_token_ids"]) == len(item["generation_log_probs"]) > 0
            assert all(lp <= 0.0 for lp in item["generation_log_probs"])
            assert item["sampling"]["logprobs"] == "processed" and item["model_version"] == "SmolLM2-135M-Instruct.fp32"
            if previous is not None:
                assert item["prompt_token_ids"][: len(previous)] == previous
            previous = item["prompt_token_ids"] + item["generation_token_ids"]
        assert rollout["prefix_ok"] is True and len(rollout["sequences"]) == 1
        sequence = rollout["sequences"][0]
        assert sequence["prompt_ids"] + sequence["completion_ids"] == previous
        if len(generated) > 1:  # the tool result went in between, as environment tokens
            assert 0 in sequence["completion_mask"]
    assert any(rollout["metrics"]["turns"] >= 2 for rollout in rollouts), [output_items(r)[0].get("content") or output_items(r)[0] for r in rollouts]
