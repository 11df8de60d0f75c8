"""The viewer's index: filters, sorting, growth while read, bad lines, and a million-line file."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollgym.view.index import FileChangedError, Filters, RolloutIndex
from rollgym.view.runs import Catalog, ViewError, pass_curve, summarize_run


def rollout(n: int, **extra: Any) -> dict[str, Any]:
    group = f"g{n // 4}"
    row = {
        "rollout_id": f"{group}-r{n % 4}", "group_id": group, "reward": (n % 5) / 4,
        "status": ["ok", "ok", "truncated", "max_steps"][n % 4],
        "agent_ref": {"type": "agents", "name": "weather_agent" if n % 2 else "reverse_text_agent"},
        "metrics": {"latency_s": 1.0 + n / 100, "input_tokens": 100 + n, "output_tokens": 10 + n, "turns": 1 + n % 3},
        "prefix_ok": [True, False, None][n % 3],
        "response": {"output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}],
                                 "model_version": f"v{n % 2}"}]},
    }
    row.update(extra)
    return row


def write(path: Path, rows: list[dict[str, Any]], mode: str = "wb") -> None:
    with open(path, mode) as handle:
        handle.write(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def built(path: Path) -> RolloutIndex:
    index = RolloutIndex(path)
    assert index.refresh()
    return index


def test_filters_select_exactly_the_matching_rollouts(tmp_path: Path) -> None:
    rows = [rollout(n) for n in range(40)]
    path = tmp_path / "rollouts.jsonl"
    write(path, rows)
    index = built(path)

    def lines(**filters: Any) -> list[int]:
        return index.page(Filters(**filters), limit=1000).rows

    assert lines() == list(range(40))
    assert lines(status=["truncated"]) == [n for n in range(40) if n % 4 == 2]
    assert lines(status=["truncated", "max_steps"]) == [n for n in range(40) if n % 4 >= 2]
    assert lines(reward_min=0.5, reward_max=0.75) == [n for n in range(40) if 0.5 <= (n % 5) / 4 <= 0.75]
    assert lines(group="g3") == [12, 13, 14, 15]
    assert lines(group="nope") == []
    assert lines(env="weather_agent") == [n for n in range(40) if n % 2]
    assert lines(prefix_ok=False) == [n for n in range(40) if n % 3 == 1]
    assert lines(no_tokens=True) == [n for n in range(40) if n % 3 == 2]
    assert lines(version="v0", status=["ok"]) == [n for n in range(40) if n % 2 == 0 and n % 4 < 2]
    assert index.read(13)["rollout_id"] == "g3-r1"


def test_sorting_puts_missing_values_last_and_keeps_file_order_for_ties(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    rows = [rollout(n) for n in range(10)]
    rows[3]["reward"] = None  # an odd line: no reward
    write(path, rows)
    index = built(path)
    ascending = index.page(Filters(), "reward", limit=100).rows
    descending = index.page(Filters(), "reward", True, limit=100).rows
    rewards = [rows[n]["reward"] for n in ascending]
    assert rewards[:-1] == sorted(rewards[:-1]) and ascending[-1] == 3 and descending[-1] == 3
    assert [rows[n]["reward"] for n in descending[:-1]] == sorted(rewards[:-1], reverse=True)
    assert index.page(Filters(), "group", limit=100).rows[:4] == [0, 1, 2, 3]
    assert index.page(Filters(), "line", True, 2, 3).rows == [7, 6, 5]
    with pytest.raises(ValueError, match="sort must be one of"):
        index.page(Filters(), "nonsense")


def test_lines_appended_while_reading_are_picked_up_and_a_torn_tail_waits(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    write(path, [rollout(n) for n in range(5)])
    index = built(path)
    assert index.count == 5
    torn = orjson.dumps(rollout(5))
    with open(path, "ab") as handle:
        handle.write(torn[:30])  # a collector mid-write
    assert index.refresh() and index.complete and index.count == 5 and index.bad_count == 0
    with open(path, "ab") as handle:
        handle.write(torn[30:40])  # more of it, still no newline
    index.start_background()  # the indexing thread reads it and stops: it waits for the newline, no spinning
    index._worker.join(timeout=5)
    assert not index._worker.is_alive() and index.count == 5
    with open(path, "ab") as handle:
        handle.write(torn[40:] + b"\n")
    write(path, [rollout(6)], "ab")
    assert index.refresh() and index.count == 7
    assert index.read(5)["rollout_id"] == rollout(5)["rollout_id"]
    write(path, [rollout(n) for n in range(2)])  # rewritten shorter: start over
    assert index.refresh() and index.count == 2
    path.write_bytes(b" " * 7 + orjson.dumps(rollout(0))[7:] + b"\n")  # rewritten in place, same size or not
    with pytest.raises(FileChangedError, match="changed while it was read"):
        index.read(0)
    assert index.refresh() and index.count == 0 and index.bad_count == 1


def test_bad_lines_are_counted_with_their_line_number_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(orjson.dumps(rollout(0)) + b"\n{not json\n\n[1, 2]\n" + orjson.dumps(rollout(1)) + b"\n")
    index = built(path)
    assert index.count == 2 and index.bad_count == 2 and index.blank_count == 1
    assert [b.line for b in index.bad_lines] == [2, 4]
    assert index.read(1)["rollout_id"] == rollout(1)["rollout_id"]


def test_summary_and_pass_at_k_follow_the_collectors_definitions(tmp_path: Path) -> None:
    from rollgym.rollouts.metrics import RolloutRecord, summarize

    path = tmp_path / "rollouts.jsonl"
    rows = [rollout(n, reward=float(n % 3 == 0)) for n in range(24)]
    write(path, rows)
    (catalog := Catalog([path])).run("r0").rollouts.refresh()
    summary = summarize_run(catalog.run("r0"))
    expected = summarize((RolloutRecord.from_rollout(r) for r in rows), repeats=4)
    assert summary["pass_at_k"] == {k: v for k, v in expected.items() if k.startswith("pass@")}
    assert summary["mean_reward"] == pytest.approx(expected["mean_reward"])
    assert summary["latency_s"]["p95"] == pytest.approx(expected["latency_s"]["p95"])
    assert summary["status_counts"] == expected["status_counts"]
    assert summary["tokens"] == {k: pytest.approx(expected["tokens"][k]) for k in ("input_mean", "output_mean")}
    assert pass_curve(*[__import__("numpy").array(v) for v in ([], [])], 1.0) == {}


def test_catalog_finds_runs_in_folders_and_names_what_is_wrong(tmp_path: Path) -> None:
    write(tmp_path / "a.jsonl", [rollout(0)])
    write(tmp_path / "a.failures.jsonl", [{"rollout_id": "x", "status": "timeout", "error": "slow"}])
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "b.jsonl", [rollout(1)])
    write(tmp_path / "sft.jsonl", [{"messages": []}])  # an export, not rollouts
    write(tmp_path / "curated.jsonl", [{"rollout_id": "x", "group_id": "g", "reward": 1.0, "messages": []}])
    catalog = Catalog([tmp_path])
    assert sorted(run.label.split("/")[-1] for run in catalog.runs.values()) == ["a.jsonl", "b.jsonl"]
    with pytest.raises(ViewError, match="no such file"):
        Catalog([tmp_path / "missing.jsonl"])
    training = tmp_path / "train"
    (training / "epoch-001").mkdir(parents=True)
    write(training / "epoch-001" / "rollouts.jsonl", [rollout(2, response={"output": []})])
    write(training / "history.jsonl", [{"epoch": 1, "train": {"mean_reward": 0.5}}])
    found = Catalog([training])
    (only,) = found.trainings.values()
    assert [found.runs[r].label.split("/")[-2:] for r in only.runs] == [["epoch-001", "rollouts.jsonl"]]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ViewError, match="no rollouts files"):
        Catalog([empty])


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_million_lines_first_page_under_a_second_with_bounded_memory(tmp_path: Path) -> None:
    """The first page is served while the rest is still being indexed; the index costs tens of
    bytes per line, not the file's size."""
    import httpx

    from rollgym.testing import serve_in_thread
    from rollgym.view.app import ViewServer

    lines = 1_000_000
    path = tmp_path / "big.jsonl"
    # Short lines: the cost of indexing is per line (real rollouts are longer, not more numerous).
    template = b'{"rollout_id":"g%d-r%d","group_id":"g%d","reward":%s,"status":"%s","metrics":{"latency_s":%d.5}}\n'
    statuses = [b"ok", b"ok", b"ok", b"truncated"]
    with open(path, "wb") as handle:
        for start in range(0, lines, 50_000):
            handle.write(b"".join(template % (n // 8, n % 8, n // 8, b"1.0" if n % 3 else b"0.0", statuses[n % 4], n % 7)
                                  for n in range(start, start + 50_000)))
    size_mb = path.stat().st_size / 1e6
    before = rss_mb()
    server = ViewServer(Catalog([path]))
    with serve_in_thread(server) as url, httpx.Client(base_url=url, timeout=60) as client:
        started = time.perf_counter()
        first = client.get("/api/runs/r0/rollouts", params={"limit": 50})
        first_page_s = time.perf_counter() - started
        assert first.status_code == 200, first.text
        body = first.json()
        assert [row["rollout_id"] for row in body["rows"][:2]] == ["g0-r0", "g0-r1"] and len(body["rows"]) == 50
        index = server.catalog.run("r0").rollouts
        while not index.complete:
            time.sleep(0.05)
        indexed_s = time.perf_counter() - started
        filtered_started = time.perf_counter()
        page = client.get("/api/runs/r0/rollouts", params={"status": "truncated", "sort": "reward", "desc": "true",
                                                           "offset": 200_000, "limit": 50}).json()
        filtered_s = time.perf_counter() - filtered_started
        assert page["total"] == lines // 4 and page["complete"] and len(page["rows"]) == 50
        assert all(row["status"] == "truncated" for row in page["rows"])
        column_mb = sum(a.nbytes for a in index._columns.arrays.values()) / 1e6
        grown = rss_mb() - before
    print(f"\n1M-line file ({size_mb:.0f} MB): first page {first_page_s * 1000:.0f} ms "
          f"({body['indexed']} lines indexed then), whole index {indexed_s:.1f} s, "
          f"filtered+sorted page at offset 200000 {filtered_s * 1000:.0f} ms; "
          f"index columns {column_mb:.0f} MB, RSS +{grown:.0f} MB")
    # The figure to meet is < 1 s (printed above, recorded from an idle machine); the bound leaves room for a
    # loaded CI machine and still fails a whole-file read, which takes as long as the whole index.
    assert first_page_s < min(3.0, indexed_s / 2)
    assert body["indexed"] < lines or body["complete"]
    assert column_mb < 100 and grown < 400  # far below the file held in memory as Python objects
