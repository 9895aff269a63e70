"""Fair shares of the running slots between clients (issue 25 item 6).

A client is whatever ``SamplingParams.client`` names (the server sets the peer address).
While only one client has work, nothing here changes the schedule. When admission runs
out of room (every running slot taken, or KV too short for the next request) and another
client's request waits, the client holding the most beyond its share (the running
requests divided evenly between the clients with work) gives some back: its newest
decoding requests are retracted, their KV kept in the prefix tree so that they resume
without recomputing, and the waiting request is admitted ahead of them. So 80 long
streams from one address (read or not) cannot keep another client out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from engine.request import Req

# Slots handed back per step: enough for a burst of newcomers, few enough that one step
# does not retract a crowd that the next steps would readmit one by one anyway.
MAX_PREEMPTIONS_PER_STEP = 4


def client_of(req: Req) -> str:
    """The client ``req`` counts against; requests that name none share one client."""
    return req.params.client or ""


class ClientShare:
    """One step's view of the running slots held per client.

    ``share``: the slots each client with work may hold while another client waits
    (at least one). ``holding``: running requests per client.
    """

    def __init__(self, running: Iterable[Req], waiting: Iterable[Req], max_running: int) -> None:
        self.holding: Counter[str] = Counter(client_of(r) for r in running)
        self.waiting: Counter[str] = Counter(client_of(r) for r in waiting)
        clients = set(self.holding) | set(self.waiting)
        self.shared = len(clients) > 1
        self.share = max(1, max_running // max(1, len(clients)))

    def under_share(self, req: Req) -> bool:
        """Whether ``req``'s client holds fewer slots than its share."""
        return self.holding[client_of(req)] < self.share

    def admission_order(self, order: list[Req]) -> list[Req]:
        """``order`` with the requests of clients under their share first (stable: each
        client's requests keep their order)."""
        if not self.shared:
            return order
        return sorted(order, key=lambda r: not self.under_share(r))

    def admitted(self, req: Req) -> None:
        """``req`` took a running slot."""
        self.holding[client_of(req)] += 1

    def keeps_slot_from(self, req: Req, free_slots: int, kept_back: int) -> bool:
        """Whether admitting ``req`` would take one of the ``kept_back`` free slots held
        for requests under their share that could not start this step (a prefill of the
        same prefix still landing, say): a client at its share waits for them."""
        return self.shared and not self.under_share(req) and free_slots <= kept_back

    def victims(
        self, running: list[Req], needy: Iterable[Req], may_retract: Callable[[Req], bool]
    ) -> list[Req]:
        """Running requests to retract so that the ``needy`` (waiting requests that could
        start now) of clients under their share get a slot.

        A victim comes from the client holding the most slots above its share, newest
        admission first, and only where ``may_retract`` allows (a decode-ready request:
        a prefill half done is not thrown away).
        """
        if not self.shared:
            return []
        wanted = sum(1 for r in needy if self.under_share(r))
        picked: list[Req] = []
        taken: set[int] = set()
        while wanted > 0 and len(picked) < MAX_PREEMPTIONS_PER_STEP:
            over = sorted(
                (c for c, n in self.holding.items() if n > self.share),
                key=lambda c: -self.holding[c],
            )
            victim = None
            for client in over:  # the most over share first; the next if it has none to give
                candidates = [
                    r
                    for r in running
                    if client_of(r) == client and id(r) not in taken and may_retract(r)
                ]
                if candidates:
                    victim = max(candidates, key=lambda r: r.arrival_seq)
                    break
            if victim is None:
                break
            picked.append(victim)
            taken.add(id(victim))
            self.holding[client_of(victim)] -= 1
            wanted -= 1
        return picked
