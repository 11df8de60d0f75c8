"""Stack config loading: merging, overrides, and errors that name the file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollgym.config import ConfigError, load_stack
from rollgym.stack.serve import build_server
from rollgym.server import ServerStartError

REPO = Path(__file__).resolve().parents[2]
WEATHER = REPO / "resources_servers/weather/configs/weather.yaml"
CHAT = REPO / "models/chat_completions/configs/chat_completions.yaml"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_weather_stack_loads_with_overrides() -> None:
    stack = load_stack([WEATHER, CHAT], ["policy_model.base_url=http://10.0.0.1:9/v1", "weather_agent.max_steps=3"])
    assert set(stack.servers) == {"weather", "weather_agent", "policy_model"}
    assert stack.servers["policy_model"].options["base_url"] == "http://10.0.0.1:9/v1"
    assert stack.servers["weather_agent"].options["max_steps"] == 3
    assert stack.servers["weather"].module == "resources_servers.weather.app"
    assert stack.servers["weather"].root == str(REPO)
    assert stack.servers["weather_agent"].source == str(WEATHER)


def test_full_path_override_and_nemo_role_alias(tmp_path: Path) -> None:
    config = write(tmp_path, "alias.yaml", "m:\n  responses_api_models:\n    chat_completions:\n      base_url: http://x/v1\n      model: a\n")
    stack = load_stack([config], ["m.responses_api_models.chat_completions.model=b"])
    assert stack.servers["m"].role == "models"
    assert stack.servers["m"].options["model"] == "b"
    assert stack.servers["m"].root == str(REPO) or Path(stack.servers["m"].root) == Path.cwd()


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_stack(["nope.yaml"])


def test_bad_yaml_names_the_file(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", "weather: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_stack([bad])


def test_unknown_role_names_file_and_server(tmp_path: Path) -> None:
    bad = write(tmp_path, "role.yaml", "thing:\n  gadgets:\n    weather: {}\n")
    with pytest.raises(ConfigError, match=r"role\.yaml: server 'thing': unknown role 'gadgets'"):
        load_stack([bad])


def test_missing_folder(tmp_path: Path) -> None:
    bad = write(tmp_path, "folder.yaml", "thing:\n  resources_servers:\n    no_such_env: {}\n")
    with pytest.raises(ConfigError, match=r"no resources_servers/no_such_env/app\.py found"):
        load_stack([bad])


def test_reference_to_missing_server_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_stack([WEATHER, CHAT], ["weather_agent.resources_server.name=wether"], add_default_model=False)
    assert "key 'weather_agent.agents.simple_agent.resources_server.name'" in str(info.value)
    assert "no server named 'wether'" in str(info.value)


def test_required_value_left_unset_names_the_key() -> None:
    agent = REPO / "agents/simple_agent/configs/simple_agent.yaml"
    with pytest.raises(ConfigError, match=r"simple_agent\.yaml: key 'simple_agent\.agents\.simple_agent\.resources_server\.name'"):
        load_stack([agent, CHAT])


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        load_stack([WEATHER, CHAT], ["=3"])


def test_override_of_a_misspelt_server_names_the_server_not_a_role() -> None:
    # `weathr.replicas=2` once read as a new server whose role is 'replicas'.
    with pytest.raises(ConfigError) as caught:
        load_stack([WEATHER, CHAT], ["weathr.replicas=2"])
    assert "no server named 'weathr'" in str(caught.value) and "did you mean 'weather'" in str(caught.value)
    assert "role" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"no server named 'zzz' .*servers: policy_model, weather, weather_agent"):
        load_stack([WEATHER, CHAT], ["zzz.replicas=2"])
    # A new server defined by overrides (its role next) is still allowed.
    stack = load_stack([WEATHER, CHAT], ["extra.resources_servers.weather.domain=other"])
    assert stack.servers["extra"].role == "resources_servers"


def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLGYM_BACKEND_API_KEY", "sk-test")
    assert load_stack([WEATHER, CHAT]).servers["policy_model"].options["api_key"] == "sk-test"
    monkeypatch.delenv("ROLLGYM_BACKEND_API_KEY")
    assert load_stack([WEATHER, CHAT]).servers["policy_model"].options["api_key"] is None


def test_server_options_are_validated_with_file_and_key() -> None:
    stack = load_stack([WEATHER, CHAT], ["weather_agent.max_steps=many", "weather.colour=blue"])
    payload = {"registry": {}, "secret": "x" * 32}
    with pytest.raises(ServerStartError) as info:
        build_server(stack.servers["weather_agent"], payload)
    assert f"{WEATHER}: key 'weather_agent.agents.simple_agent.max_steps': Input should be a valid integer" in str(info.value)
    with pytest.raises(ServerStartError, match=r"key 'weather\.resources_servers\.weather\.colour': unknown option"):
        build_server(stack.servers["weather"], payload)


def test_server_beyond_loopback_needs_a_token() -> None:
    stack = load_stack([WEATHER, CHAT], ["weather.host=0.0.0.0"])
    with pytest.raises(ServerStartError, match="beyond loopback, without auth_token"):
        build_server(stack.servers["weather"], {"registry": {}, "secret": "x" * 32})
    stack = load_stack([WEATHER, CHAT], ["weather.host=0.0.0.0", "weather.auth_token=tok"])
    assert build_server(stack.servers["weather"], {"registry": {}, "secret": "x" * 32}).config.auth_token == "tok"
