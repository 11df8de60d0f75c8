"""A mini-swe-agent environment whose commands run in the rollout's workspace sandbox.

mini-swe-agent picks its environment class by name (`--environment-class
rollgym_environment.RollgymEnvironment`); this one sends each command to the environment's `bash` tool
under the proxy (ROLLGYM_TOOLS_URL, with the rollout's key), so the command runs in the session's
sandbox over /workspace, and answers what mini-swe-agent's LocalEnvironment answers. Standard library
only: it is imported by mini-swe-agent's own interpreter.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from typing import Any

from minisweagent.environments.local import LocalEnvironment

_STATUS = re.compile(r"\n?\[exit status (-?\d+)\]$")
_KILLED = re.compile(r"\n?\[the command was killed: (.*)\]$")


class RollgymEnvironment(LocalEnvironment):
    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        if cwd:
            command = f"cd {json.dumps(cwd)} && {command}"
        body = json.dumps({"command": command, "timeout": timeout or self.config.timeout}).encode()
        request = urllib.request.Request(
            f"{os.environ['ROLLGYM_TOOLS_URL']}/bash", data=body, method="POST",
            headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=(timeout or self.config.timeout) + 60) as reply:
                text = reply.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as exc:
            output = {"output": "", "returncode": -1, "exception_info": f"the sandbox did not answer: {exc}"}
            self._check_finished(output)
            return output
        returncode, exception = 0, ""
        if killed := _KILLED.search(text):
            returncode, exception, text = -1, f"the command was killed: {killed.group(1)}", text[: killed.start()]
        elif status := _STATUS.search(text):
            returncode, text = int(status.group(1)), text[: status.start()]
        if text == "[no output]":
            text = ""
        output = {"output": text, "returncode": returncode, "exception_info": exception}
        self._check_finished(output)
        return output
