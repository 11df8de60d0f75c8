"""`rollgym view`: a local web page over rollouts, failures, tokens and training curves (rollgym.view)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .common import UsageError


def register(commands: Any) -> None:
    view = commands.add_parser("view", help="a local web page over rollouts, failures, tokens and training curves")
    view.add_argument("paths", nargs="+", metavar="PATH",
                      help="rollouts .jsonl files, collection output folders, or training output folders")
    view.add_argument("--host", default="127.0.0.1",
                      help="listen here (default 127.0.0.1); beyond loopback the page needs a token: --token, "
                           "else ROLLGYM_AUTH_TOKEN, else a random one printed in the URL")
    view.add_argument("--port", type=int, default=0, help="listen on this port (default 0: a free one)")
    view.add_argument("--token", help="the token the page requires (only needed beyond loopback)")
    view.add_argument("--tokenizer", default="auto", metavar="auto|none|MODEL.gguf",
                      help="decode token ids with this GGUF's vocabulary (auto: the embedded model's, for the "
                           "rollouts it sampled; none: show ids)")
    view.add_argument("--pass-threshold", type=float, default=1.0, help="reward that counts as a pass for pass@k")
    view.add_argument("--open", action="store_true", help="also open the page in the default browser")
    view.set_defaults(handler=run_view)


def run_view(args: argparse.Namespace) -> int:
    from ..view.runs import ViewError
    from ..view.serve import serve

    try:
        return serve([Path(p) for p in args.paths], host=args.host, port=args.port, token=args.token,
                     tokenizer=args.tokenizer, pass_threshold=args.pass_threshold, open_browser=args.open)
    except ViewError as exc:
        raise UsageError(str(exc)) from None
