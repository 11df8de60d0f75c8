"""Environments as packages: `rollgym init --package` writes a project that pip installs; once installed
(here with `pip install --target`, a real build of its wheel), `rollgym env list` shows it beside the
folders, `rollgym test NAME` passes, and a stack config names it like a folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from rollgym.config import ConfigError, load_stack
from rollgym.testing import REPO_ROOT


def rollgym(*args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)} if site else None
    return subprocess.run([sys.executable, "-m", "rollgym.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def test_a_scaffolded_package_installs_lists_passes_rollgym_test_and_serves_by_name(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    project = tmp_path / "acme_quiz"
    created = rollgym("init", "--package", str(project))
    assert created.returncode == 0, created.stderr
    assert (project / "pyproject.toml").is_file() and (project / "acme_quiz" / "app.py").is_file()
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(project)], check=True, capture_output=True, timeout=240)
    assert (site / "acme_quiz" / "data" / "example.jsonl").is_file()  # the data folders ship in the wheel

    listed = rollgym("env", "list", "--json", site=site)
    assert listed.returncode == 0, listed.stderr
    cards = {card["name"]: card for card in map(orjson.loads, listed.stdout.splitlines())}
    assert cards["acme_quiz"]["source"] == "package acme-quiz" and cards["acme_quiz"]["tools"] == ["lookup"]
    assert cards["acme_quiz"]["example"].startswith("What colour is the sky")
    assert cards["weather"]["source"] == "folder" and cards["weather"]["tools"] == ["get_weather"]

    checked = rollgym("test", "acme_quiz", site=site)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "tests: 2 passed" in checked.stdout and "5 of 5 example rows accepted" in checked.stdout

    # A config anywhere names it as it names a folder; the installed package serves.
    monkeypatch.syspath_prepend(str(site))
    config = tmp_path / "quiz.yaml"
    config.write_text("quiz:\n  resources_servers:\n    acme_quiz: {}\n")
    spec = load_stack([config], add_default_model=False).servers["quiz"]
    assert spec.module == "acme_quiz.app" and spec.path == site / "acme_quiz"
    config.write_text("quiz:\n  resources_servers:\n    acme_quizz: {}\n")
    with pytest.raises(ConfigError, match="no resources_servers/acme_quizz/app.py found .* and no installed "
                                          "environment package of that name"):
        load_stack([config], add_default_model=False)


def test_init_package_refuses_a_bad_name_or_a_used_folder(tmp_path: Path) -> None:
    bad = rollgym("init", "--package", str(tmp_path / "Acme-Quiz"))
    assert bad.returncode == 2 and "package name 'Acme-Quiz' must be lower_snake_case" in bad.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    used = rollgym("init", "--package", str(tmp_path / "used"))
    assert used.returncode == 2 and "already exists and is not empty" in used.stderr


def test_an_entry_point_that_names_no_package_is_one_warning_line(tmp_path: Path) -> None:
    dist = tmp_path / "broken_env-0.1.dist-info"  # what pip leaves for an installed distribution
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-env\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rollgym.environments]\nbroken = broken_env_gone\n")
    listed = rollgym("env", "list", site=tmp_path)
    assert listed.returncode == 0 and "broken" not in listed.stdout
    assert listed.stderr.strip() == ("rollgym: warning: broken: entry point of broken-env names 'broken_env_gone', "
                                     "which is not an importable package")
