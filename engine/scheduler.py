"""Picks the next batch: admission, chunked prefill, decode and retraction."""

from __future__ import annotations

from collections import deque

import torch

from engine.client_share import ClientShare
from engine.config import SchedulerConfig
from engine.group_turns import GroupTurns
from engine.kvcache.allocator import OutOfSlotsError
from engine.kvcache.manager import KVCacheManager
from engine.output_reserve import OutputReserve
from engine.prefill_sharing import waits_for_in_flight
from engine.request import Req, ReqStatus
from engine.scheduled_batch import ScheduledBatch
from engine.step_budget import PrefillStepBudget

# Longest-prefix-match ordering is skipped (fcfs used) above this many waiting requests.
LPM_MAX_WAITING = 128
# lpm lets a request with a longer cached prefix go first; one passed over by later
# arrivals this many times goes ahead of all of them, so lpm never starves anyone.
MAX_TIMES_PASSED = 8


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-waiting-requests; the caller should retry later."""


class Scheduler:
    """Continuous batching over one KV manager.

    With mixed batches (the default) every step decodes one token of each running request
    and fills the rest of ``max_prefill_tokens`` with prefill chunks (long prompts cut
    into chunks of ``chunked_prefill_size``), all in one forward. Without them prefill
    steps and decode steps alternate.
    Admission counts free plus evictable KV and keeps a share of the tokens the running
    requests may still produce in reserve (``OutputReserve``: it shrinks while decode
    goes well); if decode still runs out, the requests that generated least are
    retracted and requeued.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        mixed: bool | None = None,
    ) -> None:
        self.config = config
        if config.max_prefill_tokens is None:
            raise ValueError("max_prefill_tokens is settled for the device before this")
        self.max_prefill_tokens: int = config.max_prefill_tokens
        # Whether decodes and prefill chunks share a forward; the engine's build settles
        # auto (None) once it knows whether decode steps replay device graphs.
        self.mixed = config.enable_mixed_batches is not False if mixed is None else mixed
        self.kv = kv
        self.max_model_len = max_model_len
        self.reserve = OutputReserve()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, holding KV (prefill may be unfinished)
        self.num_retractions = 0
        self.num_share_preemptions = 0  # retracted to give another client its share
        self.num_reader_pauses = 0  # retracted because their stream's reader is behind
        self.num_mixed_steps = 0  # forwards that held decodes and prefill chunks together
        # The prefill a step may carry in time, from the measured prefill speed; the
        # engine reports each step with prefill to it (``observe``).
        self.step_budget = PrefillStepBudget(config.prefill_step_budget_ms)
        self.out_of_memory: list[Req] = []  # ended for lack of KV; the engine drains it
        self._last_was_prefill = False
        self._arrivals = 0
        # Whether the last admission pass stopped at a request for lack of room (running
        # slots, request rows or KV), not for its prefill budget.
        self._room_short = False
        self._share_capacity = config.max_running_requests  # the slots shared out this step

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"server overloaded: {len(self.waiting)} requests already waiting "
                f"(--max-waiting-requests {self.config.max_waiting_requests}); retry later"
            )
        self._arrivals += 1
        req.arrival_seq = self._arrivals
        self.waiting.append(req)

    def remove(self, req: Req) -> None:
        """Take ``req`` out of the queues and release its KV at once."""
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.kv.drop_prefetch(req)

    @property
    def has_work(self) -> bool:
        # One paused for its reader waits for the reader: stepping for it would spin.
        return bool(self.running) or any(not r.reader_behind for r in self.waiting)

    # ------------------------------------------------------------------ policy
    @property
    def new_token_ratio(self) -> float:
        """The share of running requests' remaining tokens kept back now."""
        return self.reserve.ratio

    @new_token_ratio.setter
    def new_token_ratio(self, ratio: float) -> None:
        self.reserve.fixed(ratio)  # a set share stays (tests that force retraction)

    def _left(self, req: Req) -> int:
        return min(req.remaining_tokens, self.max_model_len - req.seq_len)

    def _reserved_tokens(self) -> int:
        """KV kept back for the tokens running requests may still generate."""
        return sum(self.reserve.tokens(self._left(r)) for r in self.running)

    def _unlanded(self, req: Req) -> int:
        """Prompt tokens of a running request that are not in the tree yet (0 when its
        prefill has landed or the tree is off)."""
        if not self.kv.tree.enabled:
            return 0
        return max(0, len(req.prompt_ids) - req.prefix_len)

    def land_prefill(self, batch: ScheduledBatch) -> None:
        """After a batch with prefill chunks ran: put their computed pages in the tree."""
        if batch.is_decode or not self.kv.tree.enabled:
            return
        for req in batch.prefill_reqs:
            if req.status == ReqStatus.RUNNING:
                self.kv.cache_prefix(req)

    def _ordered_waiting(self) -> list[Req]:
        # lpm matches every waiting prompt against the tree each step: past
        # LPM_MAX_WAITING requests that costs more than it gains, so order them fcfs.
        if self.config.schedule_policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_WAITING:
            overdue = [r for r in self.waiting if r.times_passed >= MAX_TIMES_PASSED]
            rest = [r for r in self.waiting if r.times_passed < MAX_TIMES_PASSED]
            return overdue + sorted(rest, key=lambda r: -self.kv.peek_prefix_len(r))
        return list(self.waiting)

    def _count_passed(self, admitted: list[Req]) -> None:
        """Each waiting request that arrived before one just admitted was passed once."""
        if admitted and self.waiting:
            latest = max(r.arrival_seq for r in admitted)
            for req in self.waiting:
                if req.arrival_seq < latest:
                    req.times_passed += 1

    # ------------------------------------------------------------------ batches
    def schedule(self) -> ScheduledBatch | None:
        if not self.running:
            self.reserve.idle()
        self._pause_unread()
        self._share_slots()
        batch = self._pick_batch()
        if batch is not None:
            batch.kv_loads = self.kv.tree.take_load_handles()
        return batch

    def _startable(self, req: Req) -> bool:
        """Whether a waiting request could start now (its grammar compiled, no token of
        it still on the device, its reader not behind)."""
        ready = req.grammar is None or req.grammar.ready
        return ready and not req.future_ids and not req.reader_behind

    def _pause_unread(self) -> None:
        """Running requests whose reader is behind stop computing tokens nobody reads:
        retracted (KV kept in the tree), they wait until the reader catches up."""
        for req in [r for r in self.running if r.reader_behind and self._decode_ready(r)]:
            self._retract(req, reason="reader")

    def _share_slots(self) -> None:
        """When the last admission pass ran out of room (running slots or KV) and another
        client's request waits, a client over its fair share hands some back
        (engine/client_share.py). The share is of the requests running now: where KV is
        short, fewer than ``--max-running-requests`` fit."""
        # Admission orders the clients by the same share (see _schedule_prefill).
        self._share_capacity = self.config.max_running_requests
        if not self.waiting or not self._room_short:
            return
        self._share_capacity = max(1, len(self.running))
        share = ClientShare(self.running, self.waiting, self._share_capacity)
        needy = [r for r in self.waiting if self._startable(r)]
        for victim in share.victims(self.running, needy, self._decode_ready):
            self._retract(victim, reason="share")

    def _pick_batch(self) -> ScheduledBatch | None:
        if self.mixed:
            # Decodes that fill the whole token budget would starve prefill: alternate.
            budget, running = self.max_prefill_tokens, self.running
            if len(running) < budget or sum(map(self._decode_ready, running)) < budget:
                return self._pick_mixed()
        return self._pick_alternating()

    def _pick_mixed(self) -> ScheduledBatch | None:
        """Every decode-ready request decodes; prefill chunks fill the rest of the budget."""
        self._last_was_prefill = False
        decode = self._schedule_decode()
        if decode is None:
            return self._schedule_prefill(self.max_prefill_tokens)
        # After a retraction KV is short: continue started prefills but admit nobody, or
        # the request just retracted would be admitted again at once.
        budget = self.max_prefill_tokens - decode.num_tokens
        prefill = self._schedule_prefill(budget, admit=not decode.retracted)
        if prefill is None:
            return decode
        self.num_mixed_steps += 1
        return ScheduledBatch.merge(decode, prefill)

    def _pick_alternating(self) -> ScheduledBatch | None:
        # Prefill first, but never twice in a row while requests wait to decode: a long
        # chunked prompt then costs running requests one chunk of latency per token.
        if self._last_was_prefill:
            batch = self._schedule_decode()
            if batch is not None:
                self._last_was_prefill = False
                return batch
        batch = self._schedule_prefill(self.max_prefill_tokens)
        if batch is not None:
            self._last_was_prefill = True
            return batch
        self._last_was_prefill = False
        return self._schedule_decode()

    def _schedule_prefill(self, budget: int, admit: bool = True) -> ScheduledBatch | None:
        """Prefill chunks of at most ``budget`` tokens in all (fewer where the step time
        budget says so, engine/step_budget.py): started prompts continue first, then
        waiting requests are admitted (unless ``admit`` is False)."""
        chunk_cap = self.config.chunked_prefill_size
        reqs: list[Req] = []
        starts: list[int] = []
        lens: list[int] = []
        slots: list[torch.Tensor] = []
        sample: list[bool] = []

        def take(req: Req, n: int) -> None:
            nonlocal budget
            starts.append(req.kv_len)
            slots.append(self.kv.alloc(req, n))
            reqs.append(req)
            lens.append(n)
            sample.append(req.kv_len == req.seq_len)
            budget -= n

        # Unfinished chunked prefills continue first. A request with exactly one token
        # left to compute is decode-ready: the decode step computes it and samples.
        # Under a time budget, while requests wait, started prompts take at most half of
        # the step: the rest admits the waiting ones, or a long prompt cut into small
        # chunks would keep every newcomer out until its end.
        timed = self.step_budget.tokens()
        if timed is not None:
            budget = min(budget, timed)
        started_left = budget
        if admit and self.waiting and timed is not None:
            started_left = max(1, budget // 2)
        for req in self.running:
            if req.kv_len >= req.seq_len - 1:
                continue
            n = min(req.seq_len - req.kv_len, chunk_cap, budget, started_left)
            if n <= 0 or self.kv.new_tokens_cost(req, n) > self.kv.available_tokens():
                break
            take(req, n)
            started_left -= n

        self._room_short = False
        if not (admit and self.waiting):
            # Nobody to admit: skip the set-up below, which walks every running request.
            return ScheduledBatch.prefill(reqs, starts, lens, slots, sample)
        available = self.kv.available_tokens() - self._reserved_tokens()
        # Prefills whose prompt pages are not in the tree yet (this batch's included).
        in_flight = [r for r in self.running if self._unlanded(r) > 0]
        admitted: list[Req] = []
        max_running = self.config.max_running_requests
        share = ClientShare(self.running, self.waiting, self._share_capacity)
        order = share.admission_order(self._ordered_waiting())
        turns = GroupTurns(self.running, self.waiting, max_running)
        kept_back = 0  # free slots held for requests under their share that wait a step
        for req in order:
            if budget <= 0:
                break
            if len(self.running) >= max_running:
                self._room_short = True
                break
            if not turns.may_admit(req):
                continue  # its other copies wait their turn; those behind them go first
            if not self._startable(req):
                continue  # a grammar still compiling must not hold back others
            if share.keeps_slot_from(req, max_running - len(self.running), kept_back):
                continue
            if self.kv.req_table.free_rows == 0:
                self._room_short = True
                break
            match = self.kv.match(req)
            # A request scoring its prompt computes all of it: waiting would gain nothing.
            waits = in_flight and not req.scoring_prompt
            if waits and waits_for_in_flight(req, match.device_len, in_flight, self.kv.page_size):
                kept_back += share.under_share(req)
                continue  # reuse that prefill once it lands; others are not held back
            ready = self.kv.prefetch_ready(req, match)
            if ready is None:
                kept_back += share.under_share(req)
                continue  # its L3 prefetch is in flight; others are not held back
            match = ready
            pending = req.seq_len - match.device_len
            n = min(pending, chunk_cap, budget)
            # KV for this chunk, plus a reserve for the rest of the prompt and its output.
            future = (pending - n) + self.reserve.tokens(self._left(req))
            chunk_cost = self.kv.allocator.pages_for(n) * self.kv.page_size
            need = chunk_cost + future
            if need > available:
                # The reserve is an estimate: a request alone in an idle engine still runs
                # if its first chunk fits (decode then ends it should the pool fill up).
                alone = not self.running and not reqs
                if not (alone and chunk_cost <= self.kv.available_tokens()):
                    self._room_short = True
                    break
            self.waiting.remove(req)
            self.kv.admit(req, match)  # nothing touched the tree since the match
            n = min(req.seq_len - req.kv_len, chunk_cap, budget)
            try:
                take(req, n)
            except OutOfSlotsError:
                self.kv.release(req)
                self.waiting.appendleft(req)
                self._room_short = True
                break
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            turns.admitted(req)
            share.admitted(req)
            if self._unlanded(req) > 0:
                in_flight.append(req)
            available -= need
        self._count_passed(admitted)
        return ScheduledBatch.prefill(reqs, starts, lens, slots, sample)

    def _decode_ready(self, req: Req) -> bool:
        """Whether ``req`` has exactly its last token left to compute. A token still in
        flight (the overlapped loop) that is sure to be the request's last (its length
        limit) is not decoded on: it would run past ``max_tokens`` or the context."""
        if req.kv_len != req.seq_len - 1:
            return False
        return not req.future_ids or (req.remaining_tokens > 0 and req.seq_len < self.max_model_len)

    def _schedule_decode(self) -> ScheduledBatch | None:
        order = [r for r in self.running if self._decode_ready(r)]
        if not order:
            return None
        retracted: list[Req] = []
        # Most progress first: when KV runs out, the requests that generated least go.
        order.sort(key=lambda r: -len(r.output_ids))
        while order:
            try:
                slots = self.kv.alloc_decode(order)  # the whole step's slots at once
                break
            except OutOfSlotsError:
                victim = order.pop()
                if len(self.running) == 1:
                    # Alone and still out of KV: it can never fit; end it instead of looping.
                    self.out_of_memory.append(victim)
                    self.running.remove(victim)
                    self.kv.release(victim)
                else:
                    self._retract(victim)
                    retracted.append(victim)
        if retracted:
            self.reserve.ran_out()
        else:
            self.reserve.decoded()
        if not order:
            return None
        return ScheduledBatch(
            len(order),
            order,
            [r.kv_len - 1 for r in order],
            [1] * len(order),
            slots,
            [True] * len(order),
            retracted,
        )

    def _retract(self, req: Req, reason: str = "kv") -> None:
        """Free ``req``'s KV (cached in the tree) and put it back at the queue head.
        ``reason``: "kv" (decode ran out), "share" (room for another client) or "reader"
        (its reader is behind); each has its own counter."""
        self.running.remove(req)
        self.kv.release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        if reason == "share":
            self.num_share_preemptions += 1
        elif reason == "reader":
            self.num_reader_pauses += 1
        else:
            self.num_retractions += 1
        self.waiting.appendleft(req)
