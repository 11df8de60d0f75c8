"""A server that cannot start (a model path that is not there, a bad setting found while loading) stops
`rollgym run` with one line naming the server and the cause, and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollgym.cli import main

APP = '''
from rollgym import ResourcesServer


class BrokenServer(ResourcesServer):
    async def startup(self) -> None:
        raise FileNotFoundError("model_path /models/missing.gguf: no such file")
'''


def test_a_server_that_fails_at_startup_is_reported_in_one_line(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "resources_servers" / "broken"
    folder.mkdir(parents=True)
    (folder / "app.py").write_text(APP)
    config = folder / "broken.yaml"
    config.write_text("broken:\n  resources_servers:\n    broken:\n      entrypoint: app.py\n")
    assert main(["run", str(config)]) == 1
    err = capfd.readouterr().err  # the server's own stderr too: it is a child process
    assert "rollgym: server 'broken' cannot start: FileNotFoundError: model_path /models/missing.gguf: no such file" \
        in err, err
    assert "Traceback" not in err and "Application startup failed" not in err, err
    assert err.splitlines()[-1].startswith("rollgym: error: server 'broken' exited with code 2 before it was ready")
