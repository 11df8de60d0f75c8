"""Inventory: a small warehouse/shop world per session, changed step by step with tools.

The task row seeds stock per location (`initial`), names the stock the user wants (`target`) and
optionally unit `prices`. Tools list, add, remove, transfer and order stock. Reward: the fraction
of target entries (location, item) whose final quantity matches exactly; 1.0 only when all match.

The state is plain JSON, so this environment runs with either session store (memory or sqlite).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, model_validator

from rollgym import ResourcesServer, RunRequest, Verdict, tool
from rollgym.resources import ResourcesServerConfig, Rewarded

MAX_QUANTITY = 1_000_000


def _no_bool(value: Any) -> Any:
    # pydantic reads true as 1; a boolean quantity is a model mistake, not a count.
    if isinstance(value, bool):
        raise ValueError("must be an integer, not a boolean")
    return value


Name = Annotated[str, StringConstraints(strip_whitespace=True, to_lower=True, min_length=1, max_length=64)]
Quantity = Annotated[int, Field(gt=0, le=MAX_QUANTITY), BeforeValidator(_no_bool)]
Count = Annotated[int, Field(ge=0, le=MAX_QUANTITY), BeforeValidator(_no_bool)]
Stock = dict[Name, dict[Name, Count]]


class InventoryTask(RunRequest):
    initial: Stock = Field(description="starting stock: {location: {item: quantity}}")
    target: Stock = Field(min_length=1, description="the stock wanted at the end: {location: {item: quantity}}")
    prices: dict[Name, Annotated[float, Field(ge=0)]] | None = Field(
        default=None, description="unit prices; when given, only these items can be ordered"
    )

    @model_validator(mode="after")
    def _has_target_entries(self) -> InventoryTask:
        if not any(self.target.values()):
            raise ValueError("target names no (location, item) entry")
        return self


# --- tool arguments ---------------------------------------------------------------------------------


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListInventoryArgs(Args):
    location: Name | None = Field(default=None, description="one location, or omit for all")


class AddItemArgs(Args):
    location: Name = Field(description="where to add, e.g. warehouse")
    item: Name = Field(description="item name, e.g. apple")
    quantity: Quantity = Field(description="how many (a positive integer)")


class RemoveItemArgs(AddItemArgs):
    pass


class TransferArgs(Args):
    item: Name = Field(description="item name, e.g. apple")
    quantity: Quantity = Field(description="how many (a positive integer)")
    from_location: Name = Field(description="where the items are now")
    to_location: Name = Field(description="where they should go")


class PlaceOrderArgs(Args):
    item: Name = Field(description="item name, e.g. pear")
    quantity: Quantity = Field(description="how many (a positive integer)")
    location: Name = Field(description="where the delivery goes")


# --- the world: pure functions on the JSON state ----------------------------------------------------


class SessionNotSeeded(RuntimeError):
    """A tool or verify call on a session without an inventory (never seeded, or expired)."""


def new_world(task: InventoryTask) -> dict[str, Any]:
    locations = sorted(set(task.initial) | set(task.target))
    stock = {loc: {item: qty for item, qty in task.initial.get(loc, {}).items() if qty > 0} for loc in locations}
    return {"locations": locations, "stock": stock, "orders": [], "prices": task.prices, "actions": []}


def world_of(state: dict[str, Any]) -> dict[str, Any]:
    if "stock" not in state:
        raise SessionNotSeeded("this session has no inventory: /seed_session was not called or the session expired")
    return state


def _unknown(location: str, world: dict[str, Any]) -> str | None:
    if location in world["stock"]:
        return None
    return f"Error: unknown location '{location}'. Known locations: {', '.join(world['locations'])}."


def _describe(stock: dict[str, int]) -> str:
    return ", ".join(f"{item}={qty}" for item, qty in sorted(stock.items())) or "nothing"


def _change(world: dict[str, Any], location: str, item: str, delta: int) -> int:
    shelf = world["stock"][location]
    shelf[item] = shelf.get(item, 0) + delta
    if shelf[item] == 0:
        del shelf[item]
    return shelf.get(item, 0)


def list_inventory(world: dict[str, Any], location: str | None) -> dict[str, Any] | str:
    if location is not None:
        error = _unknown(location, world)
        if error:
            return error
        return {location: dict(sorted(world["stock"][location].items()))}
    return {loc: dict(sorted(world["stock"][loc].items())) for loc in world["locations"]}


def add_item(world: dict[str, Any], location: str, item: str, quantity: int) -> str:
    if error := _unknown(location, world):
        return error
    now = _change(world, location, item, quantity)
    world["actions"].append(["add", location, item, quantity])
    return f"Added {quantity} {item} to {location}. {location} now has {now} {item}."


def remove_item(world: dict[str, Any], location: str, item: str, quantity: int) -> str:
    if error := _unknown(location, world):
        return error
    have = world["stock"][location].get(item, 0)
    if have < quantity:
        return (f"Error: cannot remove {quantity} {item} from {location}: only {have} in stock "
                f"({location} has {_describe(world['stock'][location])}). Nothing was changed.")
    now = _change(world, location, item, -quantity)
    world["actions"].append(["remove", location, item, quantity])
    return f"Removed {quantity} {item} from {location}. {location} now has {now} {item}."


def transfer(world: dict[str, Any], item: str, quantity: int, from_location: str, to_location: str) -> str:
    if error := _unknown(from_location, world) or _unknown(to_location, world):
        return error
    if from_location == to_location:
        return f"Error: from_location and to_location are both '{from_location}'. Nothing was changed."
    have = world["stock"][from_location].get(item, 0)
    if have < quantity:
        return (f"Error: cannot transfer {quantity} {item} from {from_location}: only {have} in stock "
                f"({from_location} has {_describe(world['stock'][from_location])}). Nothing was changed.")
    left = _change(world, from_location, item, -quantity)
    now = _change(world, to_location, item, quantity)
    world["actions"].append(["transfer", item, quantity, from_location, to_location])
    return (f"Moved {quantity} {item} from {from_location} to {to_location}. "
            f"{from_location} now has {left} {item}; {to_location} now has {now} {item}.")


def place_order(world: dict[str, Any], item: str, quantity: int, location: str) -> str:
    if error := _unknown(location, world):
        return error
    prices = world.get("prices")
    if prices is not None and item not in prices:
        return f"Error: '{item}' cannot be ordered. Items for sale: {', '.join(sorted(prices)) or 'none'}."
    order: dict[str, Any] = {"id": len(world["orders"]) + 1, "item": item, "quantity": quantity, "location": location}
    cost = ""
    if prices is not None:
        order["unit_price"] = prices[item]
        order["total"] = round(prices[item] * quantity, 2)
        cost = f" Cost: {order['total']:.2f}."
    world["orders"].append(order)
    now = _change(world, location, item, quantity)
    world["actions"].append(["order", item, quantity, location])
    return (f"Order #{order['id']} placed: {quantity} {item} delivered to {location}.{cost} "
            f"{location} now has {now} {item}.")


def inventory_reward(stock: dict[str, dict[str, int]], target: dict[str, dict[str, int]]) -> tuple[float, dict[str, float]]:
    """(reward, components): each target (location, item) scores 1.0 if its final quantity is exact."""
    components = {
        f"{location}/{item}": float(stock.get(location, {}).get(item, 0) == quantity)
        for location, items in sorted(target.items())
        for item, quantity in sorted(items.items())
    }
    return sum(components.values()) / len(components), components


# --- the server ----------------------------------------------------------------------------------


class InventoryConfig(ResourcesServerConfig):
    step_rewards: bool = Field(default=False, description="answer each tool call with a step reward: the "
                               "change it made to the fraction of target entries matched")


class InventoryServer(ResourcesServer):
    task_model = InventoryTask
    config_class = InventoryConfig

    async def seed(self, task: InventoryTask, state: dict[str, Any]) -> None:
        state.update(new_world(task))
        state["target"] = task.target  # what a step reward measures progress toward

    def _step(self, state: dict[str, Any], output: Any, before: float) -> Any:
        """The tool's output, with `step_rewards` the progress it made: Δ of the verify reward's fraction
        (potential-based shaping: a rollout's step rewards add up to its final fraction minus its first)."""
        if not getattr(self.config, "step_rewards", False):
            return output
        return Rewarded(output, self._progress(state) - before)

    def _progress(self, state: dict[str, Any]) -> float:
        world = world_of(state)
        return inventory_reward(world["stock"], state["target"])[0] if "target" in world else 0.0

    @tool
    async def list_inventory(self, args: ListInventoryArgs, state: dict[str, Any]) -> Any:
        """List the stock of one location, or of every location when none is given."""
        before = self._progress(state)
        return self._step(state, list_inventory(world_of(state), args.location), before)

    @tool
    async def add_item(self, args: AddItemArgs, state: dict[str, Any]) -> Any:
        """Add a quantity of an item to a location's stock."""
        before = self._progress(state)
        return self._step(state, add_item(world_of(state), args.location, args.item, args.quantity), before)

    @tool
    async def remove_item(self, args: RemoveItemArgs, state: dict[str, Any]) -> Any:
        """Remove a quantity of an item from a location's stock (fails if there is not enough)."""
        before = self._progress(state)
        return self._step(state, remove_item(world_of(state), args.location, args.item, args.quantity), before)

    @tool
    async def transfer(self, args: TransferArgs, state: dict[str, Any]) -> Any:
        """Move a quantity of an item from one location to another."""
        before = self._progress(state)
        output = transfer(world_of(state), args.item, args.quantity, args.from_location, args.to_location)
        return self._step(state, output, before)

    @tool
    async def place_order(self, args: PlaceOrderArgs, state: dict[str, Any]) -> Any:
        """Order new stock of an item, delivered to a location."""
        before = self._progress(state)
        return self._step(state, place_order(world_of(state), args.item, args.quantity, args.location), before)

    async def verify(self, request: InventoryTask, state: dict[str, Any]) -> Verdict:
        world = world_of(state)
        reward, components = inventory_reward(world["stock"], request.target)
        return Verdict(
            reward=reward,
            components=components,
            details={"final_stock": world["stock"], "orders": world["orders"], "actions": len(world["actions"])},
        )
