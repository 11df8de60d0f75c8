"""Serve the viewer in the foreground (`rollgym view`): build the catalog, bind, print the URL, run."""

from __future__ import annotations

import os
import secrets
import socket
import sys
from pathlib import Path
from urllib.parse import quote

def serve(paths: list[Path], *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          tokenizer: str | None = "auto", pass_threshold: float = 1.0, open_browser: bool = False) -> int:
    """Serve the page over `paths` until interrupted. A bad path, option or address raises ViewError
    with the reason; beyond loopback without a token, a random one is made and shown in the URL."""
    import uvicorn

    from ..client import AUTH_TOKEN_ENV
    from ..server import ServerStartError, is_loopback
    from .app import ViewConfig, ViewServer
    from .runs import Catalog, ViewError
    from .tokens import choose_vocabulary

    if not 0 <= port <= 65535:
        raise ViewError(f"--port must be between 0 and 65535, not {port}")
    token = token or os.environ.get(AUTH_TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(24)
    try:
        catalog = Catalog(paths)
        vocabulary = choose_vocabulary(tokenizer)
        server = ViewServer(catalog, ViewConfig(host=host, port=port, auth_token=token,
                                                pass_threshold=pass_threshold), vocabulary)
    except (FileNotFoundError, ServerStartError) as exc:
        raise ViewError(str(exc)) from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ViewError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)  # connections wait in the backlog until uvicorn serves them
    port = sock.getsockname()[1]  # the one picked when asked for 0
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/" + (f"?token={quote(token)}" if token else "")
    labels = [run.label for run in catalog.runs.values()]
    runs = ", ".join(labels[:5]) + (f", and {len(labels) - 5} more" if len(labels) > 5 else "") or "none"
    print(f"rollgym view: {len(catalog.runs)} rollouts file(s) ({runs}); "
          f"{len(catalog.trainings)} training run(s)", flush=True)
    if vocabulary is not None:
        scope = "every rollout" if vocabulary.any_model else "the rollouts it sampled"
        print(f"rollgym view: token ids decoded with {vocabulary.gguf.name} for {scope}", flush=True)
    print(f"rollgym view: open {url}   (Ctrl-C to stop)", flush=True)
    if open_browser:
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
