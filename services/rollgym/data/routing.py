"""Which agent a task row goes to: its `agent_ref`, else the run's default agent (see
rollgym.rollouts.attempts). Kept apart from the attempts so that reading rows (exports, data tools)
does not load the HTTP client."""

from __future__ import annotations

from typing import Any, Iterable, Mapping


def agent_ref_name(row: Mapping[str, Any]) -> str | None:
    """The agent a row names in `agent_ref` (`{"name": ...}` or a bare string), or None."""
    ref = row.get("agent_ref")
    if isinstance(ref, Mapping) and ref.get("name"):
        return str(ref["name"])
    if isinstance(ref, str) and ref:
        return ref
    return None


def agent_for(row: Mapping[str, Any], default: str) -> str:
    """The agent a row goes to: its `agent_ref`, else `default`."""
    return agent_ref_name(row) or default


class UnknownAgent(ValueError):
    """A row names (`agent_ref`) an agent the stack does not have; raised before anything is sent."""


def agents_of(registry: Mapping[str, Any]) -> list[str]:
    """The agent servers of a registry (entries without a role may be agents too)."""
    return [name for name, address in registry.items() if getattr(address, "role", "") in ("agents", "")]


def check_agent_refs(rows: Iterable[tuple[str, Mapping[str, Any]]], registry: Mapping[str, Any], *,
                     every_row_named: bool = False) -> None:
    """Every row's `agent_ref` must name an agent of `registry` (and with `every_row_named`, every row
    must name one: there is no default agent); `rows` are (where, row) pairs. Raises UnknownAgent
    naming the first such row, how many there are, and the stack's agents."""
    agents = set(agents_of(registry))
    rows = list(rows)
    if every_row_named:
        unrouted = [where for where, row in rows if agent_ref_name(row) is None]
        if unrouted:
            raise UnknownAgent(f"{unrouted[0]}: the row names no agent (agent_ref) and the stack has several "
                               f"({', '.join(sorted(agents))}); {len(unrouted)} such rows in all")
    wrong = [(where, name) for where, row in rows if (name := agent_ref_name(row)) is not None and name not in agents]
    if wrong:
        where, name = wrong[0]
        more = f" (and {len(wrong) - 1} more rows)" if len(wrong) > 1 else ""
        raise UnknownAgent(f"{where}: agent_ref names agent '{name}', which this stack does not have{more}; "
                           f"its agents: {', '.join(sorted(agents)) or 'none'}")


__all__ = ["UnknownAgent", "agent_for", "agent_ref_name", "agents_of", "check_agent_refs"]
