"""The viewer's HTTP app: the page, its static files, and a JSON API over the catalog of runs.

Built on the server base (health, structured 4xx errors naming the field, bearer auth beyond
loopback). A browser cannot send a bearer header when it follows a link, so the printed URL carries
`?token=`; the first request with it gets a cookie, and either one stands for the header.
"""

from __future__ import annotations

import secrets
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

import orjson
from fastapi import FastAPI, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from ..server import BadRequest, BaseServer, JSONBytesResponse, ServerConfig, error_body
from .index import SORT_KEYS, FileChangedError, Filters, RolloutIndex
from .conversation import conversation_view
from .rollout import group_view, table_row, token_view
from .runs import Catalog, ViewError, read_history, run_charts, summarize_run
from .tokens import Vocabulary

STATIC = Path(__file__).parent / "static"
TOKEN_COOKIE = "rollgym_view_token"
FIRST_PAGE_WAIT_S = 0.8  # how long a request waits for the background indexer to reach its page
MAX_PAGE = 500


class ViewConfig(ServerConfig):
    pass_threshold: float = 1.0


class TokenCookieMiddleware:
    """`?token=T` or the cookie it sets becomes `Authorization: Bearer T` for the base's auth check."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        supplied = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [None])[0]
        from_query = supplied is not None and secrets.compare_digest(supplied, self.token)
        if supplied is None:
            cookies = SimpleCookie(dict(scope.get("headers", ())).get(b"cookie", b"").decode("latin-1"))
            morsel = cookies.get(TOKEN_COOKIE)
            supplied = morsel.value if morsel else None
        if supplied is not None:
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"authorization"]
            scope = {**scope, "headers": [*headers, (b"authorization", f"Bearer {supplied}".encode())]}

        async def remember(message: dict) -> None:
            if from_query and message["type"] == "http.response.start":
                cookie = f"{TOKEN_COOKIE}={self.token}; HttpOnly; Path=/; SameSite=Strict"
                message["headers"] = [*message.get("headers", ()), (b"set-cookie", cookie.encode())]
            await send(message)

        await self.app(scope, receive, remember)


class ViewServer(BaseServer):
    """Serves the page over a Catalog; every API call first picks up lines appended since the last."""

    role = "view"
    config_class = ViewConfig

    def __init__(self, catalog: Catalog, config: ViewConfig | None = None,
                 vocabulary: Vocabulary | None = None) -> None:
        super().__init__(config or ViewConfig(), name="view")
        self.catalog = catalog
        self.vocabulary = vocabulary

    async def startup(self) -> None:
        for run in self.catalog.runs.values():
            run.rollouts.start_background()
            run.failures.start_background()

    def build_app(self) -> FastAPI:
        app = super().build_app()
        if self.config.auth_token:
            app.add_middleware(TokenCookieMiddleware, token=self.config.auth_token)
        return app

    def add_routes(self, app: FastAPI) -> None:
        catalog = self.catalog
        app.mount("/static", StaticFiles(directory=STATIC), name="static")

        @app.exception_handler(ViewError)
        async def on_view_error(request: Any, exc: ViewError) -> Any:
            return JSONBytesResponse(error_body("not_found", str(exc)), 404)

        @app.exception_handler(FileChangedError)
        async def on_file_changed(request: Any, exc: FileChangedError) -> Any:
            return JSONBytesResponse(error_body("conflict", str(exc)), 409)

        # Plain `def` routes: they read files, so FastAPI runs them in its thread pool, off the event loop.
        @app.get("/", include_in_schema=False)
        def page() -> FileResponse:
            return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

        @app.get("/api/runs")
        def runs() -> dict[str, Any]:
            for run in catalog.runs.values():
                _catch_up(run.rollouts)
                _catch_up(run.failures)
            return {
                "runs": [summarize_run(run, self.config.pass_threshold) for run in catalog.runs.values()],
                "trainings": [{"id": t.id, "label": t.label, "plot": t.plot is not None}
                              for t in catalog.trainings.values()],
                "evaluations": [{"id": e.id, "label": e.label} for e in catalog.evaluations.values()],
                "tokenizer": self.vocabulary.model_name if self.vocabulary else None,
            }

        @app.get("/api/runs/{run_id}/rollouts")
        def rollouts(
            run_id: str,
            status: list[str] | None = Query(None), reward_min: float | None = None,
            reward_max: float | None = None, group: str | None = None, env: str | None = None,
            prefix_ok: Literal["true", "false", "none"] | None = None, version: str | None = None,
            sort: str = "line", desc: bool = False,
            offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=MAX_PAGE),
        ) -> dict[str, Any]:
            run = catalog.run(run_id)
            if sort not in SORT_KEYS:
                raise BadRequest(f"must be one of {', '.join(SORT_KEYS)}", field="sort")
            if reward_min is not None and reward_max is not None and reward_min > reward_max:
                raise BadRequest("reward_min is above reward_max", field="reward_min")
            _catch_up(run.rollouts, offset + limit)
            filters = Filters(status=status or None, reward_min=reward_min, reward_max=reward_max, group=group,
                              env=env, version=version, no_tokens=prefix_ok == "none",
                              prefix_ok=None if prefix_ok in (None, "none") else prefix_ok == "true")
            page = run.rollouts.page(filters, sort, desc, offset, limit)
            return {"rows": [table_row(line, run.rollouts.read(line)) for line in page.rows],
                    "total": page.total, "indexed": page.indexed, "complete": page.complete,
                    "bad_lines": [vars(b) for b in run.rollouts.bad_lines[:20]],
                    "choices": {"status": _names(run.rollouts.statuses), "env": _names(run.rollouts.envs),
                                "version": _names(run.rollouts.versions)}}

        @app.get("/api/runs/{run_id}/rollouts/{line}")
        def rollout(run_id: str, line: int) -> dict[str, Any]:
            run = catalog.run(run_id)
            _catch_up(run.rollouts, line + 1)
            try:
                row = run.rollouts.read(line)
            except IndexError:
                raise ViewError(f"run '{run_id}' has no rollout on line {line + 1} "
                                f"({run.rollouts.count} indexed)") from None
            return {"line": line, "rollout": row, "tokens": token_view(row, self.vocabulary),
                    "conversation": conversation_view(row)}

        @app.get("/api/runs/{run_id}/groups/{group_id:path}")  # a group id may hold a slash
        def group(run_id: str, group_id: str) -> dict[str, Any]:
            run = catalog.run(run_id)
            _catch_up(run.rollouts)
            lines = run.rollouts.group_rows(group_id)
            if not lines:
                raise ViewError(f"run '{run_id}' has no group '{group_id}'")
            rows = [(line, run.rollouts.read(line)) for line in lines]
            return group_view(group_id, rows)

        @app.get("/api/runs/{run_id}/failures")
        def failures(run_id: str, offset: int = Query(0, ge=0),
                           limit: int = Query(50, ge=1, le=MAX_PAGE)) -> dict[str, Any]:
            run = catalog.run(run_id)
            _catch_up(run.failures, offset + limit)
            page = run.failures.page(Filters(), "line", True, offset, limit)  # newest first
            return {"rows": [run.failures.read(line) for line in page.rows], "total": page.total}

        @app.get("/api/runs/{run_id}/charts")
        def charts(run_id: str) -> dict[str, Any]:
            run = catalog.run(run_id)
            _catch_up(run.rollouts)
            return run_charts(run)

        @app.get("/api/trainings/{training_id}")
        def training(training_id: str) -> dict[str, Any]:
            found = catalog.training(training_id)
            runs = [{"id": run_id, "label": catalog.runs[run_id].label} for run_id in found.runs]
            return {"id": found.id, "label": found.label, "runs": runs, "plot": found.plot is not None,
                    "history": read_history(found.history) if found.history.is_file() else None}

        @app.get("/api/evaluations/{evaluation_id}")
        def evaluation(evaluation_id: str) -> dict[str, Any]:
            found = catalog.evaluation(evaluation_id)
            try:
                report = orjson.loads(found.report.read_bytes())
            except (OSError, orjson.JSONDecodeError) as exc:
                raise ViewError(f"{found.report}: cannot read the report: {exc}") from None
            runs = {catalog.runs[run_id].rollouts.path.resolve(): run_id for run_id in found.runs}
            folder = found.report.parent
            links = {f"{env['name']}/{label}": runs.get((folder / env["name"] / f"{label}.jsonl").resolve())
                     for env in report.get("environments", []) for label in env.get("results", {})}
            return {"id": found.id, "label": found.label, "report": report, "runs": links}

        @app.get("/api/trainings/{training_id}/plot")
        def plot(training_id: str) -> FileResponse:
            found = catalog.training(training_id)
            if found.plot is None or not found.plot.is_file():
                raise ViewError(f"training run '{training_id}' has no reward.png")
            return FileResponse(found.plot, media_type="image/png", headers={"cache-control": "no-cache"})


def _catch_up(index: RolloutIndex, rows: int = 0) -> None:
    """Start indexing what was appended since the last look; wait briefly for the rows asked for."""
    index.start_background()
    if rows:
        index.wait(rows, FIRST_PAGE_WAIT_S)


def _names(table: Any) -> list[str]:
    return sorted(v for v in table.values if v)
