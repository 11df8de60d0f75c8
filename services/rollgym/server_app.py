"""The busy routes of a server, served without FastAPI's and Starlette's per-request layers.

A rollout holds its agent's `/run`, its model server's `/v1/responses` and its environment calls open
while it works. Through FastAPI each such request passes a dozen ASGI layers (the error, telemetry and
body-limit middleware, the exception middleware, the router, the request handler, dependency solving):
about 14 KB of coroutine frames held per request in flight, and a fifth of the proxy agent's CPU per
model call. A route whose endpoint takes only the request, `str` path parameters and dependencies that
themselves take only the request (the session cookie), and returns a Response, needs none of it:
`ServerApp` serves such a route directly, behind the same guard (body limit, session cookie, a JSON
answer to a crash), the same bearer check and the same exception handlers. Every other request
(/health, the docs, routes with typed bodies or queries) goes through FastAPI as before, and every
route stays in the app's route table and OpenAPI schema.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match

# Parameters FastAPI would have to inject from somewhere other than the request itself.
_INJECTED = ("websocket_param_name", "http_connection_param_name", "response_param_name",
             "background_tasks_param_name", "security_scopes_param_name")


def _takes_only_the_request(dependant: Any) -> bool:
    return (not (dependant.query_params or dependant.header_params or dependant.cookie_params or dependant.body_params)
            and not any(getattr(dependant, name) for name in _INJECTED))


class HotRoute:
    """One route served directly: its endpoint called with the request, its path parameters and the values
    of its request-only dependencies."""

    def __init__(self, route: APIRoute) -> None:
        dependant = route.dependant
        self.endpoint = route.endpoint
        self.request_name = dependant.request_param_name
        self.dependencies = [(dep.name, dep.call, dep.request_param_name) for dep in dependant.dependencies]

    @classmethod
    def of(cls, route: Any) -> HotRoute | None:
        """A HotRoute for `route` when serving it directly changes nothing, else None."""
        if not isinstance(route, APIRoute) or route.response_model is not None:
            return None  # a response model means FastAPI validates and serialises what the endpoint returns
        dependant = route.dependant
        if not inspect.iscoroutinefunction(route.endpoint) or not _takes_only_the_request(dependant):
            return None
        if any(param.field_info.annotation is not str for param in dependant.path_params):
            return None
        for dep in dependant.dependencies:
            if (not inspect.iscoroutinefunction(dep.call) or dep.dependencies or dep.path_params
                    or not dep.request_param_name or not _takes_only_the_request(dep)):
                return None
        return cls(route)

    async def __call__(self, request: Request) -> Any:
        kwargs: dict[str, Any] = dict(request.path_params)
        if self.request_name:
            kwargs[self.request_name] = request
        for name, call, request_name in self.dependencies:
            kwargs[name] = await call(**{request_name: request})
        return await self.endpoint(**kwargs)


class ServerApp(FastAPI):
    """A FastAPI app that serves its hot routes (see the module doc) itself.

    `hot_guard` wraps an ASGI app in what every request of the server needs (rollgym.server builds it
    from the same middleware classes it adds to the FastAPI stack); `default_response` turns what an
    endpoint returned into a Response when it was not one already.
    """

    def __init__(self, *, hot_guard: Callable[[Any], Any], default_response: Callable[[Any], Response],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hot_guard = hot_guard
        self._default_response = default_response
        self._hot_app: Any = None
        self._routing: list[tuple[Any, HotRoute | None]] = []

    def hot_paths(self) -> list[str]:
        """The paths of the routes served directly (known once the first request came in)."""
        return [route.path for route, hot in self._routing if hot is not None]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if self._hot_app is None:  # built at the first request, once every route is registered
                self._routing = [(route, HotRoute.of(route)) for route in self.router.routes]
                self._hot_app = self._hot_guard(self._serve_hot)
            for route, hot in self._routing:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:  # the route FastAPI's router would pick
                    if hot is not None:
                        scope.update(child_scope, app=self, router=self.router)
                        scope["rollgym.hot_route"] = hot
                        await self._hot_app(scope, receive, send)
                        return
                    break
        await super().__call__(scope, receive, send)

    async def _serve_hot(self, scope: dict, receive: Any, send: Any) -> None:
        request = Request(scope, receive, send)
        try:
            response = await scope["rollgym.hot_route"](request)
        except Exception as exc:
            handler = self._exception_handler(exc)
            if handler is None:
                raise  # the guard answers it as a crash, as it does for FastAPI's routes
            response = handler(request, exc)
            if inspect.isawaitable(response):
                response = await response
        if not isinstance(response, Response):
            response = self._default_response(response)
        await response(scope, receive, send)

    def _exception_handler(self, exc: Exception) -> Callable[[Request, Exception], Any] | None:
        """The handler Starlette's exception middleware would pick: by status code for an HTTPException,
        else by the nearest class in the exception's MRO."""
        handlers = self.exception_handlers
        if isinstance(exc, StarletteHTTPException) and exc.status_code in handlers:
            return handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls in handlers:
                return handlers[cls]
        return None


__all__ = ["HotRoute", "ServerApp"]
