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
import yaml

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


# --- verifiers Envs installed as packages ----------------------------------------------------------

VF_EXAMPLES = REPO_ROOT / "agents" / "proxy_agent" / "examples" / "verifiers_env"


def write_distribution(site: Path, name: str, requires: list[str], files: dict[str, str]) -> None:
    """What pip leaves for an installed distribution: its files and a dist-info with METADATA and RECORD."""
    for path, text in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text)
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (info / "RECORD").write_text("".join(f"{path},,\n" for path in files) + f"{info.name}/METADATA,,\n")


def test_env_list_shows_installed_verifiers_envs_with_the_line_that_runs_them(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("verifiers.v1", reason="loading the listed Env needs verifiers 0.4 (the 'verifiers' extra)")
    # A real install: the example weather Env as a one-module project, built and installed by pip.
    project = tmp_path / "project"
    project.mkdir()
    (project / "rollgym_vf_weather.py").write_text((VF_EXAMPLES / "rollgym_vf_weather.py").read_text())
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "rollgym-vf-weather"\nversion = "0.1.0"\ndependencies = ["verifiers>=0.4"]\n'
        '[tool.setuptools]\npy-modules = ["rollgym_vf_weather"]\n')
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(project)], check=True, capture_output=True, timeout=240)
    # A package laid out as `vf-init` writes it (its Taskset in a submodule, a Harness of its own), and
    # two that are no verifiers Env: verifiers only in an extra, and no Taskset exported.
    write_distribution(site, "acme-vf", ["verifiers"], {
        "acme_vf/__init__.py": '"""Acme tasks."""\nfrom acme_vf.taskset import AcmeTaskset\n'
                               'from .harness import AcmeHarness\n\n__all__ = ["AcmeTaskset", "AcmeHarness"]\n',
        "acme_vf/taskset.py": "import verifiers.v1 as vf\n\nclass AcmeTaskset(vf.Taskset):\n    pass\n",
        "acme_vf/harness.py": "import verifiers.v1 as vf\n\nclass AcmeHarness(vf.Harness):\n    pass\n"})
    write_distribution(site, "uses-vf-optionally", ['verifiers; extra == "vf"'],
                       {"optional_vf.py": "from x import T\n__all__ = ['T']\nclass T(Taskset):\n    pass\n"})
    write_distribution(site, "vf-helpers", ["verifiers"], {
        "vf_helpers.py": "import verifiers.v1 as vf\n__all__ = ['helper', 'QuizConfig']\ndef helper():\n    pass\n"
                         "class QuizConfig(vf.TasksetConfig):\n    pass\n"})

    listed = rollgym("env", "list", "--json", site=site)
    assert listed.returncode == 0, listed.stderr
    cards = {card["name"]: card for card in map(orjson.loads, listed.stdout.splitlines())}
    weather, acme = cards["rollgym_vf_weather"], cards["acme_vf"]
    assert "optional_vf" not in cards and "vf_helpers" not in cards
    assert weather["source"] == "verifiers package rollgym-vf-weather" and weather["tools"] == ["get_weather"]
    assert weather["path"] == str(site / "rollgym_vf_weather.py") and weather["summary"].startswith("A tool:")
    assert weather["config"] == ('agent: {kind: verifiers, env: {taskset: {id: rollgym_vf_weather}, agent: '
                                 '{harness: {id: "null"}, runtime: {type: subprocess}}}}')
    assert acme["source"] == "verifiers package acme-vf" and acme["summary"] == "Acme tasks."
    assert '{harness: {id: "acme_vf"}' in acme["config"]  # its own harness, as verifiers picks it
    assert cards["weather"]["config"] == ""  # folders and rollgym packages run as they always did

    text = rollgym("env", "list", site=site)
    assert f"rollgym_vf_weather  (verifiers package rollgym-vf-weather: {site / 'rollgym_vf_weather.py'})" in text.stdout
    assert f"  run by the proxy agent (reward: agent): {weather['config']}" in text.stdout

    # The line is what the proxy agent's verifiers runner takes: it loads the installed Env.
    from agents.proxy_agent.verifiers_runner import VerifiersRunner, load_env

    agent = yaml.safe_load(weather["config"])["agent"]
    monkeypatch.syspath_prepend(str(site))
    # An earlier test in this process may have imported the examples' module of that name.
    monkeypatch.delitem(sys.modules, "rollgym_vf_weather", raising=False)
    VerifiersRunner(**agent)
    try:
        env = load_env(agent["env"], local_program=False)
        assert type(env.taskset).__name__ == "WeatherTaskset"
        assert sys.modules["rollgym_vf_weather"].__file__ == str(site / "rollgym_vf_weather.py")
    finally:
        sys.modules.pop("rollgym_vf_weather", None)  # the examples' module of that name, for later tests


def test_listing_imports_neither_the_envs_nor_verifiers(tmp_path: Path) -> None:
    write_distribution(tmp_path, "acme-vf", ["verifiers"], {
        "acme_vf.py": "import verifiers.v1 as vf\n\nclass AcmeTaskset(vf.Taskset):\n    pass\n\n__all__ = ['AcmeTaskset']\n"})
    probe = ("import sys; from rollgym.envkit.packages import environment_cards; from pathlib import Path; "
             "cards = environment_cards(Path('.')); print([c.name for c in cards if c.config]); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('verifiers', 'acme_vf')))")
    ran = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["['acme_vf']", "[]"]
