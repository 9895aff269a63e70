"""Pure decode steps replayed from device graphs (CUDA / MUSA): one launch per step
instead of hundreds, which is what bounds eager decode on a GPU.

With an attention backend that reads K/V in place (the Triton kernel; the native CPU
kernel), a graph is captured per batch bucket only, all of them at start-up, largest
first, each replay checked once against eager (engine/graph_startup.py); a failure turns
graphs off before serving. With the gather fallback, a graph is captured lazily per
(batch bucket, context bucket): the decode attention gathers every row's KV padded to the
context bucket. Either way the batch is padded up to its bucket with dummy rows, so
every shape inside the graph depends on the bucket only. Everything a
step changes lives in static device buffers, copied in before each replay:

    input ids, positions, out slots, request-table rows, sequence lengths   [5, bucket]

and the attention layout (the gathered slot index and the padding mask) is computed inside
the graph from those buffers and the request table, which is a persistent device tensor
updated in place. The LM head runs inside the graph too; its logits land in one static
buffer that the sampler (outside the graph) reads before the next replay.

Without a graph API (the CPU; tests) the same code runs with "capture" replaced by a
direct call of the captured function on the static buffers (``api=None``), so bucketing,
padding, copy-in, the in-graph layout and the slicing of outputs are tested on any host.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine import graph_startup, platform
from engine.graph_buckets import MIN_CONTEXT_BUCKET, batch_buckets, bucket_for, context_buckets
from engine.host_alloc import staging_empty
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.req_table import ReqTable
from engine.layers.attention_meta import AttentionMetadata

logger = logging.getLogger(__name__)

# Most graphs held at once; steps past it that need a new bucket run eagerly.
MAX_GRAPHS = 64
# Static input rows, in this order: what a padded row holds in each.
INPUT_ROWS = ("input_ids", "positions", "out_slots", "req_rows", "seq_lens")
# NOTE: a padded row decodes token 0 at position 0 into the pool's dummy slot 0, reads
# column 0 of request-table row 0 (always a valid slot id: the table starts zeroed and
# only ever holds slot ids) with a context of 1 (not 0: an all-masked row is NaN), and
# its output is dropped.
PAD_VALUES = (0, 0, 0, 0, 1)
_OUT_SLOTS_ROW = INPUT_ROWS.index("out_slots")
_LIST_ROWS = [i for i in range(len(INPUT_ROWS)) if i != _OUT_SLOTS_ROW]


def decode_in_place(model: torch.nn.Module) -> bool:
    """Whether every attention layer of ``model`` decodes from the pool in place: its
    graphs then need no context shape."""
    backends = [getattr(m, "attn_backend", None) for m in model.modules()]
    found = [b for b in backends if b is not None]
    return bool(found) and all(getattr(b, "decode_reads_pool_in_place", False) for b in found)


def logits_width(model: Any, device: torch.device) -> int:
    """Columns of ``model.compute_logits`` (the lm_head may be padded past the vocabulary):
    the width of a graph's static logits buffer."""
    embed = model.model.embed_tokens  # [vocab, hidden]
    probe = torch.zeros(1, embed.shape[1], dtype=embed.dtype, device=device)
    return int(model.compute_logits(probe).shape[1])


class Replayable(Protocol):
    def replay(self) -> None: ...


class DirectCall:
    """``api=None``: "replay" calls the captured function again, on the same buffers."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class DecodeGraphRunner:
    """Pads pure decode batches to buckets and replays one device graph per bucket.

    ``api``: the backend's graph API (platform.graph_api); None runs the same static path
    with direct calls instead of captures (CPU, tests). Graphs are captured lazily, on a
    bucket's first step, into one memory pool that all of them share.
    """

    def __init__(
        self,
        model: Any,
        kv_pool: DeviceKVPool,
        req_table: ReqTable,
        device: torch.device,
        max_batch: int,
        api: platform.GraphApi | None = None,
        min_context_bucket: int = MIN_CONTEXT_BUCKET,
        max_graphs: int = MAX_GRAPHS,
        spec: platform.DeviceSpec | None = None,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.req_table = req_table
        self.device = device
        self.api = api
        self.batch_buckets = batch_buckets(max_batch)
        # In place: one "context bucket", the table's width; the graph never reads it.
        self.in_place = decode_in_place(model)
        self.context_buckets = (
            [req_table.max_context]
            if self.in_place
            else context_buckets(req_table.max_context, min_context_bucket)
        )
        # Set once every bucket was captured at start-up: no capture while serving.
        self.captured_at_start = False
        self.max_graphs = max_graphs
        self.graphs: dict[tuple[int, int], Replayable] = {}
        self.replays: Counter[tuple[int, int]] = Counter()  # per (batch, context) bucket
        self._warned_full = False
        # Set when a capture failed: every later decode step runs eagerly.
        self.failure: BaseException | None = None
        self._spec = spec or platform.parse_device(device)
        self._pool = api.pool_handle() if api is not None else None
        # Static buffers, allocated outside any capture so no graph's pool holds them.
        self._inputs = torch.zeros(len(INPUT_ROWS) * max_batch, dtype=torch.int64, device=device)
        self._columns = torch.arange(req_table.max_context, device=device)  # [max_context]
        self._logits = torch.zeros(max_batch, logits_width(model, device), device=device)  # float32
        self._pad_column = torch.tensor(PAD_VALUES, dtype=torch.int64)[:, None]  # [5, 1]

    @property
    def pool(self) -> Any:
        """The graphs' memory pool handle (None without a graph API): the mixed-step
        graphs share it."""
        return self._pool

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def _views(self, batch: int) -> list[torch.Tensor]:
        """The static input rows of a ``batch`` bucket: ``INPUT_ROWS``, each ``[batch]``."""
        return list(self._inputs[: len(INPUT_ROWS) * batch].view(len(INPUT_ROWS), batch))

    # ---- per step ------------------------------------------------------------------------

    def bucket_of(self, seq_lens: list[int]) -> tuple[int, int] | None:
        """(batch bucket, context bucket) of a decode batch; None when it has none."""
        batch = bucket_for(len(seq_lens), self.batch_buckets)
        context = bucket_for(max(seq_lens), self.context_buckets)
        if batch is None or context is None:
            return None
        return batch, context

    def can_run(self, seq_lens: list[int]) -> bool:
        """Whether a decode batch with these context lengths (new token included) can be
        replayed: it fits a bucket, and that bucket has a graph or room for one."""
        key = self.bucket_of(seq_lens)
        if key is None or self.failure is not None:
            return False
        if key in self.graphs:
            return True
        if not self.captured_at_start and len(self.graphs) < self.max_graphs:
            return True
        if not self._warned_full:
            self._warned_full = True
            logger.warning(
                "device graphs: all %d captured (the cap); decode steps of other batch / "
                "context buckets run eagerly",
                self.max_graphs,
            )
        return False

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        out_slots: torch.Tensor,
        req_rows: list[int],
        seq_lens: list[int],
        resolve: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Logits ``[B, vocab]`` float32 of a pure decode batch of B rows; None when its
        graph could not be captured (the caller runs the step eagerly). ``resolve``
        rewrites the static input ids in place before the replay (references to tokens
        still on the device, engine/future_tokens.py).

        NOTE: a view of the static logits buffer, overwritten by the next replay: read it
        (the sampler does, on the same stream) before running another step.
        """
        key = self.bucket_of(seq_lens)
        assert key is not None, "run() a batch that can_run() accepted"
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self.capture(*key)
            except Exception as exc:  # an op the backend cannot capture
                self.failure = exc
                logger.warning(
                    "device graphs: capturing batch %d x context %d failed (%s: %s); "
                    "decode runs eagerly from now on (--disable-cuda-graph silences this)",
                    *key,
                    type(exc).__name__,
                    exc,
                )
                return None
        self._copy_in(key[0], input_ids, positions, out_slots, req_rows, seq_lens)
        if resolve is not None:
            resolve(self._views(key[0])[0])
        graph.replay()
        self.replays[key] += 1
        return self._logits[: len(seq_lens)]

    def _copy_in(
        self,
        batch: int,
        input_ids: list[int],
        positions: list[int],
        out_slots: torch.Tensor,
        req_rows: list[int],
        seq_lens: list[int],
    ) -> None:
        """This step's rows, padded to ``batch``, into the static inputs: one staging
        buffer (pinned on accelerators) filled by a fixed number of tensor operations,
        whatever the batch, and one asynchronous copy."""
        size = len(seq_lens)
        staged = staging_empty((len(INPUT_ROWS), batch), torch.int64, self.device)
        staged[:, size:] = self._pad_column  # [5, batch - B] the dummy row's values
        # Every row but out_slots (already a tensor) in one conversion.
        staged[_LIST_ROWS, :size] = torch.tensor([input_ids, positions, req_rows, seq_lens])
        staged[_OUT_SLOTS_ROW, :size] = out_slots
        self._inputs[: len(INPUT_ROWS) * batch].copy_(staged.view(-1), non_blocking=True)

    # ---- capture ------------------------------------------------------------------------

    def _bucket_forward(self, batch: int, context: int) -> Callable[[], None]:
        """The function a (batch, context) graph captures. It reads only static buffers
        (and the pool and request table, updated in place) and closes over nothing that
        changes between steps: a replay must compute the step from the buffers alone."""
        input_ids, positions, out_slots, req_rows, seq_lens = self._views(batch)
        columns = self._columns[:context]  # [context]
        table = self.req_table.table  # [max_rows, max_context] int32
        logits = self._logits[:batch]  # [batch, vocab]
        in_place = self.in_place

        def forward() -> None:
            if not in_place:
                valid = columns[None, :] < seq_lens[:, None]  # [batch, context]
                # Columns past a row's length may hold stale slots: read dummy slot 0.
                slots = table[req_rows, :context].long().masked_fill(~valid, 0)
            meta = AttentionMetadata(
                is_decode=True,
                out_slots=out_slots,
                req_rows=req_rows,
                seq_lens=seq_lens,
                req_table=table,
                # The bucket's shape, not the step's lengths: decode attention reads the
                # layout below from the cache and never these lists.
                prefix_lens_list=[context - 1] * batch,
                extend_lens_list=[1] * batch,
                seq_lens_list=[context] * batch,
                max_seq_len=context,
            )
            if not in_place:  # the gather fallback reads this layout
                meta.cache["decode_slots"] = slots.reshape(-1)  # [batch * context]
                meta.cache["decode_mask"] = valid[:, None, None, :]  # [batch, 1, 1, context]
            hidden = self.model(input_ids, positions, meta, self.kv_pool)  # [batch, hidden]
            logits.copy_(self.model.compute_logits(hidden))  # [batch, vocab] float32

        return forward

    def capture(self, batch: int, context: int) -> Replayable:
        """Capture the (batch, context) bucket's graph now (run() does on first use)."""
        started = time.perf_counter()
        # Dummy rows only: warm-up runs really execute, and must write nothing but slot 0.
        for view, pad_value in zip(self._views(batch), PAD_VALUES):
            view.fill_(pad_value)
        forward = self._bucket_forward(batch, context)
        graph: Replayable
        if self.api is None:
            graph = DirectCall(forward)
        else:
            graph = graph_startup.capture_warmed(self.api, self._spec, forward, self._pool)
        self.graphs[(batch, context)] = graph
        logger.info(
            "device graphs: captured batch %d x context %d in %.0f ms (%d graphs)",
            batch,
            context,
            (time.perf_counter() - started) * 1e3,
            len(self.graphs),
        )
        return graph
