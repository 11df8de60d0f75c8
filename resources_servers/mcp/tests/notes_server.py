"""A small MCP server written for the tests: a notebook whose notes live in the server process.

    python notes_server.py              # stdio
    python notes_server.py --http PORT  # streamable HTTP on 127.0.0.1:PORT/mcp
"""

from __future__ import annotations

import sys
from typing import Any

from mcp.server.mcpserver import MCPServer

server = MCPServer("notes")
NOTES: list[str] = []


@server.tool()
def add_note(text: str) -> str:
    """Write a note."""
    NOTES.append(text)
    return f"noted ({len(NOTES)} notes)"


@server.tool()
def list_notes() -> str:
    """Every note written so far, one per line."""
    return "\n".join(NOTES) or "(no notes)"


async def verify(request: dict[str, Any], session: Any) -> float:
    """1.0 when the rollout's notebook holds the task's `note`."""
    return 1.0 if request["note"] in (await session.call("list_notes", {})).splitlines() else 0.0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
