"""mini-swe-agent, its own `mini` command unchanged, through the proxy on the swe environment: its model
calls go through the proxy to the scripted backend (token-exact), and its bash commands run in the
rollout's workspace sandbox (the files they wrote are in the graded diff, made by the sandbox's uid)."""

from __future__ import annotations

import json
import os
import random
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig
from agents.proxy_agent.examples.conftest import check_token_exact
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.swe.app import SweServer, SweServerConfig
from resources_servers.swe.repos import build
from rollgym.client import ServerAddress
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread

MINI = os.environ.get("MINI_SWE_AGENT", str(REPO_ROOT / ".venv-mini" / "bin" / "mini"))
ROW = json.loads((REPO_ROOT / "resources_servers/swe/data/example.jsonl").read_text().splitlines()[0])
# The scripted model answers "You said: <the last user message>": the task holds one action in
# mini-swe-agent's text format; the command's output holds the next one, the submit command.
FINISH = "printf '%s\\n' '```mswea_bash_command' 'echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT' '```'"
TASK = f"```mswea_bash_command\nid -u > who.txt && hostname >> who.txt && {FINISH}\n```"


@pytest.mark.skipif(not os.access(MINI, os.X_OK), reason=f"mini-swe-agent is not installed at {MINI} "
                                                          "(make mini-swe-agent makes .venv-mini)")
def test_mini_swe_agent_runs_unchanged_in_the_sandbox(tmp_path: Path) -> None:
    repos = tmp_path / "repos"
    build([ROW], repos)
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        env = SweServer(SweServerConfig(repos_dir=str(repos), pool_size=0, sandbox_uid_base=random.randrange(40000, 59000, 100),
                                        sandbox_uid_count=8, test_timeout_s=120), name="swe")
        registry = {"policy_model": ServerAddress(stack.enter_context(serve_in_thread(model)), "models"),
                    "swe": ServerAddress(stack.enter_context(serve_in_thread(env)), "resources_servers")}
        config = ProxyAgentConfig(
            model_server={"name": "policy_model"}, resources_server={"name": "swe"}, timeout_s=240,
            agent={"kind": "command", "argv": ["python", "agents/proxy_agent/examples/mini_swe_agent/run_mini.py"],
                   "cwd": str(REPO_ROOT), "env": {"MINI_SWE_AGENT": MINI,
                                                  "MINI_CONFIG": json.dumps(["agent.instance_template={{task}}",
                                                                             "agent.step_limit=4"])}})
        proxy = stack.enter_context(serve_in_thread(ProxyAgent(config, name="proxy_agent", registry=registry)))
        reply = httpx.post(f"{proxy}/run", json={**ROW, "problem_statement": TASK}, timeout=300)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    check_token_exact(result, registry["policy_model"].url)
    assert result["metrics"]["turns"] == 2  # the action, then the submit command
    diff = result["model_patch"]
    assert "+++ b/who.txt" in diff, diff
    uid, host = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert int(uid) >= 40000 and host == "sandbox"  # the sandbox's uid and hostname, not this machine's
    assert result["reward"] == 0.0 and result["fail_to_pass_failing"] == ROW["FAIL_TO_PASS"]
