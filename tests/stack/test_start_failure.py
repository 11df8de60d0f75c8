"""A server that cannot start (a model path that is not there, a bad setting found while loading) stops
`rollgym run` with one line naming the server and the cause, and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rollgym.testing import REPO_ROOT

APP = '''
from rollgym import ResourcesServer


class BrokenServer(ResourcesServer):
    async def startup(self) -> None:
        raise FileNotFoundError("model_path /models/missing.gguf: no such file")
'''


def test_a_server_that_fails_at_startup_is_reported_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "resources_servers" / "broken"
    folder.mkdir(parents=True)
    (folder / "app.py").write_text(APP)
    config = folder / "broken.yaml"
    config.write_text("broken:\n  resources_servers:\n    broken:\n      entrypoint: app.py\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "services"), str(REPO_ROOT),
                                                                       os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "rollgym.cli", "run", str(config)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env=env)
    assert result.returncode != 0
    assert ("rollgym: server 'broken' cannot start: FileNotFoundError: model_path /models/missing.gguf: no such file"
            in result.stderr), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "rollgym: error: server 'broken' exited with code" in result.stderr.splitlines()[-1], result.stderr
