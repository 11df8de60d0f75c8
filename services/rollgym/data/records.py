"""What a rollout record says about who generated it and which of its tokens are the model's.

One reading of each, shared by curation, the orchestrator, the trainers, exports and the viewer:
`output_items` (the items the rollout generated, in either shape of a rollout line), `model_versions` (the weights that sampled it), `completion_length` (how many tokens the policy generated),
`model_token_mask` (which completion tokens the model sampled rather than the environment or a grammar).
"""

from __future__ import annotations

from typing import Any, Mapping


def output_items(rollout: Mapping[str, Any]) -> list[Any]:
    """The output items of a rollout: `response.output` (the answer of /run, and rollout lines written before
    the collector moved them out), else the line's top-level `output` (the format specification's shape, which
    the collector writes: `response` then keeps its id, model and usage). [] when it has neither."""
    response = rollout.get("response")
    if isinstance(response, Mapping):
        output = response.get("output")
        if isinstance(output, list):
            return output
    output = rollout.get("output")
    return output if isinstance(output, list) else []


def model_versions(rollout: Mapping[str, Any], *, served_model: bool = True) -> set[str]:
    """The model versions that generated a rollout: the `model_version` of every generated item (and of each of
    its `model_version_spans`, when its generation went on across weight updates) and of the response. With
    `served_model`, a rollout whose server reports none is known by the response's `model` (the model it asked
    for, the served one); without it, such a rollout has no known version (the orchestrator then counts it as
    sampled by the version current when it was dispatched)."""
    response = rollout.get("response")
    if not isinstance(response, Mapping):
        return set()
    versions: set[str] = set()
    for item in output_items(rollout):
        if not isinstance(item, Mapping):
            continue
        named = [item.get("model_version")]
        spans = item.get("model_version_spans")
        if isinstance(spans, list):
            named += [span.get("model_version") for span in spans if isinstance(span, Mapping)]
        versions.update(str(version) for version in named if version)
    if response.get("model_version"):
        versions.add(str(response["model_version"]))
    if served_model and not versions and response.get("model"):
        versions.add(str(response["model"]))
    return versions


def completion_length(rollout: Mapping[str, Any]) -> int:
    """Tokens the policy generated in a rollout (0 when the rollout says nothing about tokens)."""
    sequences = rollout.get("sequences")
    if isinstance(sequences, Mapping):  # one sequence given as an object
        sequences = [sequences]
    if isinstance(sequences, list) and sequences and all(
            isinstance(s, Mapping) and isinstance(s.get("completion_mask"), list) for s in sequences):
        return sum(1 for s in sequences for bit in s["completion_mask"] if bit)
    metrics = rollout.get("metrics")
    if isinstance(metrics, Mapping):
        return int(metrics.get("output_tokens") or 0)
    return 0


def model_token_mask(sequence: Mapping[str, Any]) -> list[int]:
    """1 for the completion tokens the model sampled: not the environment's, not forced by a grammar."""
    forced = sequence.get("completion_forced") or [0] * len(sequence["completion_mask"])
    return [int(bool(m) and not f) for m, f in zip(sequence["completion_mask"], forced)]


__all__ = ["completion_length", "model_token_mask", "model_versions", "output_items"]
