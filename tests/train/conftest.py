"""What the trainer tests share: toy adapters that a trainer's child process can import."""

from __future__ import annotations

import os

import pytest

from rollgym.testing import REPO_ROOT


@pytest.fixture()
def importable_toys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's child process imports the toy adapters (tests/train/toy_trainers.py) from the repository root."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
