"""inventory: the world's pure functions, the reward, and the server over real HTTP (both session stores)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from resources_servers.inventory.app import (
    InventoryServer,
    InventoryTask,
    add_item,
    inventory_reward,
    list_inventory,
    new_world,
    place_order,
    remove_item,
    transfer,
)
from rollgym import ResourcesServerConfig
from rollgym.envkit.folder import env_folder
from rollgym.sessions import SQLiteSessionStore
from rollgym.testing import final_response, serve_in_thread

ENV = env_folder(__file__)
DATA = ENV.examples
ROWS = ENV.rows()

# A correct tool sequence for each example row, in order.
GOOD = [
    [("transfer", {"item": "apple", "quantity": 3, "from_location": "warehouse", "to_location": "store"}),
     ("place_order", {"item": "pear", "quantity": 5, "location": "store"})],
    [("list_inventory", {"location": "store"}),
     ("transfer", {"item": "banana", "quantity": 8, "from_location": "warehouse", "to_location": "store"})],
    [("remove_item", {"location": "store", "item": "egg", "quantity": 6})],
    [("transfer", {"item": "shirt", "quantity": 5, "from_location": "warehouse", "to_location": "store"}),
     ("transfer", {"item": "shirt", "quantity": 5, "from_location": "warehouse", "to_location": "outlet"})],
    [("place_order", {"item": "coffee", "quantity": 10, "location": "warehouse"}),
     ("place_order", {"item": "tea", "quantity": 4, "location": "warehouse"}),
     ("add_item", {"location": "store", "item": "tea", "quantity": 2})],
]




def world(initial: dict, target: dict | None = None, prices: dict | None = None) -> dict[str, Any]:
    task = InventoryTask.model_validate({"responses_create_params": {"input": "x"}, "initial": initial,
                                         "target": target or {"store": {"x": 0}}, "prices": prices})
    return new_world(task)


# --- pure functions -------------------------------------------------------------------------------


def test_world_tools() -> None:
    w = world({"Warehouse ": {"Apple": 10, "pear": 0}, "store": {}}, {"outlet": {"apple": 1}})
    assert w["locations"] == ["outlet", "store", "warehouse"]  # names are trimmed and lower-cased
    assert list_inventory(w, None) == {"outlet": {}, "store": {}, "warehouse": {"apple": 10}}
    assert list_inventory(w, "garage") == "Error: unknown location 'garage'. Known locations: outlet, store, warehouse."
    assert transfer(w, "apple", 4, "warehouse", "store") == (
        "Moved 4 apple from warehouse to store. warehouse now has 6 apple; store now has 4 apple.")
    assert transfer(w, "apple", 7, "warehouse", "store").startswith(
        "Error: cannot transfer 7 apple from warehouse: only 6 in stock (warehouse has apple=6).")
    assert transfer(w, "apple", 1, "store", "store").startswith("Error: from_location and to_location are both")
    assert transfer(w, "apple", 1, "store", "garage").startswith("Error: unknown location 'garage'")
    assert remove_item(w, "store", "apple", 5) == (
        "Error: cannot remove 5 apple from store: only 4 in stock (store has apple=4). Nothing was changed.")
    assert remove_item(w, "store", "apple", 4) == "Removed 4 apple from store. store now has 0 apple."
    assert add_item(w, "outlet", "kiwi", 2) == "Added 2 kiwi to outlet. outlet now has 2 kiwi."
    assert place_order(w, "kiwi", 3, "outlet") == "Order #1 placed: 3 kiwi delivered to outlet. outlet now has 5 kiwi."
    assert list_inventory(w, "store") == {"store": {}}
    assert w["stock"] == {"outlet": {"kiwi": 5}, "store": {}, "warehouse": {"apple": 6}}
    assert w["orders"] == [{"id": 1, "item": "kiwi", "quantity": 3, "location": "outlet"}]


def test_orders_with_prices() -> None:
    w = world({"store": {}}, prices={"pear": 0.8})
    assert place_order(w, "pear", 5, "store") == (
        "Order #1 placed: 5 pear delivered to store. Cost: 4.00. store now has 5 pear.")
    assert place_order(w, "plum", 1, "store") == "Error: 'plum' cannot be ordered. Items for sale: pear."
    assert w["orders"] == [{"id": 1, "item": "pear", "quantity": 5, "location": "store", "unit_price": 0.8, "total": 4.0}]


def test_reward_is_the_fraction_of_exact_entries() -> None:
    target = {"store": {"apple": 4, "pear": 5}, "warehouse": {"apple": 7, "pear": 2}}
    assert inventory_reward({"store": {"apple": 4, "pear": 5}, "warehouse": {"apple": 7, "pear": 2, "kiwi": 9}},
                            target) == (1.0, {"store/apple": 1.0, "store/pear": 1.0, "warehouse/apple": 1.0,
                                              "warehouse/pear": 1.0})
    reward, components = inventory_reward({"store": {"apple": 4}, "warehouse": {"apple": 7, "pear": 3}}, target)
    assert reward == 0.5
    assert components == {"store/apple": 1.0, "store/pear": 0.0, "warehouse/apple": 1.0, "warehouse/pear": 0.0}
    # A target of 0 is met by an item that is absent; a missing location holds nothing.
    assert inventory_reward({}, {"store": {"milk": 0}, "outlet": {"tea": 1}}) == (0.5, {"outlet/tea": 0.0, "store/milk": 1.0})


# --- config ----------------------------------------------------------------------------------------


def test_config_builds() -> None:
    assert isinstance(ENV.build("inventory"), InventoryServer)
    agent = ENV.build("inventory_agent")
    assert agent.config.max_steps == 12 and agent.config.resources_server.name == "inventory"


# --- over HTTP ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http() -> Any:
    with serve_in_thread(InventoryServer(name="inventory")) as url, httpx.Client(base_url=url) as client:
        yield client


def call(http: httpx.Client, name: str, args: dict[str, Any]) -> httpx.Response:
    reply = http.post(f"/{name}", json=args)
    assert reply.status_code == 200, reply.text
    return reply


def verify(http: httpx.Client, row: dict[str, Any]) -> dict[str, Any]:
    reply = http.post("/verify", json={**row, "response": final_response("Done.")})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_tools_match_the_example_rows(http: httpx.Client) -> None:
    tools = http.get("/tools").json()
    assert [t["name"] for t in tools] == ["add_item", "list_inventory", "place_order", "remove_item", "transfer"]
    assert len(ROWS) == 5
    for row in ROWS:
        assert row["responses_create_params"]["tools"] == tools
        assert row["responses_create_params"]["input"][-1]["role"] == "user"


@pytest.mark.parametrize("index", range(5))
def test_known_good_sequence_scores_one(http: httpx.Client, index: int) -> None:
    row = ROWS[index]
    assert http.post("/seed_session", json=row).status_code == 200
    for name, args in GOOD[index]:
        assert not call(http, name, args).text.startswith("Error")
    result = verify(http, row)
    assert result["reward"] == 1.0
    assert set(result["reward_components"].values()) == {1.0}
    assert result["final_stock"] == {loc: {i: q for i, q in items.items() if q} for loc, items in
                                     {**{loc: {} for loc in row["initial"]}, **row["target"]}.items()}


def test_known_bad_sequence_gets_exact_partial_credit(http: httpx.Client) -> None:
    row = ROWS[0]  # target: store apple 4 + pear 5, warehouse apple 7 + pear 2
    assert http.post("/seed_session", json=row).status_code == 200
    # Ordered pears for the warehouse instead of the store, and moved the apples.
    call(http, "transfer", {"item": "apple", "quantity": 3, "from_location": "warehouse", "to_location": "store"})
    call(http, "place_order", {"item": "pear", "quantity": 5, "location": "warehouse"})
    result = verify(http, row)
    assert result["reward"] == 0.5
    assert result["reward_components"] == {"store/apple": 1.0, "store/pear": 0.0, "warehouse/apple": 1.0,
                                           "warehouse/pear": 0.0}
    assert result["orders"] == [{"id": 1, "item": "pear", "quantity": 5, "location": "warehouse",
                                 "unit_price": 0.8, "total": 4.0}]
    # Doing nothing: only the untouched entry (warehouse pear 2) is right.
    assert http.post("/seed_session", json=row).status_code == 200
    nothing = verify(http, row)
    assert nothing["reward"] == 0.25 and nothing["actions"] == 0
    # Re-seeding resets the world.
    assert nothing["final_stock"] == {"store": {"apple": 1}, "warehouse": {"apple": 10, "pear": 2}}


def test_mistakes_are_tool_outputs(http: httpx.Client) -> None:
    row = ROWS[0]
    assert http.post("/seed_session", json=row).status_code == 200
    unknown = call(http, "add_item", {"location": "garage", "item": "apple", "quantity": 1})
    assert unknown.headers["content-type"].startswith("text/plain")
    assert unknown.text == "Error: unknown location 'garage'. Known locations: store, warehouse."
    too_many = call(http, "remove_item", {"location": "store", "item": "apple", "quantity": 2})
    assert too_many.text.startswith("Error: cannot remove 2 apple from store: only 1 in stock")
    assert call(http, "list_inventory", {}).json() == {"store": {"apple": 1}, "warehouse": {"apple": 10, "pear": 2}}


@pytest.mark.parametrize(
    ("tool", "args", "field"),
    [
        ("add_item", {"location": "store", "item": "apple", "quantity": 0}, "quantity"),
        ("add_item", {"location": "store", "item": "apple", "quantity": -3}, "quantity"),
        ("add_item", {"location": "store", "item": "apple", "quantity": 1.5}, "quantity"),
        ("add_item", {"location": "store", "item": "apple", "quantity": True}, "quantity"),
        ("add_item", {"location": "store", "item": "apple", "quantity": "many"}, "quantity"),
        ("remove_item", {"location": "store", "quantity": 1}, "item"),
        ("transfer", {"item": "apple", "quantity": 1, "from_location": "warehouse"}, "to_location"),
        ("transfer", {"item": "apple", "quantity": 1, "from_location": "", "to_location": "store"}, "from_location"),
        ("place_order", {"item": "pear", "quantity": 1, "location": "store", "rush": True}, "rush"),
        ("list_inventory", {"location": 5}, "location"),
    ],
)
def test_bad_arguments_are_422_naming_the_field(http: httpx.Client, tool: str, args: dict, field: str) -> None:
    reply = http.post(f"/{tool}", json=args)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == field


def test_bad_task_rows_are_422(http: httpx.Client) -> None:
    base = {"responses_create_params": {"input": "x"}, "initial": {"store": {}}}
    for bad, field in [({**base}, "target"), ({**base, "target": {"store": {}}}, "body"),
                       ({**base, "target": {"store": {"apple": -1}}}, "target.store.apple")]:
        reply = http.post("/seed_session", json=bad)
        assert reply.status_code == 422, reply.text
        assert reply.json()["error"]["field"] == field


def test_tool_on_an_unseeded_session_is_an_env_failure() -> None:
    with serve_in_thread(InventoryServer(name="inventory")) as url, httpx.Client(base_url=url) as client:
        reply = client.post("/list_inventory", json={})
        assert reply.status_code == 500
        assert "SessionNotSeeded" in reply.json()["error"]["message"]


# --- 200 sessions at once: no cross-talk -------------------------------------------------------------------


def session_plan(i: int) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """A task row and a tool sequence unique to session i (different tools, items and quantities)."""
    own = f"item{i}"
    initial = {"warehouse": {own: 50 + i, "shared": 10 + i % 7}, "store": {"shared": i % 3}}
    plans = [
        [("transfer", {"item": own, "quantity": 1 + i % 5, "from_location": "warehouse", "to_location": "store"}),
         ("place_order", {"item": "shared", "quantity": 1 + i, "location": "store"}),
         ("remove_item", {"location": "warehouse", "item": "shared", "quantity": 1 + i % 4})],
        [("add_item", {"location": "store", "item": own, "quantity": 2 + i}),
         ("list_inventory", {}),
         ("transfer", {"item": "shared", "quantity": 3, "from_location": "warehouse", "to_location": "store"})],
        [("place_order", {"item": own, "quantity": 7, "location": "warehouse"}),
         ("remove_item", {"location": "warehouse", "item": own, "quantity": 2 + i % 9}),
         ("add_item", {"location": "warehouse", "item": f"extra{i}", "quantity": 1 + i % 11})],
        [("list_inventory", {"location": "warehouse"}),
         ("transfer", {"item": own, "quantity": 10, "from_location": "warehouse", "to_location": "store"}),
         ("transfer", {"item": own, "quantity": 4, "from_location": "store", "to_location": "warehouse"}),
         ("place_order", {"item": f"new{i}", "quantity": i + 1, "location": "store"})],
    ]
    return {"responses_create_params": {"input": f"session {i}"}, "initial": initial,
            "target": {"store": {own: 0}}}, plans[i % 4]


def expected_final(row: dict[str, Any], plan: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The reference: the same sequence applied locally with the pure functions."""
    w = new_world(InventoryTask.model_validate(row))
    functions = {"add_item": add_item, "remove_item": remove_item, "transfer": transfer, "place_order": place_order}
    for name, args in plan:
        if name != "list_inventory":
            functions[name](w, **args)
    return w["stock"]


async def run_sessions(urls: list[str], count: int = 200) -> None:
    rng = random.Random(7)
    plans = [session_plan(i) for i in range(count)]
    expected = [expected_final(row, plan) for row, plan in plans]

    async def one(i: int) -> dict[str, Any]:
        row, plan = plans[i]
        # One client per session (its own cookie); each call may land on any of the workers.
        # verify=False: plain http anyway, and it skips building a TLS context per client (~50 ms each).
        clients = [httpx.AsyncClient(base_url=url, timeout=60.0, verify=False) for url in urls]
        try:
            first = clients[0]
            seeded = await first.post("/seed_session", json=row)
            assert seeded.status_code == 200, seeded.text
            cookies = dict(first.cookies)
            for client in clients[1:]:
                client.cookies.update(cookies)
            for name, args in plan:
                await asyncio.sleep(rng.random() * 0.01)  # interleave differently in every session
                reply = await rng.choice(clients).post(f"/{name}", json=args)
                assert reply.status_code == 200, reply.text
                assert not reply.text.startswith("Error"), (i, name, reply.text)
            verified = await rng.choice(clients).post("/verify", json={**row, "response": final_response("done")})
            assert verified.status_code == 200, verified.text
            return verified.json()
        finally:
            for client in clients:
                await client.aclose()

    results = await asyncio.gather(*(one(i) for i in range(count)))
    for i, result in enumerate(results):
        assert result["responses_create_params"]["input"] == f"session {i}"
        assert result["final_stock"] == expected[i], i
        own_left = expected[i]["store"].get(f"item{i}", 0)
        assert result["reward"] == float(own_left == 0)


def test_200_parallel_sessions_memory_store() -> None:
    with serve_in_thread(InventoryServer(name="inventory")) as url:
        asyncio.run(run_sessions([url]))


def test_200_parallel_sessions_sqlite_store_two_workers(tmp_path: Path) -> None:
    # Two servers on one session file with one secret: what two worker processes of one server are.
    config = ResourcesServerConfig(session_store="sqlite", session_db=str(tmp_path / "inventory.sqlite3"))
    workers = [InventoryServer(config, name="inventory", session_secret="w" * 32) for _ in range(2)]
    with serve_in_thread(workers[0]) as url_a, serve_in_thread(workers[1]) as url_b:
        asyncio.run(run_sessions([url_a, url_b]))
    reopened = SQLiteSessionStore(tmp_path / "inventory.sqlite3")
    try:
        assert len(reopened) == 200
    finally:
        reopened.close()


def test_step_rewards_are_the_progress_of_each_call() -> None:
    """step_rewards: true answers each call with the change in the fraction of matched entries (header
    x-rollgym-reward), the output text unchanged; they add up to the last fraction minus the first. Off
    (the default, the `http` fixture's server), no call carries one."""
    from resources_servers.inventory.app import InventoryConfig
    from rollgym.resources import TOOL_REWARD_HEADER

    row = ROWS[0]  # starts at 0.25 (warehouse pear 2 already right)
    steps = [("list_inventory", {}, 0.0),
             ("transfer", {"item": "apple", "quantity": 3, "from_location": "warehouse", "to_location": "store"}, 0.5),
             # an order for the wrong location breaks the matched warehouse/pear entry
             ("place_order", {"item": "pear", "quantity": 5, "location": "warehouse"}, -0.25),
             ("remove_item", {"location": "warehouse", "item": "pear", "quantity": 50}, 0.0)]  # refused: no change
    with serve_in_thread(InventoryServer(InventoryConfig(step_rewards=True), name="inventory")) as url, \
            httpx.Client(base_url=url) as client:
        assert client.post("/seed_session", json=row).status_code == 200
        rewards = []
        for name, args, expected in steps:
            reply = call(client, name, args)
            rewards.append(float(reply.headers[TOOL_REWARD_HEADER]))
            assert rewards[-1] == pytest.approx(expected), name
        assert call(client, "transfer", steps[1][1]).text.startswith("Moved 3 apple")
        final = verify(client, row)["reward"]
    assert 0.25 + sum(rewards) == pytest.approx(0.5) and final == pytest.approx(0.0)  # the last transfer broke both


def test_without_step_rewards_no_call_carries_one(http: httpx.Client) -> None:
    from rollgym.resources import TOOL_REWARD_HEADER

    assert http.post("/seed_session", json=ROWS[0]).status_code == 200
    reply = call(http, "transfer", {"item": "apple", "quantity": 3, "from_location": "warehouse", "to_location": "store"})
    assert TOOL_REWARD_HEADER not in reply.headers
