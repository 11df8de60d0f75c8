"""The model calls of one proxied rollout: what was sent, what came back, and the tokens behind it.

An external agent only speaks chat: it echoes the conversation back without token fields. Before a
call goes to the model server, `restore_tokens` finds the turns this rollout generated in the
echoed history and puts their token record back on them, so the model server extends the exact
tokens it sampled (no re-tokenisation drift). After the rollout, `sequences` groups the calls into
token chains: a call whose prompt extends a chain joins it; one that does not starts a new chain.
A new chain is a legitimate branch (parallel calls, a sub-agent, another prompt) unless its
conversation continues an earlier call's conversation; then the tokens drifted and that sequence
says `prefix_ok: false`. Each sequence (a segment of the rollout) is labelled with the `conversation`
it belongs to and why it began (`segment_reason`, `rollgym.sequences.SEGMENT_REASONS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rollgym.schema import TOKEN_FIELDS
from rollgym.sequences import merge_sequences, token_record
from rollgym.text import message_text

Signature = tuple[Any, ...]


def _canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments compared by meaning: SDKs re-serialise them with other spacing."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"))


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(str(part.get("text", "")) for part in output if isinstance(part, dict))
    return json.dumps(output, sort_keys=True)


def signature(item: Any) -> Signature | None:
    """What identifies an item in a conversation, whatever SDK echoed it; None for items that do not
    count (reasoning, which chat SDKs drop)."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type") or "message"
    if kind == "message":
        return ("message", item.get("role"), message_text(item).strip())
    if kind == "function_call":
        return ("function_call", item.get("call_id"), item.get("name"), _canonical_arguments(item.get("arguments")))
    if kind == "function_call_output":
        return ("function_call_output", item.get("call_id"), _output_text(item.get("output")).strip())
    return None


def signatures(items: list[dict[str, Any]]) -> list[Signature]:
    return [sig for sig in map(signature, items) if sig is not None]


def strip_tokens(item: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in item.items() if key not in TOKEN_FIELDS}


@dataclass
class Call:
    """One model call of the rollout, as forwarded: its input (tokens restored) and its output."""

    input: list[dict[str, Any]]
    output: list[dict[str, Any]]
    status: str = "completed"
    usage: dict[str, Any] = field(default_factory=dict)
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        self.input_signatures = signatures(self.input)
        self.output_signatures = signatures(self.output)
        # The last output item with a token record carries the call's tokens (found once: restore_tokens
        # looks at every earlier call on every call of the rollout).
        self.record_item, self.record = next(((item, record) for item in reversed(self.output)
                                              if (record := token_record(item)) is not None), (None, None))
        # The named policy that answered (rollgym.policies), as the model server stamped it.
        policy = self.record_item.get("policy") if self.record_item is not None else None
        self.policy: str | None = policy if isinstance(policy, str) else None

    @property
    def conversation(self) -> list[Signature]:
        return self.input_signatures + self.output_signatures


@dataclass
class Capture:
    """Every model call of one rollout, in the order they finished."""

    calls: list[Call] = field(default_factory=list)

    def restore_tokens(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`items` with this rollout's token record put back on the latest generated turn they echo.

        A turn counts as echoed only when the conversation before it is that call's input too: a
        turn found in another context is left alone (the model server then renders it afresh). Only
        the latest echoed turn gets its record: a model server extends the last record in its input,
        and earlier ones would grow every request by every earlier prompt (calls² token ids).
        """
        items = list(items)
        signed = [(index, sig) for index, sig in enumerate(map(signature, items)) if sig is not None]
        given = [sig for _, sig in signed]
        latest: tuple[int, dict[str, Any]] | None = None  # (position, the call's record item)
        for call in self.calls:
            n_in, n_out = len(call.input_signatures), len(call.output_signatures)
            if call.record_item is None or n_out == 0 or len(given) < n_in + n_out:
                continue
            if given[:n_in] == call.input_signatures and given[n_in:n_in + n_out] == call.output_signatures:
                at = signed[n_in + n_out - 1][0]
                if latest is None or at > latest[0]:
                    latest = (at, call.record_item)
        if latest is not None and token_record(items[latest[0]]) is None:
            at, record_item = latest
            items[at] = {**items[at], **{name: record_item[name] for name in TOKEN_FIELDS}}
        return items

    def transcript(self) -> list[dict[str, Any]]:
        """Every generated item of every call, each preceded by the tool outputs the agent fed back
        to it (once each): the rollout's `response.output`."""
        items: list[dict[str, Any]] = []
        called: set[Any] = set()
        answered: set[Any] = set()
        for call in self.calls:
            for item in call.input:
                if item.get("type") == "function_call_output" and item.get("call_id") in called - answered:
                    answered.add(item.get("call_id"))
                    items.append(strip_tokens(item))
            for item in call.output:
                if item.get("type") == "function_call":
                    called.add(item.get("call_id"))
                items.append(item)
        return items

    def sequences(self) -> tuple[list[dict[str, Any]], bool | None]:
        """Trainer sequences, one per token chain, each with its own `prefix_ok`; and whether all are ok.

        None when no call carried tokens.
        """
        chains: list[list[Call]] = []
        drifted: list[bool] = []
        labels: list[tuple[int, str | None]] = []  # each chain's (conversation, segment_reason)
        for call in self.calls:
            record = call.record
            if record is None:
                continue
            home = handed = None  # the chain it extends; one of another policy's that it extends
            for index, chain in enumerate(chains):
                last = chain[-1].record
                context = last.prompt + last.generation
                if record.prompt[: len(context)] == context:
                    if chain[-1].policy != call.policy:  # each policy's calls are segments of their own
                        handed = index
                    elif home is None or len(context) > home[1]:
                        home = (index, len(context))
            if home is not None:
                chains[home[0]].append(call)
                continue
            if handed is not None:  # it carries the other policy's tokens on exactly: no drift
                labels.append((labels[handed][0], "another_policy"))
                chains.append([call])
                drifted.append(False)
                continue
            # A new chain: a branch, or drift if the agent carried on an earlier call's conversation.
            continues = any(call.input_signatures[: len(chain[-1].conversation)] == chain[-1].conversation
                            for chain in chains)
            labels.append(_label(call, chains, labels, continues))
            chains.append([call])
            drifted.append(continues)
        if not chains:
            return [], None
        result = []
        for chain, drift, (conversation, reason) in zip(chains, drifted, labels):
            merged, _ = merge_sequences([item for call in chain for item in call.output])
            sequence = merged[0]
            sequence.update(prefix_ok=not drift, conversation=conversation, segment_reason=reason,
                            calls=segment_calls(chain))
            if chain[0].policy is not None:
                sequence["policy"] = chain[0].policy
            result.append(sequence)
        return result, not any(drifted)


def segment_calls(chain: list[Call]) -> list[dict[str, Any]]:
    """The model calls of one segment as a viewer shows them, without token fields: each call's input items
    (for a call that continues the one before, only the items it added: tool outputs, a new user turn) and
    its output items. A segment's messages are its own, not its rollout's first call's."""
    calls: list[dict[str, Any]] = []
    before: list[Signature] = []
    for call in chain:
        if before and call.input_signatures[: len(before)] == before:
            added = _after_signed(call.input, len(before))
        else:
            added = call.input
        calls.append({"input": [strip_tokens(item) for item in added],
                      "output": [strip_tokens(item) for item in call.output]})
        before = call.conversation
    return calls


def _after_signed(items: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The items after the first `count` that have a signature (unsigned ones, such as reasoning, in between
    belong to the part already shown)."""
    seen = 0
    for index, item in enumerate(items):
        if seen == count:
            return items[index:]
        if signature(item) is not None:
            seen += 1
    return []


def _label(call: Call, chains: list[list[Call]], labels: list[tuple[int, str | None]],
           continues: bool) -> tuple[int, str | None]:
    """The conversation a new chain belongs to and why it is a new segment (`rollgym.sequences.SEGMENT_REASONS`).

    Its conversation is the earlier chain's whose messages it begins with: all of them (it carries that
    conversation on, but not its tokens: `tokens_drifted`) or some (the agent rewrote the history after
    them: `history_rewritten`, e.g. a summary in place of earlier turns). One that shares not even its
    first message with any earlier chain is a conversation of its own (`new_conversation`: a sub-agent,
    a parallel call). The first chain is conversation 0, with no reason.
    """
    if not chains:
        return 0, None
    given = call.input_signatures
    best: tuple[int, int] | None = None  # (shared leading messages, chain index)
    for index, chain in enumerate(chains):
        for earlier in chain:
            known = earlier.conversation
            shared = _shared_prefix(given, known)
            if continues and shared == len(known) or not continues and shared:
                if best is None or shared > best[0]:
                    best = (shared, index)
    if best is None:
        return max(conversation for conversation, _ in labels) + 1, "new_conversation"
    return labels[best[1]][0], "tokens_drifted" if continues else "history_rewritten"


def _shared_prefix(a: list[Signature], b: list[Signature]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
