"""Run mini-swe-agent (its own `mini` command, unchanged) on one task under the proxy agent.

    echo '{"problem_statement": "..."}' | python run_mini.py

Reads the task row on stdin, runs `mini -y --exit-immediately` with the model behind OPENAI_BASE_URL
(litellm's `openai/<OPENAI_MODEL>`), mini-swe-agent's text-based config and the RollgymEnvironment
(its bash commands go to the rollout's workspace sandbox), and prints its submission. `mini` is found
as MINI_SWE_AGENT (default: the repository's .venv-mini/bin/mini, made by `make mini-swe-agent`);
MINI_CONFIG adds `-c` specs (JSON list), e.g. a step limit. MINI_MODEL_CLASS / MINI_BASE_CONFIG pick
mini-swe-agent's tool-calling mode instead (`litellm` / `mini.yaml`: a `bash` tool in every request).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]


def statement(task: dict) -> str:
    if task.get("problem_statement"):
        return task["problem_statement"]
    items = task["responses_create_params"]["input"]
    return items if isinstance(items, str) else [i for i in items if i.get("role") == "user"][-1]["content"]


def main() -> int:
    task = json.load(sys.stdin)
    mini = os.environ.get("MINI_SWE_AGENT", str(REPO / ".venv-mini" / "bin" / "mini"))
    with tempfile.TemporaryDirectory(prefix="mini-") as folder:
        trajectory = Path(folder) / "trajectory.json"
        argv = [mini, "-y", "--exit-immediately", "-m", f"openai/{os.environ.get('OPENAI_MODEL', 'policy')}",
                "--model-class", os.environ.get("MINI_MODEL_CLASS", "litellm_textbased"),
                "--environment-class", "rollgym_environment.RollgymEnvironment",
                "-c", os.environ.get("MINI_BASE_CONFIG", "mini_textbased.yaml"),
                "-c", f"model.model_kwargs.api_base={os.environ['OPENAI_BASE_URL']}",
                "-c", "model.cost_tracking=ignore_errors", "-c", "agent.cost_limit=0",
                *[arg for spec in json.loads(os.environ.get("MINI_CONFIG", "[]")) for arg in ("-c", spec)],
                "-t", statement(task), "-o", str(trajectory)]
        env = {**os.environ, "MSWEA_CONFIGURED": "true", "MSWEA_GLOBAL_CONFIG_DIR": folder,
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(HERE), "NO_COLOR": "1"}
        done = subprocess.run(argv, env=env, cwd=folder, stdin=subprocess.DEVNULL, stdout=sys.stderr)
        if not trajectory.exists():
            return done.returncode or 1
        info = json.loads(trajectory.read_text()).get("info", {})
    print(json.dumps({"answer": info.get("submission") or "", "exit_status": info.get("exit_status")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
