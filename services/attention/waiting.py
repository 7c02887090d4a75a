"""The attention scheduler's waiting queue and its choice of whom to preempt, per scheduling
policy (vLLM's two, by their names).

fcfs: requests are admitted in arrival order, and a request preempted to free KV blocks goes
back to the head of the queue; the victim is the latest admitted running request.
priority: requests are admitted by (priority, arrival): a lower value first, ties in arrival
order; a preempted request goes back in its place by that same key (so it is ahead of anyone
who came after it with its priority), and the victim is the running request with the largest
key: the least urgent, the latest of those.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from afd.config import SCHEDULING_POLICIES
from services.attention.request import Request


def _key(req: Request) -> tuple[int, float]:
    return (req.sampling.priority, req.arrival_time)


class WaitingQueue:
    """Requests waiting for admission; `head()` is the next one the policy admits."""

    def __init__(self, policy: str) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}")
        self.policy = policy
        # fcfs: arrival order; priority: sorted by _key (insertion keeps it sorted, and a
        # request's key never changes)
        self._queue: deque[Request] | list[Request] = deque() if policy == "fcfs" else []

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def add(self, req: Request) -> None:
        """A new request."""
        if self.policy == "fcfs":
            self._queue.append(req)
        else:
            bisect.insort_right(self._queue, req, key=_key)

    def readmit(self, req: Request) -> None:
        """A preempted request, to be admitted again before those the policy puts after it."""
        if self.policy == "fcfs":
            self._queue.appendleft(req)
        else:
            bisect.insort_left(self._queue, req, key=_key)

    def head(self) -> Request:
        return self._queue[0]

    def pop_head(self) -> Request:
        q = self._queue
        return q.popleft() if isinstance(q, deque) else q.pop(0)

    def remove(self, req: Request) -> None:
        self._queue.remove(req)


def victim(running: list[Request], policy: str) -> Request:
    """The running request (in admission order) to preempt when KV blocks run out."""
    if policy == "fcfs":
        return running[-1]
    return max(running, key=_key)
