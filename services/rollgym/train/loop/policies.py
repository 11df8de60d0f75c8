"""Several policies in one run (`policies:` in a plan; docs/train-policies.md).

Each policy is a LoRA adapter on the one served base, loaded under the policy's name: the model server
(rollgym.policies) answers every call with the adapter of the policy that claims it, by the role label the
call carries or the model name the agent asks for, and stamps `policy` on what it generates. Here the plan's
side: the policies' settings and checks, the stack overrides that tell the model server who claims what, and
each policy's view of a rollout, which is what it is curated and trained on:

- its own segments only (a segment is one policy's calls: rollgym.sequences), every other segment left out;
- its own reward: `credit: per_role` takes `rewards[KEY]` from `/verify` for the first of the policy's name,
  roles and model names it holds, else the episode's `reward`; `credit: team` (MAGRPO's shared reward) takes
  the episode's `reward` for every policy;
- a rollout in which the policy made no call is not its data (counted as `not_this_policy`).

Groups stay per task (the rollout's `group_id`), so GRPO's advantages are computed over the same task's
rollouts, with the policy's own rewards.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Literal, Mapping

import orjson
from pydantic import Field, ValidationError

from ...config import StrictModel
from ...policies import PolicyRoute, check_routes

Credit = Literal["per_role", "team"]


class PolicyConfig(StrictModel):
    name: str = Field(description="the policy's name: its adapter's name on the model server, and its folder")
    models: list[str] = Field(default_factory=list, description="model names the agent asks for that are this "
                              "policy's (its own name always is)")
    roles: list[str] = Field(default_factory=list, description="role labels (a request's metadata.role) that are "
                             "this policy's")
    default: bool = Field(default=False, description="claims every call no other policy claims")
    args: dict[str, Any] = Field(default_factory=dict, description="trainer arguments of this policy, over each "
                                 "stage's optimize.args (learning_rate, lora, finetune, ...)")

    def route(self) -> PolicyRoute:
        return PolicyRoute(models=self.models, roles=self.roles, default=self.default)

    def reward_keys(self) -> list[str]:
        """The keys of /verify's `rewards` that are this policy's, in the order they are looked up."""
        return list(dict.fromkeys([self.name, *self.roles, *self.models]))

    def claims(self, name: str) -> bool:
        return name == self.name or name in self.models


def policies_problems(policies: list[PolicyConfig], mode: str, apply_modes: set[str], colocate: bool) -> list[str]:
    """What the plan's other sections make impossible with several policies, one problem a line."""
    if not policies:
        return []
    problems = [f"policies: {problem}" for problem in check_routes({p.name: p.route() for p in policies})]
    names = [policy.name for policy in policies]
    if len(set(names)) != len(names):
        problems.append(f"policies: names must be distinct: {names}")
    if mode != "epochs":
        problems.append("policies: mode: async trains one policy today; several policies run in mode: epochs")
    if apply_modes - {"lora", "none"}:
        problems.append(f"policies: every policy is an adapter on one served base, so stages apply: lora (or none), "
                        f"not {', '.join(sorted(apply_modes - {'lora', 'none'}))}")
    if colocate:
        problems.append("policies: colocate serves one trained model; several policies are adapters (apply: lora)")
    return problems


def plan_policy_problems(plan: Any, optimize_config: Any) -> list[str]:
    """A plan's problems with its policies (Plan's check across sections), one a line; `optimize_config` is the
    plan's OptimizeConfig, which each policy's args over each stage's are validated as."""
    if not plan.policies:
        return []
    problems = policies_problems(plan.policies, plan.mode, {stage.apply for stage in plan.stages}, plan.colocate)
    if plan.guard is not None:
        problems.append("guard: a run with several policies validates each on its own metric (history's "
                        "validation.policies); a guard over them is not written yet: leave guard out")
    for i, policy in enumerate(plan.policies):
        for j, stage in enumerate(plan.stages):
            if policy.args:
                try:
                    optimize_config.model_validate({**stage.optimize.model_dump(exclude={"args"}),
                                                    "args": {**stage.optimize.args, **policy.args}})
                except ValidationError as exc:
                    problems += [f"policies[{i}].{line} (over stages[{j}].optimize)" for error in exc.errors()
                                 for line in error["msg"].removeprefix("Value error, ").splitlines()]
    for i, stage in enumerate(plan.stages):  # what one collection feeds several policies' curation does not do yet
        unsupported = [key for key, used in (
            ("collect.levels", stage.collect is not None and bool(stage.collect.levels)),
            ("collect.difficulty", stage.collect is not None and stage.collect.difficulty.enabled),
            ("replay", bool(stage.replay)), ("teacher", stage.teacher is not None)) if used]
        problems += [f"stages[{i}].{key}: not with several policies yet (docs/train-policies.md)" for key in unsupported]
    if plan.checkpoints.keep_last is not None or plan.checkpoints.every is not None:
        problems.append("checkpoints: a run with several policies keeps every step's weights (pruning them per "
                        "policy is not written yet): leave checkpoints out")
    if plan.stack.registry_file:
        problems.append("policies: the loop tells the model server which policy claims which calls when it starts "
                        "the stack; use stack.configs (or give your server the same policies)")
    return problems


SERVES_POLICIES = ("llamacpp", "transformers")  # the model servers whose config takes `policies` (ModelServerConfig)


def stack_problems(plan: Any, stack: Any) -> list[tuple[str, str]]:
    """(key, problem) of the plan's policies against the stack it starts: its model server, the names called."""
    if not plan.policies:
        return []
    return serving_problems(plan, stack) + call_problems(plan.policies, asked_models(plan, stack))


def serving_problems(plan: Any, stack: Any) -> list[tuple[str, str]]:
    """The stack's policy model must serve policies by name (the embedded or the transformers server today)."""
    spec = stack.servers.get("policy_model")
    if not plan.policies or spec is None or spec.folder in SERVES_POLICIES:
        return []
    return [("policies", f"the stack's policy_model is models/{spec.folder}, which does not serve policies by name "
                         f"yet; use {' or '.join('models/' + name for name in SERVES_POLICIES)}")]


def asked_models(plan: Any, stack: Any) -> dict[str, str]:
    """The model names the plan's calls ask for, each with where it is set: the collecting agent's `models`
    (proxy_agent: the names its program's agents use) and the `model` of the task files' first rows."""
    asked: dict[str, str] = {}
    agents = [spec for spec in stack.servers.values() if spec.role == "agents"
              and (plan.stack.agent is None or spec.name == plan.stack.agent)]
    for spec in agents:
        for name in spec.options.get("models") or []:
            asked.setdefault(str(name), f"agent {spec.name!r} (models)")
    files = [(f"stages[{i}].collect", file) for i, stage in enumerate(plan.stages) if stage.collect is not None
             for file in stage.collect.files]
    files += [("validation.input", plan.validation.input)] if plan.validation and plan.validation.input else []
    for where, file in files:
        try:
            with open(file, "rb") as handle:
                rows = [orjson.loads(line) for _, line in zip(range(20), handle) if line.strip()]
        except (OSError, ValueError):
            continue  # the file's own problem is reported under its key
        for row in rows:
            model = (row.get("responses_create_params") or {}).get("model") if isinstance(row, dict) else None
            if isinstance(model, str):
                asked.setdefault(model, f"{where} ({file}: responses_create_params.model)")
    return asked


def server_overrides(policies: list[PolicyConfig], server: str) -> list[str]:
    """The stack overrides that make the model server `server` serve every policy by name (rollgym.policies)."""
    out = []
    for policy in policies:
        key = f"{server}.policies.{policy.name}"
        out += [f"{key}.models=[{','.join(policy.models)}]", f"{key}.roles=[{','.join(policy.roles)}]",
                f"{key}.default={'true' if policy.default else 'false'}"]
    return out


def call_problems(policies: list[PolicyConfig], asked: Mapping[str, str]) -> list[tuple[str, str]]:
    """(key, problem) for each model name a call asks for that no policy claims, and each policy nothing calls.
    `asked`: model name -> where it comes from (an agent's `models`, a task file's responses_create_params)."""
    if not policies or not asked:
        return []  # one policy; or a program whose names the stack does not say
    default = next((p.name for p in policies if p.default), None)
    problems = []
    if default is None:
        problems += [("policies", f"{where} asks for model {name!r}, which no policy claims (policies: "
                                  f"{', '.join(p.name for p in policies)}; add it to one's models, or mark one "
                                  "default)")
                     for name, where in asked.items() if not any(p.claims(name) for p in policies)]
    for i, policy in enumerate(policies):
        if not policy.default and not policy.roles and not any(policy.claims(name) for name in asked):
            problems.append((f"policies[{i}]", f"nothing calls policy {policy.name!r}: no call asks for "
                                               f"{', '.join(repr(n) for n in [policy.name, *policy.models])} "
                                               f"(the calls ask for {', '.join(map(repr, asked))})"))
    return problems


# ---------------------------------------------------------------------------------------------- credit

def policy_reward(rollout: Mapping[str, Any], policy: PolicyConfig, credit: Credit) -> float | None:
    """The reward a policy trains on for a rollout: its own (per_role) or the episode's (team, or none given)."""
    rewards = rollout.get("rewards")
    if credit == "per_role" and isinstance(rewards, Mapping):
        for key in policy.reward_keys():
            value = rewards.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    reward = rollout.get("reward")
    return None if reward is None else float(reward)


def policy_view(rollout: Mapping[str, Any], policy: PolicyConfig, credit: Credit) -> dict[str, Any] | None:
    """The rollout as the policy trains on it: its segments, its generated items, its reward; None when the
    policy made no call in it. A failed rollout stays failed (a failure is never a reward)."""
    sequences = [s for s in rollout.get("sequences") or [] if isinstance(s, Mapping) and s.get("policy") == policy.name]
    items = _output(rollout)
    mine = [item for item in items if not _generated(item) or item.get("policy") == policy.name]
    if not sequences and not any(_generated(item) for item in mine):
        return None
    view = dict(rollout)
    view["reward"] = policy_reward(rollout, policy, credit) if rollout.get("reward") is not None else None
    view["sequences"] = sequences
    view["prefix_ok"] = all(s.get("prefix_ok") is not False for s in sequences) if sequences else rollout.get("prefix_ok")
    versions = [item.get("model_version") for item in mine if _generated(item) and item.get("model_version")]
    if isinstance(rollout.get("response"), Mapping):
        response = {**rollout["response"]}
        if isinstance(response.get("output"), list):
            response["output"] = mine
        response.pop("model_version", None)  # the last call's, which may be another policy's
        if versions:
            response["model_version"] = versions[-1]
        view["response"] = response
    if isinstance(rollout.get("output"), list):
        view["output"] = mine
    view["policy"] = policy.name
    return view


def policy_rollouts(rollouts: Iterable[Mapping[str, Any]], policy: PolicyConfig,
                    credit: Credit) -> tuple[list[dict[str, Any]], Counter]:
    """Each rollout's view for `policy`, and the count of those it made no call in (`not_this_policy`)."""
    views, left = [], Counter()
    for rollout in rollouts:
        view = policy_view(rollout, policy, credit)
        if view is None:
            left["not_this_policy"] += 1
        else:
            views.append(view)
    return views, left


def policy_summary(rollouts: list[Mapping[str, Any]], policies: list[PolicyConfig], credit: Credit) -> dict[str, Any]:
    """Each policy's own figures over a collection (its reward over the rollouts it made calls in; failures
    left out, as everywhere): {name: {mean_reward, rollouts}}."""
    out: dict[str, Any] = {}
    for policy in policies:
        views, _ = policy_rollouts(rollouts, policy, credit)
        rewards = [view["reward"] for view in views if view.get("reward") is not None]
        out[policy.name] = {"mean_reward": round(sum(rewards) / len(rewards), 6) if rewards else None,
                            "rollouts": len(rewards)}
    return out


def off_policy(rollouts: Iterable[Mapping[str, Any]], versions: Mapping[str, str | None]) -> int:
    """How many rollouts hold a call whose weights are not its policy's served version (or of no policy)."""
    count = 0
    for rollout in rollouts:
        for item in _output(rollout):
            if _generated(item) and item.get("model_version") and (
                    item.get("policy") not in versions or versions[item["policy"]] != item["model_version"]):
                count += 1
                break
    return count


def _output(rollout: Mapping[str, Any]) -> list[dict[str, Any]]:
    response = rollout.get("response")
    if isinstance(response, Mapping) and isinstance(response.get("output"), list):
        return [item for item in response["output"] if isinstance(item, dict)]
    output = rollout.get("output")
    return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []


def _generated(item: Mapping[str, Any]) -> bool:
    """An item a model call generated (it carries the call's version or tokens), not one the environment added."""
    return item.get("type") != "function_call_output" and (
        "model_version" in item or "generation_token_ids" in item or "policy" in item)


__all__ = ["Credit", "PolicyConfig", "asked_models", "call_problems", "off_policy", "plan_policy_problems", "serving_problems", "stack_problems", "policies_problems", "policy_reward", "policy_rollouts",
           "policy_summary", "policy_view", "server_overrides"]
