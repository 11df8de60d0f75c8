"""Named policies on one model server: which policy answers a call, and which adapter serves it.

A training run with several policies (docs/train-policies.md) serves each policy's current adapter under
the policy's own name on one base model. A call belongs to the policy that claims it:

1. by its role label, `metadata.role` of the request (an agent framework that labels its agents' calls);
2. by the model name the agent asks for (`model`: the usual way a framework picks a model per agent);
3. else the default policy, if one is marked `default`.

A call no policy claims is refused (404 naming the name asked for and the names served), never answered by
the base model or another policy's adapter in silence. The policy's adapter (loaded under the policy's
name) answers it, or the base weights while none is loaded; every generated item says `policy`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class PolicyRoute(BaseModel):
    """What one policy claims on a model server."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(default_factory=list, description="model names the agent asks for (the policy's own "
                                                                "name is always one)")
    roles: list[str] = Field(default_factory=list, description="role labels (metadata.role of a request)")
    default: bool = Field(default=False, description="claims every call no other policy claims")


def name_problem(name: str) -> str | None:
    if not NAME.match(name):
        return (f"policy name {name!r}: letters, digits, '_', '.', '-' (at most 64, starting with a letter or "
                "digit): it is a LoRA name and a folder name")
    return None


def check_routes(routes: Mapping[str, PolicyRoute]) -> list[str]:
    """Problems with a set of policy routes: bad names, a name or role claimed twice, two defaults."""
    problems = [problem for name in routes if (problem := name_problem(name))]
    for kind in ("models", "roles"):
        owner: dict[str, str] = {}
        for name, route in routes.items():
            claimed = [name, *route.models] if kind == "models" else route.roles
            for value in dict.fromkeys(claimed):
                if value in owner and owner[value] != name:
                    problems.append(f"{kind[:-1]} {value!r} is claimed by policies {owner[value]!r} and {name!r}")
                owner.setdefault(value, name)
    defaults = [name for name, route in routes.items() if route.default]
    if len(defaults) > 1:
        problems.append(f"one default policy at most; {', '.join(defaults)} are all marked default")
    return problems


class UnclaimedCall(LookupError):
    """No policy claims a call; the message names what it asked for and what is served."""


class PolicyRouter:
    """Maps a request to its policy (None when the server has no policies: today's single-policy behaviour)."""

    def __init__(self, routes: Mapping[str, PolicyRoute]) -> None:
        self.routes = dict(routes)
        self.by_model = {model: name for name, route in routes.items() for model in [name, *route.models]}
        self.by_role = {role: name for name, route in routes.items() for role in route.roles}
        self.default = next((name for name, route in routes.items() if route.default), None)

    def __bool__(self) -> bool:
        return bool(self.routes)

    def policy_of(self, payload: Mapping[str, Any]) -> str:
        """The policy a request belongs to; UnclaimedCall when none claims it."""
        metadata = payload.get("metadata")
        role = metadata.get("role") if isinstance(metadata, Mapping) else None
        if isinstance(role, str) and role in self.by_role:
            return self.by_role[role]
        model = payload.get("model")
        if isinstance(model, str) and model in self.by_model:
            return self.by_model[model]
        if self.default is not None:
            return self.default
        asked = f"model {model!r}" if model else "no model name"
        if isinstance(role, str):
            asked += f" (role {role!r})"
        raise UnclaimedCall(f"no policy serves {asked}: this server's policies answer the model names "
                            f"{', '.join(sorted(self.by_model))}"
                            + (f" and the roles {', '.join(sorted(self.by_role))}" if self.by_role else ""))


def stamp_policy(items: list[dict[str, Any]], policy: str | None) -> list[dict[str, Any]]:
    """Put `policy` on every generated item."""
    if policy is not None:
        for item in items:
            if isinstance(item, dict):
                item.setdefault("policy", policy)
    return items


__all__ = ["PolicyRoute", "PolicyRouter", "UnclaimedCall", "check_routes", "name_problem", "stamp_policy"]
