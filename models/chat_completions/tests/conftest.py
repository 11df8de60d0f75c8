"""What the chat_completions tests share: the bodies the model server sends its backend."""

from __future__ import annotations

from typing import Any

import pytest

from models.chat_completions.app import ChatCompletionsModel


@pytest.fixture()
def sent(monkeypatch) -> list[dict[str, Any]]:
    """Every body the model server posts to its backend during the test, in order."""
    bodies: list[dict[str, Any]] = []
    post = ChatCompletionsModel._post

    async def recording(self, backend, path, body, root=False):
        bodies.append(dict(body))
        return await post(self, backend, path, body, root)

    monkeypatch.setattr(ChatCompletionsModel, "_post", recording)
    return bodies
