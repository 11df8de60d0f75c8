"""Stack configuration: server YAML files plus `key.path=value` overrides, validated.

A config file maps server instance names to `{role: {implementation: {options}}}`, the layout NeMo
Gym uses, so its configs read the same here:

    weather:                       # instance name, what other servers call it by
      resources_servers:           # role: models | resources_servers | agents
        weather:                   # folder: resources_servers/weather/
          entrypoint: app.py
          session_ttl_s: 600       # options, validated by the server's own config class

The folder is found next to the config file or in the current directory; failing that, an
environment (resources_servers) may be an installed package of that name, declared in the
`rollgym.environments` entry point group (docs/writing-an-environment.md).

A stack is several such files merged in order, then overrides. `${oc.env:NAME}` reads a secret
from the environment. An override may skip the role and folder: `policy_model.base_url=...`.
Errors name the file and the key.

Next to `entrypoint`, two more keys are the stack's, not the server's (docs/deploy.md):

          replicas: 3              # run 3 processes of this server; clients spread sessions over them
          ray_resources:           # what one replica asks of a Ray cluster (`rollgym run --ray`)
            num_cpus: 1
            num_gpus: 0
"""

from __future__ import annotations

import difflib
import re
import importlib.util
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError, format_location

ROLES = ("models", "resources_servers", "agents")
# NeMo Gym's names for the same roles.
ROLE_ALIASES = {"responses_api_models": "models", "responses_api_agents": "agents"}
# The model a stack gets when its agents name `policy_model` and no file defines it.
DEFAULT_MODEL_NAME = "policy_model"
DEFAULT_MODEL_CONFIG = Path("models") / "llamacpp" / "configs" / "llamacpp.yaml"
# Keys of a server entry that the stack reads; the server's own config class never sees them.
RESERVED_KEYS = ("entrypoint", "replicas", "ray_resources")
# Installed environment packages declare themselves here (docs/writing-an-environment.md).
ENVIRONMENTS_GROUP = "rollgym.environments"


class RayResources(BaseModel):
    """What one replica of a server asks of a Ray cluster (Ray's actor options of the same names)."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float | None = Field(default=None, ge=0)
    num_gpus: float | None = Field(default=None, ge=0)
    memory: int | None = Field(default=None, ge=0, description="bytes of memory to reserve")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources")
    accelerator_type: str | None = None

    def actor_options(self) -> dict[str, Any]:
        """The options given to `ActorClass.options(...)`: only what the config set."""
        return self.model_dump(exclude_none=True, exclude_defaults=True)


@dataclass
class ServerSpec:
    """One server instance of a stack."""

    name: str
    role: str
    folder: str
    entrypoint: str
    options: dict[str, Any]
    source: str
    root: str
    replicas: int = 1
    ray_resources: dict[str, Any] = field(default_factory=dict)
    package: str = ""  # an installed environment package's import name (root: the folder holding it)

    @property
    def key_prefix(self) -> str:
        return f"{self.name}.{self.role}.{self.folder}"

    @property
    def module(self) -> str:
        inside = Path(self.entrypoint).with_suffix('').as_posix().replace('/', '.')
        return f"{self.package}.{inside}" if self.package else f"{self.role}.{self.folder}.{inside}"

    @property
    def path(self) -> Path:
        """The server's folder: ROOT/role/folder, or an installed package's own folder."""
        return Path(self.root) / (self.package or f"{self.role}/{self.folder}")

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class StackConfig:
    servers: dict[str, ServerSpec] = field(default_factory=dict)

    def by_role(self, role: str) -> list[ServerSpec]:
        return [spec for spec in self.servers.values() if spec.role == role]

    def to_json(self) -> dict[str, Any]:
        return {name: spec.to_json() for name, spec in self.servers.items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StackConfig":
        return cls({name: ServerSpec(**spec) for name, spec in data.items()})


def load_stack(paths: list[str | Path], overrides: list[str] | None = None, *, add_default_model: bool = True) -> StackConfig:
    """Load and check a stack from config files and overrides; raises ConfigError naming file and key."""
    if not paths:
        raise ConfigError("no config file given; pass one or more server configs (configs/*.yaml)")
    merged = OmegaConf.create({})
    sources: dict[str, str] = {}
    for path in paths:
        layer = _load_file(Path(path))
        for name in layer:
            sources[str(name)] = str(path)
        merged = OmegaConf.merge(merged, layer)
    if add_default_model:
        merged = _add_default_model(merged, sources, paths)
    merged = OmegaConf.merge(merged, _parse_overrides(overrides or [], merged))
    try:
        data = OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        source = sources.get(str(key).split(".")[0], "the overrides")
        raise ConfigError(f"{source}: key '{key}': {_omegaconf_message(exc)}") from None
    stack = StackConfig()
    for name, entry in data.items():
        stack.servers[str(name)] = _server_spec(str(name), entry, sources.get(str(name), "the overrides"))
    _check_references(stack)
    return stack


def _load_file(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {yaml_problem(exc)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must map server names to their config, not a {type(raw).__name__}")
    try:
        return OmegaConf.create(raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {_omegaconf_message(exc)}") from None


def _parse_overrides(overrides: list[str], merged: DictConfig) -> DictConfig:
    dotlist = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {override!r} must look like key.path=value")
        parts = key.strip().split(".")
        instance = merged.get(parts[0]) if parts[0] in merged else None
        if instance is None and len(parts) > 1 and parts[1] not in ROLES and parts[1] not in ROLE_ALIASES:
            # Not a new server (that would name its role next), so a server name the configs lack: a typo.
            raise ConfigError(f"override {override!r}: no server named '{parts[0]}' in the configs"
                              f"{_did_you_mean(parts[0], [str(name) for name in merged])}")
        # Shorthand: `weather.session_ttl_s=60` means weather.<role>.<folder>.session_ttl_s.
        if isinstance(instance, DictConfig) and len(parts) > 1 and parts[1] not in ROLES and parts[1] not in ROLE_ALIASES:
            role = next(iter(instance), None)
            folder = next(iter(instance[role]), None) if role is not None and isinstance(instance[role], DictConfig) else None
            if role is not None and folder is not None:
                parts = [parts[0], str(role), str(folder), *parts[1:]]
        dotlist.append(f"{'.'.join(parts)}={value}")
    try:
        return OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad override: {_omegaconf_message(exc)}") from None


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f" (servers: {', '.join(sorted(known))})" if known else ""


def _server_spec(name: str, entry: Any, source: str) -> ServerSpec:
    where = f"{source}: server '{name}'"
    if not isinstance(entry, dict) or len(entry) != 1:
        raise ConfigError(f"{where}: must map exactly one role ({', '.join(ROLES)}) to its implementation")
    (role, impls), = entry.items()
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise ConfigError(f"{where}: unknown role '{role}' (expected one of {', '.join(ROLES)})")
    if not isinstance(impls, dict) or len(impls) != 1:
        raise ConfigError(f"{where}: '{role}' must map exactly one implementation folder to its options")
    (folder, options), = impls.items()
    options = dict(options or {})
    entrypoint = str(options.pop("entrypoint", "app.py"))
    key = f"{name}.{role}.{folder}"
    replicas = options.pop("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"{source}: key '{key}.replicas': must be a whole number of at least 1, not {replicas!r}")
    ray_resources = options.pop("ray_resources", None) or {}
    try:
        ray_resources = RayResources.model_validate(ray_resources).actor_options()
    except ValidationError as exc:
        raise ConfigError(key_problems(source, exc, prefix=f"{key}.ray_resources").splitlines()[0]) from None
    root = _find_root(Path(source), role, folder, entrypoint)
    package = ""
    if root is None and role == "resources_servers":
        installed = installed_environments().get(str(folder))
        if installed is not None and (installed.path / entrypoint).is_file():
            root, package = installed.path.parent, installed.package
    if root is None:
        raise ConfigError(f"{where}: no {role}/{folder}/{entrypoint} found next to {source} or in the current "
                          "directory" + (", and no installed environment package of that name"
                                         if role == "resources_servers" else ""))
    return ServerSpec(name, role, str(folder), entrypoint, options, source, str(root), replicas, ray_resources,
                      package)


@dataclass(frozen=True)
class InstalledEnvironment:
    name: str  # what stack configs call it
    package: str  # its import name
    path: Path  # the package's folder
    distribution: str  # the pip package that installed it


def installed_environments() -> dict[str, InstalledEnvironment]:
    """Every importable environment package, by name (an entry point whose package is gone is left out:
    `environment_problems` names it)."""
    found = {}
    for point in entry_points(group=ENVIRONMENTS_GROUP):
        path = _package_folder(point.value)
        if path is not None:
            found[point.name] = InstalledEnvironment(point.name, point.value, path,
                                                     point.dist.name if point.dist else "?")
    return found


def environment_problems() -> list[str]:
    """Entry points of the group that name no importable package, one line each."""
    return [f"{point.name}: entry point of {point.dist.name if point.dist else '?'} names {point.value!r}, "
            "which is not an importable package" for point in entry_points(group=ENVIRONMENTS_GROUP)
            if _package_folder(point.value) is None]


def _package_folder(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _find_root(source: Path, role: str, folder: str, entrypoint: str) -> Path | None:
    """The directory holding `role/folder/entrypoint`: an ancestor of the config file, or the cwd."""
    candidates = list(source.resolve().parents) if source.exists() else []
    candidates.append(Path.cwd())
    for directory in candidates:
        if (directory / role / folder / entrypoint).is_file():
            return directory
    return None


def _add_default_model(merged: DictConfig, sources: dict[str, str], paths: list[str | Path]) -> DictConfig:
    if DEFAULT_MODEL_NAME in merged or not _mentions(OmegaConf.to_container(merged, resolve=False), DEFAULT_MODEL_NAME):
        return merged
    for directory in [*(p.parent for path in paths for p in [Path(path).resolve()] for p in p.parents), Path.cwd()]:
        candidate = directory / DEFAULT_MODEL_CONFIG
        if candidate.is_file():
            layer = _load_file(candidate)
            for name in layer:
                sources[str(name)] = str(candidate)
            return OmegaConf.merge(layer, merged)
    return merged


def _mentions(value: Any, name: str) -> bool:
    if isinstance(value, dict):
        return any(_mentions(v, name) for v in value.values())
    if isinstance(value, list):
        return any(_mentions(v, name) for v in value)
    return value == name


def _check_references(stack: StackConfig) -> None:
    """Options like `model_server: {name: X}` must name a server of the stack."""
    for spec in stack.servers.values():
        for key, value in spec.options.items():
            if key.endswith("_server") and isinstance(value, dict) and "name" in value:
                if value["name"] not in stack.servers:
                    known = ", ".join(sorted(stack.servers))
                    raise ConfigError(
                        f"{spec.source}: key '{spec.key_prefix}.{key}.name': no server named "
                        f"'{value['name']}' in the stack (servers: {known})"
                    )


def format_validation_error(exc: ValidationError, spec: ServerSpec) -> str:
    """A server config ValidationError as `file: key 'a.b.c': message` lines."""
    return key_problems(spec.source, exc, prefix=spec.key_prefix)


class StrictModel(BaseModel):
    """A config section that refuses keys it does not know: a typo is an error naming the key, never a
    setting silently left at its default."""

    model_config = ConfigDict(extra="forbid")


def key_problems(source: str | Path, exc: ValidationError, note: Callable[[str], str] = lambda key: "", *,
                 prefix: str = "") -> str:
    """The one phrasing of a config file's validation errors: one `SOURCE: key 'a.b[1].c': message` line per
    error (the key under `prefix` when the file's section sits there), and `note(key)` after it."""
    lines = []
    for error in exc.errors():
        loc = format_location(error["loc"]) if error["loc"] else ""
        key = (f"{prefix}.{loc}" if prefix else loc) if loc else (prefix or "(top level)")
        message = ("unknown option" if error.get("type") == "extra_forbidden"
                   else str(error.get("msg", "invalid")).removeprefix("Value error, "))
        lines.append(f"{source}: key '{key}': {message}{note(key)}")
    return "\n".join(lines)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parse error as one line (PyYAML's message spans several, each counted as a problem otherwise):
    what is wrong and where, `not valid YAML: expected ',' or ']', but got '<stream end>' (line 4, column 1)`."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if problem is None:
        problem = " ".join(str(exc).split())
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"not valid YAML: {problem}{where}"


def read_mapping(path: Path, kind: str, keys: str) -> dict[str, Any]:
    """The mapping a YAML (or JSON) file holds; ValueError naming the file when it is missing, a folder,
    unreadable, not YAML, empty or not a mapping. `kind` names the file ("plan"), `keys` a few of its keys."""
    article = "an" if kind[0] in "aeiou" else "a"
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not {article} {kind} file")
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {kind} file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {yaml_problem(exc)}") from None
    shape = f"{article} {kind} is a mapping of keys ({keys}, ...)"
    if data is None:
        raise ValueError(f"{path}: is empty; {shape}")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {shape}, not a {type(data).__name__}")
    return data


def _omegaconf_message(exc: OmegaConfBaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def split_configs(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments → (config files, key=value overrides)."""
    files, overrides = [], []
    for item in items:
        if "=" in item and not Path(item).exists():
            overrides.append(item)
        else:
            files.append(item)
    return files, overrides


_DOTTED_PART = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")


def _dotted_path(key: str, kind: str) -> list[str | int]:
    """"stages[1].collect.input" -> ["stages", 1, "collect", "input"]; ValueError for anything else."""
    path: list[str | int] = []
    for part in key.split("."):
        match = _DOTTED_PART.match(part)
        if match is None:
            raise ValueError(f"override {key!r}: a key is a {kind} key, or section.key, with [N] for a list item "
                             "(e.g. seed, stack.concurrency, stages[0].collect.input)")
        path.append(match.group(1))
        path.extend(int(index) for index in re.findall(r"\[(\d+)\]", match.group(2)))
    return path


def set_dotted(data: dict[str, Any], key: str, value: Any, known: list[str], kind: str) -> None:
    """Set `key` ("seed", "stack.concurrency" inside a section, "stages[1].epochs" inside a list item)
    of a raw mapping to `value`; `known`: its top-level keys. ValueError names the override at fault."""
    path = _dotted_path(key, kind)
    if path[0] not in known:
        raise ValueError(f"override {key!r}: the {kind} has no key {path[0]!r} (keys: {', '.join(known)})")
    node: Any = data
    for depth, part in enumerate(path[:-1]):
        where = _dotted(path[: depth + 1])
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                size = len(node) if isinstance(node, list) else 0
                raise ValueError(f"override {key!r}: '{where}' is not there (the list has {size} items)")
        elif node.get(part) is None:
            node[part] = {}
        child = node[part]
        if not isinstance(child, (dict, list)) or isinstance(path[depth + 1], int) != isinstance(child, list):
            shape = "a list" if isinstance(path[depth + 1], int) else "a section of keys"
            raise ValueError(f"override {key!r}: '{where}' is not {shape}")
        node = child
    last = path[-1]
    if isinstance(last, int) and (not isinstance(node, list) or last >= len(node)):
        raise ValueError(f"override {key!r}: '{_dotted(path)}' is not there")
    node[last] = value


def _dotted(path: list[str | int]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else (f".{part}" if i else part) for i, part in enumerate(path))


def import_target(target: str) -> Any:
    """The object a config names as `package.module:attribute` (dots allowed after the colon), which must
    be callable. Raises ValueError naming the target when it cannot be imported or is not callable."""
    import importlib

    module_name, _, attribute = target.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot import {target!r}: {exc}") from None
    if not callable(value):
        raise ValueError(f"{target!r} is not callable")
    return value
