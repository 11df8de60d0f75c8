"""`rollgym view PATH...`: serve the viewer and print its URL. The web stack loads only when it runs."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any, Callable

AUTH_TOKEN_ENV = "ROLLGYM_AUTH_TOKEN"


def register(commands: Any, handler: Callable[[argparse.Namespace], int]) -> None:
    view = commands.add_parser("view", help="a local web page over rollouts, failures, tokens and training curves")
    view.add_argument("paths", nargs="+", metavar="PATH",
                      help="rollouts .jsonl files, collection output folders, or `rollgym train` output folders")
    view.add_argument("--host", default="127.0.0.1",
                      help=f"listen here (default 127.0.0.1); beyond loopback the page needs a token: "
                           f"--token, else {AUTH_TOKEN_ENV}, else a random one printed in the URL")
    view.add_argument("--port", type=int, default=0, help="listen on this port (default 0: a free one)")
    view.add_argument("--token", help="the token the page requires (only needed beyond loopback)")
    view.add_argument("--tokenizer", default="auto", metavar="auto|none|MODEL.gguf",
                      help="decode token ids with this GGUF's vocabulary (auto: the embedded model's, for "
                           "rollouts it sampled)")
    view.add_argument("--pass-threshold", type=float, default=1.0, help="reward that counts as a pass for pass@k")
    view.add_argument("--open", action="store_true", help="also open the page in the default browser")
    view.set_defaults(handler=handler)


def command(args: argparse.Namespace, usage_error: type[Exception]) -> int:
    import uvicorn

    from ..server import ServerStartError, is_loopback
    from .app import ViewConfig, ViewServer
    from .runs import Catalog, ViewError
    from .tokens import choose_vocabulary

    if not 0 <= args.port <= 65535:
        raise usage_error(f"--port must be between 0 and 65535, not {args.port}")
    token = args.token or os.environ.get(AUTH_TOKEN_ENV) or None
    if token is None and not is_loopback(args.host):
        token = secrets.token_urlsafe(24)
    try:
        catalog = Catalog([Path(p) for p in args.paths])
        vocabulary = choose_vocabulary(args.tokenizer)
        server = ViewServer(catalog, ViewConfig(host=args.host, port=args.port, auth_token=token,
                                                pass_threshold=args.pass_threshold), vocabulary)
    except (ViewError, FileNotFoundError, ServerStartError) as exc:
        raise usage_error(str(exc)) from None
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise usage_error(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    sock.listen(128)  # connections wait in the backlog until uvicorn serves them
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/" + (f"?token={token}" if token else "")
    runs = ", ".join(run.label for run in catalog.runs.values()) or "none"
    print(f"rollgym view: {len(catalog.runs)} rollouts file(s) ({runs}); "
          f"{len(catalog.trainings)} training run(s)", flush=True)
    print(f"rollgym view: open {url}   (Ctrl-C to stop)", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    config = uvicorn.Config(server.build_app(), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    print("rollgym view: stopped", file=sys.stderr)
    return 0
