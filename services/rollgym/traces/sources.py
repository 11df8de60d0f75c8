"""Sources: where a plan stage's traces come from, by URI, and what they become for its trainer.

    trace://local/<folder or spans file>      the local store (rollgym.traces' default: runs/traces)
    trace://otlp/<file>                       OTLP/JSON: JSON lines of export requests, or one document
    trace://phoenix/<project>                 a running Phoenix ($PHOENIX_URL, default http://127.0.0.1:6006)
    trace://langfuse/<project>[/<trace name>] LangFuse's public API (LANGFUSE_* keys, see langfuse.py)
    dataset://hf/<name>[:split]               a save_to_disk folder or the offline Hugging Face cache

Options are the URI's query: `score` (the reward's name), `min_reward`, `top_k`, `dedupe`, `tool_success_only`,
`drop_unsafe` (`module:function` of the user's, or `judge:<llm_judge url>`), `keep_failed`, for preferences
`pair_by` (input | reward_gap | feedback), `min_gap` (0.1), `threshold` (0.5), for LangFuse `tag`, for Phoenix
`url` and `level` (`trace`, the default: trace annotations are the rewards; `span`: annotations of single spans,
each joined to its span's episode), and `allow_retokenized` (GRPO on traces without served tokens: refused
unless named here), e.g. `trace://phoenix/weather?score=thumbs&min_reward=1`. A source whose scores are all
at the other level says so (a note naming `level=...`), and every trace it drops is counted by reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from ..config import import_target
from ..data.jsonl import read_whole_lines
from .schema import Reward, Trace
from .transforms import Filters, select, to_preferences, to_rollouts, to_sft

OPTIONS = {"score", "min_reward", "top_k", "dedupe", "tool_success_only", "drop_unsafe", "keep_failed", "pair_by",
           "min_gap", "threshold", "tag", "url", "allow_retokenized", "level"}
LEVELS = ("trace", "span")  # where a Phoenix project's scores are read from: trace or span annotations
STORES = {"trace": ("local", "otlp", "phoenix", "langfuse"), "dataset": ("hf",)}


class SourceError(ValueError):
    """A source that cannot be read or used as asked; the message names the URI."""


@dataclass
class Source:
    uri: str
    scheme: str
    store: str
    path: str
    options: dict[str, str] = field(default_factory=dict)

    def flag(self, name: str) -> bool:
        return self.options.get(name, "false").lower() in ("1", "true", "yes")

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.options.get(name)
        if value is None:
            return default
        try:
            return float(value)
        except ValueError:
            raise SourceError(f"{self.uri}: option {name}={value!r} is not a number") from None


def is_source(entry: str) -> bool:
    return entry.startswith(("trace://", "dataset://"))


def parse(uri: str) -> Source:
    """The source a URI names; SourceError for an unknown scheme, store or option."""
    parts = urlsplit(uri)
    if parts.scheme not in STORES or parts.netloc not in STORES[parts.scheme]:
        known = ", ".join(f"{s}://{store}/..." for s, stores in STORES.items() for store in stores)
        raise SourceError(f"{uri}: not a source rollgym reads ({known})")
    path = parts.path.lstrip("/") if parts.netloc in ("phoenix", "langfuse") else parts.path[1:]
    if not path:
        raise SourceError(f"{uri}: name the {'project' if parts.netloc in ('phoenix', 'langfuse') else 'file'}")
    options = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise SourceError(f"{uri}: unknown option {', '.join(unknown)} (options: {', '.join(sorted(OPTIONS))})")
    if "level" in options and options["level"] not in LEVELS:
        raise SourceError(f"{uri}: level={options['level']!r}: use trace or span")
    if options.get("level") == "span" and parts.netloc != "phoenix":
        raise SourceError(f"{uri}: level=span: only trace://phoenix/ keeps scores at two levels (trace and span "
                          "annotations); this store's rewards are its traces'")
    return Source(uri, parts.scheme, parts.netloc, path, options)


@dataclass
class Loaded:
    """A source's episodes, with what the reader has to say about them (scores found only at the other level)."""

    traces: list[Trace]
    notes: list[str] = field(default_factory=list)


@dataclass
class Replay:
    """What a stage's `replay` entry gives its curation: rollout rows, finished records, the traces the source
    dropped by reason, and its notes."""

    rows: list[dict[str, Any]]
    records: list[dict[str, Any]]
    dropped: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


def read_traces(source: Source | str) -> list[Trace]:
    """Every episode the source holds, rewards joined."""
    return load(source).traces


def load(source: Source | str) -> Loaded:
    """Every episode the source holds, rewards joined, and the notes of its reader."""
    from .assemble import assemble

    source = parse(source) if isinstance(source, str) else source
    try:
        if source.store in ("local", "otlp"):
            from .otlp import read_otlp_file

            path = Path(source.path)
            if path.is_dir():
                path = path / "spans.jsonl"
            if not path.is_file():
                raise SourceError(f"{source.uri}: no such file: {path}")
            return Loaded(assemble(read_otlp_file(path)))
        if source.store == "phoenix":
            return _phoenix(source)
        if source.store == "langfuse":
            from . import langfuse

            project, _, name = source.path.partition("/")
            return Loaded(langfuse.traces(project, tag=source.options.get("tag"), name=name or None,
                                          url=source.options.get("url")))
        from .hf import dataset_traces

        return Loaded(dataset_traces(source.path))
    except SourceError:
        raise
    except ValueError as exc:  # PhoenixError, LangfuseError, DatasetError, a malformed OTLP line
        message = str(exc)
        raise SourceError(message if source.uri in message or message.startswith(("trace://", "dataset://"))
                          else f"{source.uri}: {message}") from None


def _phoenix(source: Source) -> Loaded:
    """A Phoenix project's episodes with the rewards of the level asked for (a span's joined to its episode
    through its trace); when none of them is the score asked for, a note of how many the other level has."""
    from . import phoenix
    from .assemble import assemble

    url, level = source.options.get("url"), source.options.get("level", "trace")
    spans = phoenix.spans(source.path, url)
    trace_of = {span.span_id: span.trace_id for span in spans}

    def rewards(at: str) -> list[tuple[str, Reward]]:
        if at == "trace":
            return phoenix.trace_rewards(source.path, sorted(set(trace_of.values())), url)
        return [(trace_of[span], reward) for span, reward in phoenix.span_rewards(source.path, sorted(trace_of), url)]

    chosen = rewards(level)
    score = source.options.get("score") or None
    named = lambda found: [(t, r) for t, r in found if score is None or r.name == score]  # noqa: E731
    notes = []
    if spans and not named(chosen):
        other = "span" if level == "trace" else "trace"
        elsewhere = named(rewards(other))
        if elsewhere:
            what = f"a score named {score!r}" if score else "a score"
            notes.append(f"{source.uri}: no {level} annotation has {what}, but {len(elsewhere)} {other} annotations "
                         f"on {len({t for t, _ in elsewhere})} traces do: add level={other} to this source to train "
                         "on them")
    return Loaded(assemble(spans, chosen), notes)


def filters_of(source: Source) -> Filters:
    top_k = source.number("top_k")
    return Filters(score=source.options.get("score") or None, min_reward=source.number("min_reward"),
                   top_k=int(top_k) if top_k is not None else None, dedupe=source.flag("dedupe"),
                   tool_success_only=source.flag("tool_success_only"), keep_failed=source.flag("keep_failed"),
                   drop_unsafe=unsafe_filter(source))


def unsafe_filter(source: Source) -> Callable[[Trace], bool] | None:
    spec = source.options.get("drop_unsafe")
    if not spec:
        return None
    if spec.startswith("judge:"):
        from .safety import judge_filter

        return judge_filter(spec[len("judge:"):])
    try:
        return import_target(spec)
    except ValueError as exc:
        raise SourceError(f"{source.uri}: drop_unsafe: {exc}") from None


def read_source(entry: str, kind: str, base_model: str, tokenizer: Any = None) -> Replay:
    """What a stage's `replay` entry gives its curation: a rollouts file gives rows; a source gives finished
    SFT or preference records, or, for GRPO groups, rows with served tokens (a source with re-tokenized
    episodes is refused unless it says allow_retokenized); with the traces it dropped, counted by reason."""
    if not is_source(entry):
        return Replay(read_whole_lines(Path(entry)), [])
    source = parse(entry)
    loaded = load(source)
    traces = loaded.traces
    filters = filters_of(source)
    need_tokenizer = kind != "groups" or source.flag("allow_retokenized")
    if tokenizer is None and need_tokenizer and any(t.token_source == "retokenized" for t in traces):
        from .tokens import load_tokenizer

        tokenizer = load_tokenizer(base_model)
    if kind == "sft":
        records = to_sft(traces, tokenizer=tokenizer, filters=filters)
        return Replay([], records, filters.dropped, loaded.notes)
    if kind == "preferences":
        pair_by = source.options.get("pair_by", "input")
        if pair_by not in ("input", "reward_gap", "feedback"):
            raise SourceError(f"{entry}: pair_by={pair_by!r}: use input, reward_gap or feedback")
        pairs = to_preferences(traces, tokenizer=tokenizer, pair_by=pair_by,  # type: ignore[arg-type]
                               min_gap=source.number("min_gap", 0.1) or 0.0,
                               threshold=source.number("threshold", 0.5) or 0.0, filters=filters)
        return Replay([], pairs, filters.dropped, loaded.notes)
    kept = select(traces, filters)
    foreign = [t.episode.id for t in kept if t.token_source == "retokenized"]
    if foreign and not source.flag("allow_retokenized"):
        raise SourceError(f"{entry}: {len(foreign)} of {len(kept)} episodes have no served token ids "
                          f"(token_source: retokenized, e.g. {foreign[0]}); GRPO trains on the tokens and sampling "
                          "logprobs that were served. Add ?allow_retokenized=true to this source to train on "
                          "re-tokenized text anyway (sampling logprobs then unknown, recorded as 0)")
    rows = to_rollouts(kept, score=filters.score)
    for trace, row in zip(kept, rows):
        if row["token_source"] == "retokenized":
            from .transforms import tokens_of

            sequence = tokens_of(trace, tokenizer)[0]
            row["sequences"] = [{"prompt_ids": sequence["prompt_ids"], "completion_ids": sequence["completion_ids"],
                                 "completion_mask": sequence["completion_mask"],
                                 "completion_logprobs": [0.0] * len(sequence["completion_ids"])}]
            row["prefix_ok"] = True
            row["chat_template"] = sequence["chat_template"]
    return Replay(rows, [], filters.dropped, loaded.notes)


__all__ = ["LEVELS", "Loaded", "Replay", "Source", "SourceError", "filters_of", "is_source", "load", "parse",
           "read_source", "read_traces"]
