"""Sandboxes for resources servers: one confinement mechanism (launcher.py) under two uses.

- `Sandbox` / `run_sandbox`: one Python program per call in a fresh sandbox (the `code` environment);
- workspaces: a per-session directory that persists across the session's commands, each command a
  fresh sandbox over it, with limits per session, snapshot/reset and a warm pool, behind one
  provider interface (`LocalProvider` here, `RayProvider` over a Ray cluster).

docs/sandbox.md says what each mode confines and what it does not.
"""

from .isolation import (
    DEFAULT_EXPOSE, MODES, SCRIPT_NAME, Isolation, SandboxError, SandboxLimits, SandboxResult, UidLease,
    uid_processes_of,
)
from .programs import Sandbox, detect_isolation, run_program, run_sandbox
from .provider import LocalProvider, WorkspaceProvider, make_provider
from .workspace import WORKDIR, FileAccessError, LocalWorkspaces, WorkspaceError, WorkspaceLimits

__all__ = [
    "DEFAULT_EXPOSE", "MODES", "SCRIPT_NAME", "WORKDIR", "FileAccessError", "Isolation", "LocalProvider",
    "LocalWorkspaces", "Sandbox", "SandboxError", "SandboxLimits", "SandboxResult", "UidLease", "WorkspaceError",
    "WorkspaceLimits", "WorkspaceProvider", "detect_isolation", "make_provider", "run_program", "run_sandbox",
    "uid_processes_of",
]
