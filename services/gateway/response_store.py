"""The Responses API's store: responses kept in the gateway's memory, by id, for GET, DELETE,
`previous_response_id` and background responses.

Bounded by bytes (each entry counted as its JSON): past the budget, the least recently used
entries go, never a background one still running and never the newest. A chained response
keeps only its own input and points to its predecessor, so a long conversation costs each
turn once; reading a response's conversation walks the chain back and touches every link, so
a conversation in use stays while older ones go. The store belongs to one gateway process: a
deployment with several gateways needs a client to come back to the one it stored with.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import APIError, invalid

RUNNING = ("queued", "in_progress")


@dataclass
class Stored:
    response: dict[str, Any]  # the Response object, as GET answers it
    input: list[dict[str, Any]]  # this request's input items (with ids)
    previous: str | None  # the response it goes on from
    size: int = 0  # bytes counted against the budget
    task: asyncio.Task | None = None  # a background response's generation
    # a background stream's events, as sent (index = sequence number), for every follower
    events: list[bytes] | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)  # set on each new event

    @property
    def running(self) -> bool:
        return self.response["status"] in RUNNING

    def run(self, task: asyncio.Task) -> None:
        """Its background generation; followers wake when it ends, however (even cancelled
        before it began)."""
        self.task = task
        task.add_done_callback(lambda _t: self._wake_all())

    def publish(self, event: bytes) -> None:
        assert self.events is not None
        self.events.append(event)
        self._wake_all()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        """The events from sequence number `start` on, as they come, until the generation
        ends; a follower that leaves stops nothing."""
        assert self.events is not None
        i = max(start, 0)
        while True:
            wake, running = self._wake, self.working  # before sending: no wake-up is missed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if not running:
                return
            await wake.wait()

    def _wake_all(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    @property
    def working(self) -> bool:
        """Its background generation still runs (a stream's entry is never held: one whose
        client left before its first byte may never be told it ended)."""
        return self.task is not None and not self.task.done()


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(
        404,
        f"no response {response_id!r} is stored on this gateway (never stored, deleted, "
        "or evicted to keep the store within --responses-store-mb)",
        "invalid_request_error",
        param,
        "not_found",
    )


class ResponseStore:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes  # 0: nothing is stored
        self.used = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: Stored) -> None:
        rid = entry.response["id"]
        if rid in self._entries:
            self.used -= self._entries.pop(rid).size
        entry.size = _size(entry.response) + _size(entry.input) + sum(map(len, entry.events or ()))
        self._entries[rid] = entry
        self.used += entry.size
        self._evict()

    def update(self, response: dict[str, Any]) -> None:
        """A stored response's new state (a background or streamed one, finished); gone
        already (deleted meanwhile): nothing."""
        entry = self._entries.get(response["id"])
        if entry is not None:
            entry.response = response
            self.put(entry)

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> Stored:
        entry = self.get(response_id)
        del self._entries[response_id]
        self.used -= entry.size
        if entry.task is not None:
            entry.task.cancel()
        return entry

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The items a response going on from this one starts with: each link's input, then
        its output, oldest first."""
        chain: list[Stored] = []
        rid: str | None = response_id
        while rid is not None:
            entry = self.get(rid, "previous_response_id")
            if entry.running:
                raise invalid(
                    f"response {rid!r} is still {entry.response['status']}; go on from it "
                    "once it is done",
                    "previous_response_id",
                )
            chain.append(entry)
            rid = entry.previous
        items: list[dict[str, Any]] = []
        for entry in reversed(chain):
            items += entry.input + entry.response["output"]
        return items

    def _evict(self) -> None:
        for rid in list(self._entries)[:-1]:
            if self.used <= self.budget:
                return
            entry = self._entries[rid]
            if not entry.working:
                del self._entries[rid]
                self.used -= entry.size


def _size(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":")))
