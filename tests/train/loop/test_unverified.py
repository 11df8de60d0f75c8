"""Rollouts collected with skip_verification (reward null, verification "skipped") in curation, the plan and
`rollgym export`: reward-based data refuses them with a counted reason; plain SFT keeps them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollgym.data.export import export_file
from rollgym.train.loop.curation import CurateConfig, curate
from rollgym.train.loop.plan import PlanError, load_plan
from rollgym.testing import REPO_ROOT

from tests.train.loop.test_curation import group


def unverified(name: str, count: int) -> list[dict[str, Any]]:
    return [{**r, "verification": "skipped"} for r in group(name, [None] * count)]


@pytest.mark.parametrize("kind", ["groups", "preferences"])
def test_reward_based_data_drops_unverified_rollouts_by_name(kind: str) -> None:
    rows = unverified("u", 4) + group("v", [1.0, 0.0, 1.0, 0.0]) + [group("f", [None])[0]]  # f: a failure
    result = curate(rows, kind, CurateConfig(), group_size=4)
    assert result.dropped["unverified"] == 4 and result.dropped["failed"] == 1
    assert result.records and {r["group_id"] for r in result.records} == {"v"}


def test_sft_keeps_unverified_rollouts_unless_a_key_reads_rewards() -> None:
    rows = unverified("u", 2) + group("v", [1.0, 0.0])
    result = curate(rows, "sft", CurateConfig())
    assert result.rollouts_kept == 4 and not result.dropped
    assert [r["reward"] for r in result.records if r["group_id"] == "u"] == [None, None]  # not a made-up 0
    for config, kept in ((CurateConfig(min_reward=1.0), 1), (CurateConfig(top_k_per_group=1), 1),
                         (CurateConfig(min_reward_spread=0.5), 2)):
        result = curate(rows, "sft", config)
        assert result.dropped["unverified"] == 2 and result.rollouts_kept == kept


def plan_with(tmp_path: Path, **collect: Any) -> Path:
    data = yaml.safe_load((REPO_ROOT / "scripts/train/weather.yaml").read_text())
    data["output"] = str(tmp_path / "run")
    data["stack"]["configs"] = [str(REPO_ROOT / item) for item in data["stack"]["configs"]]
    data["validation"]["input"] = str(REPO_ROOT / data["validation"]["input"])
    for stage in data["stages"]:
        stage["collect"]["input"] = str(REPO_ROOT / stage["collect"]["input"])
    data["stages"][1]["collect"].update(collect)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_plan_refuses_skip_verification_where_training_needs_rewards(tmp_path: Path) -> None:
    assert load_plan(plan_with(tmp_path)).stages[1].collect.skip_verification is False
    with pytest.raises(PlanError, match=r"key 'stages\[1\]': collect\.skip_verification: unverified rollouts "
                                        r"\(reward null\) cannot make GRPO groups"):
        load_plan(plan_with(tmp_path, skip_verification=True))
    data = yaml.safe_load(plan_with(tmp_path).read_text())
    sft = data["stages"][0]  # rs-sft: SFT on the best rollout of each group (top_k_per_group reads rewards)
    sft["collect"]["skip_verification"] = True
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match=r"key 'stages\[0\]': collect\.skip_verification: curate\.min_reward, "
                                        r"curate\.top_k_per_group read rewards"):
        load_plan(tmp_path / "sft.yaml")
    sft["curate"] = {}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(data))
    assert load_plan(tmp_path / "sft.yaml").stages[0].collect.skip_verification is True


def test_export_sft_keeps_unverified_rollouts_and_dpo_counts_them(tmp_path: Path) -> None:
    rollouts = tmp_path / "rollouts.jsonl"
    rows = unverified("u", 2) + group("v", [1.0, 0.0])
    rollouts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    stats = export_file(rollouts, tmp_path / "sft.jsonl", "sft")
    assert stats.written == 4 and stats.no_reward == 0
    stats = export_file(rollouts, tmp_path / "sft-best.jsonl", "sft", min_reward=1.0)
    assert stats.written == 1 and stats.no_reward == 2 and stats.unverified == 2
    stats = export_file(rollouts, tmp_path / "dpo.jsonl", "dpo")
    assert stats.no_reward == 2 and stats.unverified == 2
    assert "2 without a reward (2 unverified: verification skipped)" in "\n".join(stats.lines())
