"""Session stores: the in-memory store and the SQLite store shared by a server's worker processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from resources_servers.weather.app import WeatherServer
from rollgym import ResourcesServerConfig
from rollgym.server import ServerStartError
from rollgym.sessions import SessionStore, SQLiteSessionStore, default_session_db, make_session_store
from rollgym.testing import final_response, serve_in_thread

Store = SessionStore | SQLiteSessionStore


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    opened: list[Store] = []

    def make(ttl_s: float = 3600.0, **kwargs: Any) -> Store:
        if request.param == "memory":
            store: Store = SessionStore(ttl_s=ttl_s, **kwargs)
        else:
            store = SQLiteSessionStore(tmp_path / "sessions.sqlite3", ttl_s=ttl_s, **kwargs)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


# --- both stores ------------------------------------------------------------------------------


async def test_sessions_are_isolated(make_store: Any) -> None:
    store = make_store()
    async with store.session("a") as state:
        state["items"] = [1]
    async with store.session("b") as state:
        assert state == {}
        state["items"] = [2]
    async with store.session("a") as state:
        assert state == {"items": [1]}
    async with store.session("b") as state:
        assert state == {"items": [2]}
    assert store.get("a") == {"items": [1]} and store.exists("b") and not store.exists("c")
    store.delete("a")
    assert not store.exists("a")
    async with store.session("a") as state:
        assert state == {}


async def test_sessions_expire_after_ttl(make_store: Any) -> None:
    store = make_store(ttl_s=0.1, sweep_every=1)
    async with store.session("old") as state:
        state["n"] = 1
    assert store.exists("old")
    await asyncio.sleep(0.15)
    async with store.session("new") as state:
        state["n"] = 2
    assert not store.exists("old") and store.exists("new")
    async with store.session("old") as state:
        assert state == {}  # expired: a fresh session
    assert len(store) == 2


async def test_concurrent_updates_of_different_sessions_never_cross(make_store: Any) -> None:
    store = make_store()
    rng = random.Random(0)
    sessions = [f"s{i}" for i in range(100)]

    async def worker(session_id: str, steps: int) -> None:
        for step in range(steps):
            async with store.session(session_id) as state:
                state.setdefault("log", [])
                await asyncio.sleep(rng.random() * 0.002)  # interleave with the other sessions
                state["log"].append(f"{session_id}:{step}")
                state["owner"] = session_id

    steps = {sid: 3 + i % 5 for i, sid in enumerate(sessions)}
    await asyncio.gather(*(worker(sid, steps[sid]) for sid in sessions))
    for sid in sessions:
        assert store.get(sid) == {"log": [f"{sid}:{n}" for n in range(steps[sid])], "owner": sid}


async def test_calls_of_one_session_are_serialised(make_store: Any) -> None:
    store = make_store()

    async def increment() -> None:
        async with store.session("shared") as state:
            value = state.get("n", 0)
            await asyncio.sleep(0.001)  # a read-modify-write that would lose updates if calls overlapped
            state["n"] = value + 1

    await asyncio.gather(*(increment() for _ in range(50)))
    assert store.get("shared") == {"n": 50}


def test_factory() -> None:
    assert isinstance(make_session_store("memory", 10.0), SessionStore)
    with pytest.raises(ValueError, match="path"):
        make_session_store("sqlite", 10.0)
    with pytest.raises(ValueError, match="unknown session store"):
        make_session_store("redis", 10.0)


# --- the SQLite store -------------------------------------------------------------------------------


async def test_sqlite_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    store = SQLiteSessionStore(path)
    async with store.session("a") as state:
        state.update(stock={"store": {"apple": 3}}, orders=[{"item": "pear", "quantity": 5}])
    store.close()
    reopened = SQLiteSessionStore(path)
    try:
        async with reopened.session("a") as state:
            assert state == {"stock": {"store": {"apple": 3}}, "orders": [{"item": "pear", "quantity": 5}]}
        assert reopened.get("missing") == {}
        assert reopened._conn().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        reopened.close()


async def test_sqlite_a_failed_call_saves_nothing_and_frees_the_session(tmp_path: Path) -> None:
    store = SQLiteSessionStore(tmp_path / "s.sqlite3")
    try:
        async with store.session("a") as state:
            state["n"] = 1
        with pytest.raises(RuntimeError, match="tool broke"):
            async with store.session("a") as state:
                state["n"] = 99
                raise RuntimeError("tool broke")
        with pytest.raises(TypeError, match="JSON"):
            async with store.session("a") as state:
                state["handle"] = object()
        async with store.session("a") as state:  # not left locked by either failure
            assert state == {"n": 1}
    finally:
        store.close()


async def test_sqlite_lease_of_a_crashed_process_lapses(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    crashed = SQLiteSessionStore(path, lease_s=0.3)
    assert crashed._claim("a", "dead-owner") == {}  # claimed and never released
    store = SQLiteSessionStore(path)
    try:
        started = time.monotonic()
        async with store.session("a") as state:
            state["n"] = 1
        waited = time.monotonic() - started
        assert 0.2 <= waited < 3.0
        assert store.get("a") == {"n": 1}
    finally:
        crashed.close()
        store.close()


def _child_increments(path: str, label: str, count: int, queue: Any) -> None:
    """Runs in a forked process: its own store on the same file."""

    async def main() -> None:
        store = SQLiteSessionStore(path)
        async with store.session("from-parent") as state:
            queue.put(("seen", dict(state)))
        for i in range(count):
            async with store.session("shared") as state:
                value = state.get("n", 0)
                await asyncio.sleep(0.0005)
                state["n"] = value + 1
                state.setdefault("by", []).append(f"{label}{i}")
        async with store.session(f"own-{label}") as state:
            state["label"] = label
        store.close()

    try:
        asyncio.run(main())
        queue.put(("done", label))
    except BaseException as exc:  # reported to the parent
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


async def test_sqlite_is_shared_by_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sqlite3")
    parent = SQLiteSessionStore(path)
    try:
        async with parent.session("from-parent") as state:
            state["hello"] = "child"
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        children = [context.Process(target=_child_increments, args=(path, label, 40, queue)) for label in "xy"]
        for child in children:
            child.start()
        # The parent increments the same session at the same time.
        for i in range(40):
            async with parent.session("shared") as state:
                value = state.get("n", 0)
                await asyncio.sleep(0.0005)
                state["n"] = value + 1
                state.setdefault("by", []).append(f"p{i}")
        messages = [queue.get(timeout=60) for _ in range(4)]
        for child in children:
            child.join(timeout=30)
            assert child.exitcode == 0
        assert not [m for m in messages if m[0] == "error"], messages
        assert [m[1] for m in messages if m[0] == "seen"] == [{"hello": "child"}] * 2
        shared = parent.get("shared")
        assert shared["n"] == 120  # no lost update across three processes
        assert sorted(shared["by"]) == sorted([f"{p}{i}" for p in "pxy" for i in range(40)])
        assert parent.get("own-x") == {"label": "x"} and parent.get("own-y") == {"label": "y"}
    finally:
        parent.close()


def _child_uses_inherited_store(store: SQLiteSessionStore, queue: Any) -> None:
    """Runs in a forked process with the parent's store object: it must open its own connections."""

    async def main() -> None:
        async with store.session("inherited") as state:
            state["child"] = state.get("parent", 0) + 1

    try:
        asyncio.run(main())
        store.close()  # closes the child's connections only
        queue.put("ok")
    except BaseException as exc:
        queue.put(f"{type(exc).__name__}: {exc}")


async def test_sqlite_store_inherited_through_fork_and_reused_after_close(tmp_path: Path) -> None:
    store = SQLiteSessionStore(tmp_path / "s.sqlite3")
    try:
        async with store.session("inherited") as state:
            state["parent"] = 41
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_child_uses_inherited_store, args=(store, queue))
        child.start()
        assert queue.get(timeout=60) == "ok"
        child.join(timeout=30)
        assert child.exitcode == 0
        # The parent's connections still work after the child closed its own.
        async with store.session("inherited") as state:
            assert state == {"parent": 41, "child": 42}
            state["parent"] = 43
        store.close()
        async with store.session("inherited") as state:  # a closed store reopens on use
            assert state["parent"] == 43
    finally:
        store.close()


# --- the resources server with each store ---------------------------------------------------------------


def weather_row(city: str) -> dict[str, Any]:
    return {"responses_create_params": {"input": f"What is the weather in {city}?"}, "city": city, "expected": ["x"]}




def test_server_default_sqlite_path_is_shared_by_its_workers(tmp_path: Path) -> None:
    secret = "s" * 32
    config = ResourcesServerConfig(session_store="sqlite")
    first = WeatherServer(config, name="weather", session_secret=secret)
    second = WeatherServer(config, name="weather", session_secret=secret)
    other_stack = WeatherServer(config, name="weather", session_secret="t" * 32)
    try:
        assert first.sessions.path == second.sessions.path != other_stack.sessions.path
        assert Path(first.sessions.path).parent == default_session_db("weather", "x").parent
        assert isinstance(WeatherServer(name="w").sessions, SessionStore)  # memory by default
        with pytest.raises(ServerStartError, match="session store"):
            WeatherServer(ResourcesServerConfig(session_store="sqlite", session_db=str(tmp_path)), name="w")
    finally:
        for server in (first, second, other_stack):
            server.sessions.close()
        Path(first.sessions.path).unlink(missing_ok=True)
        Path(other_stack.sessions.path).unlink(missing_ok=True)


def test_two_workers_share_sessions_over_http(tmp_path: Path) -> None:
    """Two servers on one SQLite file (as two worker processes would be): a session moves between them."""
    secret = "k" * 32
    config = ResourcesServerConfig(session_store="sqlite", session_db=str(tmp_path / "weather.sqlite3"))
    workers = [WeatherServer(config, name="weather", session_secret=secret) for _ in range(2)]
    with serve_in_thread(workers[0]) as url_a, serve_in_thread(workers[1]) as url_b:
        with httpx.Client(base_url=url_a) as a:
            assert a.post("/seed_session", json=weather_row("Paris")).status_code == 200
            cookies = dict(a.cookies)
        with httpx.Client(base_url=url_b, cookies=cookies) as b:
            assert b.post("/get_weather", json={"city": "Paris"}).text == "Paris: sunny, 22 C"
        with httpx.Client(base_url=url_a, cookies=cookies) as a:
            assert a.post("/get_weather", json={"city": "Oslo"}).status_code == 200
            verdict = a.post("/verify", json={**weather_row("Paris"), "response": final_response("?")}).json()
    assert verdict["looked_up"] == ["Paris", "Oslo"]
