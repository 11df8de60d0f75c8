"""The models an evaluation compares: names a model server serves, adapters to hot-load, a train run's versions.

`--model` takes
  * `base` — the model server's base weights, whatever its name;
  * a name the model server lists in `GET /v1/models` (its base model, an adapter already loaded);
  * a path to an adapter (a PEFT folder, or a GGUF LoRA for the embedded model), or `LABEL=PATH`:
    loaded on every replica through vLLM's route `POST /v1/load_lora_adapter` under LABEL (default: the
    folder's name), and unloaded again at the end if it was not loaded before.
`--run DIR` takes the versions of a `rollgym train` run: its base model (`epoch-0`) and the adapter each
epoch trained (`epoch-N`, from DIR/history.jsonl), those whose files are still there.

Every request then names its model explicitly: a model server answers a request for no known name with
its latest adapter, which is not what an evaluation of the base model means.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import orjson

from .suite import NAME, SuiteError

BASE = "base"


class ModelUnreachable(RuntimeError):
    """The model server did not answer; the message says which and why (exit 1, not a usage error)."""


@dataclass(frozen=True)
class ModelSpec:
    """A `--model` as written: a label, and a name to look up or an adapter to load."""

    label: str
    name: str | None = None
    adapter: Path | None = None


@dataclass(frozen=True)
class Model:
    """A model as evaluated: its label, the `model` every request sends, the weights' model_version."""

    label: str
    request_model: str
    model_version: str | None
    adapter: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "request_model": self.request_model, "model_version": self.model_version,
                "adapter": self.adapter}


def parse_model(text: str) -> ModelSpec:
    """`base`, a served name, an adapter path, or LABEL=PATH; SuiteError for a label that cannot name a file."""
    label, sep, path = text.partition("=")
    if sep:
        if not NAME.match(label):
            raise SuiteError(f"--model {text}: the label {label!r} may hold letters, digits, '_', '-' and '.' only")
        adapter = Path(path).expanduser()
        if not adapter.exists():
            raise SuiteError(f"--model {text}: no adapter at {path}")
        return ModelSpec(label, adapter=adapter.resolve())
    candidate = Path(text).expanduser()
    if ("/" in text or text.startswith(".")) and candidate.exists():
        adapter = candidate.resolve()
        label = adapter.name if adapter.name != "adapter" else f"{adapter.parent.name}"
        return ModelSpec(_safe_label(label), adapter=adapter)
    if "/" in text and not candidate.exists() and text.startswith(("/", "./", "../", "~")):
        raise SuiteError(f"--model {text}: no adapter at {text}")
    return ModelSpec(_safe_label(text), name=text)


def run_models(run_dir: Path) -> list[ModelSpec]:
    """The base model and each epoch's adapter of a `rollgym train` output folder."""
    history = run_dir / "history.jsonl"
    if not history.is_file():
        raise SuiteError(f"--run {run_dir}: no {history.name} (not a `rollgym train` output folder)")
    specs = [ModelSpec("epoch-0", name=BASE)]
    for number, line in enumerate(history.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise SuiteError(f"--run {run_dir}: {history.name}:{number} is not JSON") from None
        uri = row.get("artefact") if isinstance(row, dict) else None
        if isinstance(uri, str) and row.get("epoch"):
            adapter = Path(uri)
            if adapter.exists():  # pruned epochs keep their history line, not their weights
                specs.append(ModelSpec(f"epoch-{int(row['epoch'])}", adapter=adapter.resolve()))
    if len(specs) == 1:
        raise SuiteError(f"--run {run_dir}: no epoch's adapter is on disk (history.jsonl names none that exists)")
    return specs


def _safe_label(text: str) -> str:
    label = "".join(ch if ch.isalnum() or ch in "_.-" else "_" for ch in text).strip("._-")[:64] or "model"
    return label if NAME.match(label) else f"m-{label}"[:64]


def check_labels(specs: list[ModelSpec]) -> None:
    seen: set[str] = set()
    for spec in specs:
        if spec.label in seen:
            raise SuiteError(f"--model: two models are labelled {spec.label!r}; name one LABEL=PATH")
        seen.add(spec.label)


async def resolve_models(registry: Mapping[str, Any], server: str, specs: list[ModelSpec],
                         log: Callable[[str], None] = print) -> tuple[list[Model], list[str]]:
    """Look the specs up on the model server and load the adapters; returns the models and the adapter
    names this call loaded (to unload at the end). ModelUnreachable when the server does not answer,
    SuiteError for a name it does not serve or an adapter it refuses."""
    from ..adapters import AdapterRefused, base_card, load_everywhere

    if server not in registry:
        known = [name for name, address in registry.items() if address.role == "models"]
        raise SuiteError(f"--model-server: the stack has no server named {server!r} "
                         f"(model servers: {', '.join(known) or 'none'})")
    listing = await _listing(registry, server)
    base = (base_card(listing) or {}).get("id")
    served = {card["id"]: card for card in listing}
    for spec in specs:  # every name is checked before any adapter is loaded
        if spec.adapter is None and (base if spec.name == BASE else spec.name) not in served:
            raise SuiteError(f"--model {spec.name}: {server} does not serve it (it serves "
                             f"{', '.join(served) or 'nothing'}), and it is not an adapter path")
    models: list[Model] = []
    loaded: list[str] = []
    try:
        for spec in specs:
            if spec.adapter is None:
                card = served[base if spec.name == BASE else str(spec.name)]
                models.append(Model(spec.label, card["id"], card.get("model_version") or card["id"],
                                    card.get("root") if card.get("parent") else None))
                continue
            try:
                versions = await load_everywhere(registry, [server], spec.label, str(spec.adapter))
            except AdapterRefused as exc:
                if spec.label not in served and exc.loaded:
                    loaded.append(spec.label)
                if exc.status == 0:
                    raise ModelUnreachable(str(exc)) from None
                raise SuiteError(f"--model {spec.label}: {exc}") from None
            if spec.label not in served:
                loaded.append(spec.label)
            version = next((v for v in versions if v), None)
            log(f"loaded adapter {spec.adapter} as {spec.label!r} on {server} ({version or 'version not reported'})")
            models.append(Model(spec.label, spec.label, version, str(spec.adapter)))
    except BaseException:
        await unload(registry, server, loaded)
        raise
    return models, loaded


async def unload(registry: Mapping[str, Any], server: str, names: list[str]) -> None:
    """Unload what `resolve_models` loaded, so a shared stack serves what it served before."""
    from ..adapters import publish

    for name in names:
        await publish(registry, "unload", {"lora_name": name}, servers=[server], timeout_s=60.0)


async def _listing(registry: Mapping[str, Any], server: str) -> list[dict[str, Any]]:
    from ..adapters import publish

    cards: list[dict[str, Any]] = []
    for reply in await publish(registry, "list", servers=[server], timeout_s=30.0):
        if reply["status"] == 0:
            raise ModelUnreachable(f"model server {server} at {reply['url']} cannot be reached: {reply['answer']}")
        if reply["status"] != 200 or not isinstance(reply["answer"], dict):
            raise ModelUnreachable(f"model server {server} at {reply['url']}: GET /v1/models answered "
                                   f"HTTP {reply['status']}: {reply['answer']}")
        for card in reply["answer"].get("data", []):
            if isinstance(card, dict) and isinstance(card.get("id"), str) and card not in cards:
                cards.append(card)
    return cards


__all__ = ["BASE", "Model", "ModelSpec", "ModelUnreachable", "check_labels", "parse_model", "resolve_models",
           "run_models", "unload"]
