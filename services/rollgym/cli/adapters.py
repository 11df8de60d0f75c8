"""`rollgym adapters load|unload|list`: publish LoRA adapters to a running stack's model servers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .common import UsageError, env_registry


def register(commands: Any) -> None:
    group = commands.add_parser(
        "adapters", help="load, unload or list LoRA adapters on a running stack's model servers",
        description="Talks to every replica of the stack's model servers (or --model-server ones) through "
                    "vLLM's routes /v1/load_lora_adapter and /v1/unload_lora_adapter. The adapter path is read "
                    "by the model server: a PEFT folder (adapter_config.json + adapter_model.safetensors) or a "
                    "GGUF LoRA for the embedded model; for vLLM/SGLang backends, a path on their machines.")
    actions = group.add_subparsers(dest="action", required=True)
    load = actions.add_parser("load", help="load an adapter; requests that name no model are served by it")
    load.add_argument("name", help="the adapter's name (requests select it with model=NAME)")
    load.add_argument("path", help="the adapter: a PEFT folder or a GGUF LoRA file")
    load.add_argument("--inplace", action="store_true", help="replace an adapter of that name (vLLM's load_inplace)")
    unload = actions.add_parser("unload", help="unload an adapter; the previous one (or the base) serves again")
    unload.add_argument("name")
    listing = actions.add_parser("list", help="the base model and loaded adapters of each model server")
    for parser in (load, unload, listing):
        parser.add_argument("--registry-file", help="the running stack (written by `rollgym run --registry-file`); "
                                                    "default: ROLLGYM_REGISTRY in a compose container")
        parser.add_argument("--model-server", action="append", dest="servers", metavar="NAME",
                            help="only this model server (repeatable; default: every model server of the stack)")
        parser.add_argument("--json", action="store_true", help="print each replica's answer as JSON lines")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds a call may take")
        parser.set_defaults(handler=run_adapters)


def _registry(args: argparse.Namespace) -> dict[str, Any]:
    from ..client import load_registry_file

    if args.registry_file:
        try:
            return load_registry_file(args.registry_file)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    registry = env_registry()
    if registry is None:
        raise UsageError("say which stack: --registry-file FILE (written by `rollgym run --registry-file`)")
    return registry


def run_adapters(args: argparse.Namespace) -> int:
    import asyncio

    from ..adapters import publish

    registry = _registry(args)
    body: dict[str, Any] | None = None
    if args.action == "load":
        body = {"lora_name": args.name, "lora_path": str(Path(args.path).expanduser().resolve())}
        if args.inplace:
            body["load_inplace"] = True
    elif args.action == "unload":
        body = {"lora_name": args.name}
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    try:
        results = asyncio.run(publish(registry, args.action, body, args.servers, timeout_s=args.timeout))
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    if not results:
        raise UsageError("the stack has no model server")
    for result in results:
        if args.json:
            print(json.dumps(result))
        else:
            print(_line(args.action, result))
    failed = [result for result in results if not 200 <= result["status"] < 300]
    if failed:
        print(f"rollgym: error: {len(failed)} of {len(results)} model server replica(s) failed", file=sys.stderr)
        return 1
    return 0


def _line(action: str, result: dict[str, Any]) -> str:
    where = f"{result['server']} ({result['url']})"
    answer = result["answer"]
    if not 200 <= result["status"] < 300:
        status = result["status"] or "no answer"
        return f"{where}: failed [{status}] {answer}"
    if action == "list":
        models = answer.get("data", []) if isinstance(answer, dict) else []
        names = ", ".join(f"{m['id']} [{m.get('model_version', '?')}]" for m in models)
        return f"{where}: {names}"
    if isinstance(answer, dict):
        load_s = f", {answer['load_s']:.2f} s" if action == "load" and "load_s" in answer else ""
        return f"{where}: {answer.get('message', 'ok')} now serving {answer.get('policy', '?')}{load_s}"
    return f"{where}: {answer}"
