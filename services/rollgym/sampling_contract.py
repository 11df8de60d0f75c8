"""The sampling contract: which sampling settings leave the distribution as it is, which a model server
records, and which a policy-gradient trainer can rebuild. Model servers, plans, curation and the trainer
all read this one table; each default is written here once.

A trainer computes softmax(logits / T). It can rebuild a rollout's sampling distribution μ when:

- no truncation: `top_p` 1 and no `top_k` (`top_k` 0 in a record, -1 to vLLM/SGLang: both "off");
- no reshaping: `min_tokens`, `min_p` and the penalties at their neutral values;
- its logprobs are of that distribution: `logprobs: processed`, or raw ones (T = 1) of tokens sampled at T = 1.

A record is what a model server stamps on every generated item (`sampling`): temperature, top_p, top_k,
the logprobs' kind, and each reshaping knob that was set away from neutral.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

DEFAULT_TEMPERATURE = 1.0  # the OpenAI default, and the model's own distribution
DEFAULT_TOP_P = 1.0
TOP_K_OFF = 0  # in a record; vLLM and SGLang spell "off" -1 (BACKEND_NEUTRAL)

# Knobs that reshape the distribution beyond temperature and truncation, at their neutral values.
RESHAPING: dict[str, float] = {"min_tokens": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                               "presence_penalty": 0.0, "frequency_penalty": 0.0}
# Of those, the ones beyond the Responses API a model server may apply (it lists them in `applies`).
SERVER_KNOBS: tuple[str, ...] = ("min_tokens", "repetition_penalty")
# Every setting a token backend is sent, at its neutral value when neither the request nor the server's
# config gives one (vLLM and SGLang otherwise fill missing ones in from the model's generation_config).
BACKEND_NEUTRAL: dict[str, float] = {"temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P, "top_k": -1,
                                     **{key: RESHAPING[key] for key in ("min_p", "repetition_penalty",
                                                                        "presence_penalty", "frequency_penalty",
                                                                        "min_tokens")}}


# The values each sampling setting of a request may take (the Responses API's, vLLM's and the model servers'),
# as (lowest, highest, whether the lowest itself is allowed, whole numbers only).
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, math.inf, True, False), "top_p": (0.0, 1.0, False, False), "top_k": (-1, math.inf, True, True),
    "max_output_tokens": (1, math.inf, True, True), "max_tokens": (1, math.inf, True, True),
    "max_completion_tokens": (1, math.inf, True, True), "min_tokens": (0, math.inf, True, True),
    "min_p": (0.0, 1.0, True, False), "repetition_penalty": (0.0, math.inf, False, False),
    "presence_penalty": (-2.0, 2.0, True, False), "frequency_penalty": (-2.0, 2.0, True, False),
}


def range_problems(params: Mapping[str, Any]) -> list[str]:
    """`KEY VALUE: why` for each sampling setting of request params out of its range (RANGES), so that a plan's
    `temperature: -1` is refused by key before anything starts rather than by the first request. A temperature
    schedule (a mapping) is rollgym.data.sampling's to check."""
    problems = []
    for key, (low, high, low_allowed, whole) in RANGES.items():
        value = params.get(key)
        if value is None or (key == "temperature" and isinstance(value, Mapping)):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not float(value).is_integer()):
            problems.append(f"{key} {value!r}: must be {'a whole number' if whole else 'a number'}")
            continue
        above = value >= low if low_allowed else value > low
        if not (above and value <= high) or math.isnan(value):
            lower = f"{'at least' if low_allowed else 'above'} {low:g}"
            problems.append(f"{key} {value!r}: must be {lower}" + (f" and at most {high:g}" if high < math.inf else ""))
    least, most = params.get("min_tokens"), params.get("max_output_tokens", params.get("max_tokens"))
    if not problems and isinstance(least, int) and isinstance(most, int) and least > most:
        problems.append(f"min_tokens {least}: more than max_output_tokens {most}, which ends every answer first")
    return problems


def temperature_of(sampling: Mapping[str, Any]) -> float:
    """The temperature a request or record says (the default where it says nothing)."""
    value = sampling.get("temperature")
    return DEFAULT_TEMPERATURE if value is None else float(value)


def top_p_of(sampling: Mapping[str, Any]) -> float:
    value = sampling.get("top_p")
    return DEFAULT_TOP_P if value is None else float(value)


def reshaping_knobs(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The reshaping knobs of a record (or of request params) set away from their neutral value."""
    out = {}
    for key, neutral in RESHAPING.items():
        value = sampling.get(key)
        if value is not None and not isinstance(value, bool) and isinstance(value, (int, float)) \
                and float(value) != neutral:
            out[key] = value
    return out


def truncates(sampling: Mapping[str, Any]) -> bool:
    """Whether top_p or top_k cut the distribution's tail."""
    return top_p_of(sampling) < 1.0 or int(sampling.get("top_k") or TOP_K_OFF) > 0


def record(params: Mapping[str, Any], logprobs_mode: str, applied: frozenset[str] | tuple[str, ...] = SERVER_KNOBS,
           ) -> dict[str, Any]:
    """What a request's tokens were sampled under (the defaults where it says nothing), with the kind of
    their logprobs ("raw": before temperature and truncation, vLLM's default; "processed": of the
    distribution sampled from; "unknown"), and each of the `applied` knobs set away from neutral."""
    out: dict[str, Any] = {"temperature": temperature_of(params), "top_p": top_p_of(params),
                           "top_k": max(TOP_K_OFF, int(params.get("top_k") or TOP_K_OFF)), "logprobs": logprobs_mode}
    for key, value in reshaping_knobs(params).items():
        if key in applied:
            out[key] = int(value) if key == "min_tokens" else float(value)
    return out


def params_problems(params: Mapping[str, Any], trainer: str) -> list[str]:
    """Why `trainer` could not rebuild the distribution collection `params` ask for (empty: it could)."""
    problems = []
    if truncates(params):
        problems.append(f"top_p/top_k truncate the sampling distribution, which {trainer} cannot rebuild; collect "
                        "with top_p 1 and no top_k")
    if knobs := reshaping_knobs(params):
        problems.append(f"{', '.join(knobs)} reshape the sampling distribution, which {trainer} cannot rebuild; "
                        "collect without them (SFT or filtering data only)")
    return problems


def refuse_unreproducible(sampling: Mapping[str, Any], where: str, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming what a rollout's tokens were sampled under (its record) that a trainer cannot rebuild."""
    if truncates(sampling):
        raise error(f"{where}: sampled with top_p {sampling.get('top_p')} / top_k {sampling.get('top_k')}: the "
                    "trainer cannot rebuild a truncated distribution; collect with top_p 1 and no top_k")
    if knobs := reshaping_knobs(sampling):
        raise error(f"{where}: sampled with {', '.join(f'{k} {v}' for k, v in knobs.items())}: the trainer computes "
                    "softmax(logits / temperature) and cannot rebuild a distribution that min_tokens, min_p or a "
                    "penalty reshaped; collect without them (they suit SFT or filtering data, not RL)")


def trained_temperature(sampling: Mapping[str, Any], where: str, error: type[Exception] = ValueError) -> float:
    """The temperature a rollout's record says its logprobs belong to; `error` where the trainer cannot
    rebuild its distribution (truncated, reshaped, or raw logprobs of a temperature ≠ 1)."""
    refuse_unreproducible(sampling, where, error)
    temperature = temperature_of(sampling)
    if sampling.get("logprobs") != "processed" and not math.isclose(temperature, DEFAULT_TEMPERATURE):
        kind = "raw (T=1)" if sampling.get("logprobs") == "raw" else "unrecorded"
        raise error(f"{where}: the server's logprobs are {kind} logprobs of tokens sampled at temperature "
                    f"{temperature}; serve processed logprobs (vLLM: --logprobs-mode processed_logprobs and "
                    "logprobs_mode: processed in the model server's config) or collect at temperature 1")
    return temperature


__all__ = ["BACKEND_NEUTRAL", "DEFAULT_TEMPERATURE", "DEFAULT_TOP_P", "RANGES", "RESHAPING", "SERVER_KNOBS",
           "TOP_K_OFF", "params_problems", "range_problems", "record", "refuse_unreproducible", "reshaping_knobs",
           "temperature_of", "top_p_of", "trained_temperature", "truncates"]
