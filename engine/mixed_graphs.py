"""Mixed steps (decodes and prefill chunks in one forward) replayed from device graphs, so
that with graphs on a step that carries prefill chunks does not cost the running streams
an eager step (issue 27, item 4).

A graph is captured per *token* bucket (engine/graph_buckets.py ``token_buckets``): the
step's tokens are padded to it, its sequences to ``min(bucket, max_seqs)``. Everything in
the forward but attention works per token; attention is the Triton kernel's one varlen
launch per layer, whose grid is a work list of (sequence, token block) programs padded
to the bucket's bound (``paged_attention.max_extend_work``), so no shape inside the graph
depends on the step. What a step changes lives in one static buffer, copied in before
each replay:

    input ids, positions, out slots                                 [3, bucket]
    request-table rows, sequence lengths, first token, new tokens   [4, seqs]
    the sampling rows (last token of each sequence that samples)    [seqs]
    the attention work list                                          [2, programs]

Padded tokens write their K/V to the pool's dummy slot 0 and no program attends for them
(their attention rows stay zero); padded sequences have no new tokens; padded sampling
rows read token 0, and their logits are dropped.

All buckets are captured at start-up, largest first, into the decode graphs' memory pool,
and each replay is checked once against the eager forward (engine/graph_startup.py); a
failure leaves mixed steps eager (logged), never during serving. Without a graph API the same code runs with direct
calls (``api=None``), as the decode graphs do.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from engine import graph_startup, platform
from engine.graph_buckets import bucket_for, token_buckets
from engine.graph_runner import DirectCall, Replayable, logits_width
from engine.host_alloc import staging_empty
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.req_table import ReqTable
from engine.layers.attention_meta import AttentionMetadata
from engine.layers.triton_attention import EXTEND_LAYOUT, work_key

logger = logging.getLogger(__name__)

# Static rows, in order, with what a padded entry holds. A padded token decodes token 0 at
# position 0 into dummy slot 0; a padded sequence has no new tokens (seq_len 1 reads
# column 0 of table row 0, a valid slot id); a padded sampling row reads token 0.
TOKEN_ROWS = ("input_ids", "positions", "out_slots")
TOKEN_PAD = (0, 0, 0)
SEQ_ROWS = ("req_rows", "seq_lens", "q_starts", "q_lens")
SEQ_PAD = (0, 1, 0, 0)


def mixed_blockers(model: torch.nn.Module) -> list[str]:
    """Why a mixed step of ``model`` cannot be captured (empty: it can): every attention
    layer must take an extend's layout from tensors (the Triton backend), with one token
    block size for all of them."""
    reasons: set[str] = set()
    for module in model.modules():
        backend = getattr(module, "attn_backend", None)
        if backend is not None and not getattr(backend, "graph_safe_extend", False):
            reasons.add(f"attention backend {backend.name!r} sizes an extend per sequence")
    if not reasons and len(_per_program_sizes(model)) != 1:
        reasons.add("attention layers with different GQA groups or head sizes")
    return sorted(reasons)


def _per_program_sizes(model: torch.nn.Module) -> set[int]:
    from engine.layers.triton_ops.paged_attention import extend_tokens_per_program

    return {
        extend_tokens_per_program(m.q_heads, m.kv_heads, m.head_dim)
        for m in model.modules()
        if all(hasattr(m, a) for a in ("q_heads", "kv_heads", "head_dim", "attn_backend"))
    }


class _Layout:
    """Where a bucket's rows sit in the static buffer: tokens, sequences, sampling rows,
    work list, one after another from offset 0."""

    def __init__(self, tokens: int, seqs: int, work: int) -> None:
        self.tokens, self.seqs, self.work = tokens, seqs, work
        self.seq_at = len(TOKEN_ROWS) * tokens
        self.sample_at = self.seq_at + len(SEQ_ROWS) * seqs
        self.work_at = self.sample_at + seqs
        self.size = self.work_at + 2 * work


class MixedGraphRunner:
    """Pads steps that prefill (alone or beside decodes) to a token bucket and replays one
    device graph per bucket. ``api``: the backend's graph API; None: direct calls (CPU,
    tests). ``pool``: the graph memory pool shared with the decode graphs."""

    def __init__(
        self,
        model: Any,
        kv_pool: DeviceKVPool,
        req_table: ReqTable,
        device: torch.device,
        max_tokens: int,
        max_seqs: int,
        api: platform.GraphApi | None = None,
        spec: platform.DeviceSpec | None = None,
        pool: Any = None,
    ) -> None:
        from engine.layers.triton_ops.paged_attention import max_extend_work

        sizes = _per_program_sizes(model)
        if len(sizes) != 1:
            raise ValueError(f"mixed graphs need one token block size, the model has {sizes}")
        self.per_program = sizes.pop()
        self.model = model
        self.kv_pool = kv_pool
        self.req_table = req_table
        self.device = device
        self.api = api
        self.buckets = token_buckets(max_tokens)
        self.max_seqs = max_seqs
        self._layouts = {
            t: _Layout(t, min(max_seqs, t), max_extend_work(t, min(max_seqs, t), self.per_program))
            for t in self.buckets
        }
        self.graphs: dict[int, Replayable] = {}
        self.replays: Counter[int] = Counter()  # per token bucket
        self._spec = spec or platform.parse_device(device)
        self._pool = pool
        largest = self._layouts[self.buckets[-1]]
        # Static buffers, allocated outside any capture so no graph's pool holds them.
        self._inputs = torch.zeros(largest.size, dtype=torch.int64, device=device)
        self._logits = torch.zeros(largest.seqs, logits_width(model, device), device=device)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _views(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bucket's static rows: tokens ``[3, T]``, sequences ``[4, S]``, sampling
        rows ``[S]``, work list ``[2, W]``."""
        lay = self._layouts[bucket]
        buf = self._inputs
        return (
            buf[: lay.seq_at].view(len(TOKEN_ROWS), lay.tokens),
            buf[lay.seq_at : lay.sample_at].view(len(SEQ_ROWS), lay.seqs),
            buf[lay.sample_at : lay.work_at],
            buf[lay.work_at : lay.size].view(2, lay.work),
        )

    # ---- per step ------------------------------------------------------------------------

    def bucket_of(self, num_tokens: int, num_seqs: int) -> int | None:
        """The token bucket of a step, None where it has none (too many tokens or
        sequences, or no graph)."""
        bucket = bucket_for(num_tokens, self.buckets)
        if bucket is None or bucket not in self.graphs:
            return None
        return bucket if num_seqs <= self._layouts[bucket].seqs else None

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        out_slots: torch.Tensor,
        req_rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        sample_ends: list[int],
        resolve: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(sample_ends), vocab]`` float32 of a step that ``bucket_of``
        accepted. ``resolve`` rewrites the static input ids in place before the replay
        (tokens still on the device, engine/future_tokens.py).

        NOTE: a view of the static logits buffer, overwritten by the next replay.
        """
        bucket = self.bucket_of(len(input_ids), len(req_rows))
        assert bucket is not None, "run() a step that bucket_of() accepted"
        self._copy_in(
            bucket, input_ids, positions, out_slots, req_rows, prefix_lens, extend_lens, sample_ends
        )
        if resolve is not None:
            resolve(self._views(bucket)[0][0])
        self.graphs[bucket].replay()
        self.replays[bucket] += 1
        return self._logits[: len(sample_ends)]

    def _copy_in(
        self,
        bucket: int,
        input_ids: list[int],
        positions: list[int],
        out_slots: torch.Tensor,
        req_rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        sample_ends: list[int],
    ) -> None:
        """The step's rows, padded, into the static buffer: one staging buffer (pinned on
        accelerators) filled by a fixed number of tensor writes, one asynchronous copy."""
        from engine.layers.triton_ops.paged_attention import extend_work

        lay = self._layouts[bucket]
        staged = staging_empty(lay.size, torch.int64, self.device)
        n, b = len(input_ids), len(req_rows)
        tokens = staged[: lay.seq_at].view(len(TOKEN_ROWS), lay.tokens)
        seqs = staged[lay.seq_at : lay.sample_at].view(len(SEQ_ROWS), lay.seqs)
        tokens[:, n:] = torch.tensor(TOKEN_PAD)[:, None]
        tokens[:2, :n] = torch.tensor([input_ids, positions])
        tokens[2, :n] = out_slots
        seqs[:, b:] = torch.tensor(SEQ_PAD)[:, None]
        starts = [0] * b
        for i in range(1, b):
            starts[i] = starts[i - 1] + extend_lens[i - 1]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        seqs[:, :b] = torch.tensor([req_rows, seq_lens, starts, extend_lens])
        sample = staged[lay.sample_at : lay.work_at]
        sample.zero_()
        sample[: len(sample_ends)] = torch.tensor(sample_ends, dtype=torch.int64)
        staged[lay.work_at : lay.size] = torch.tensor(
            extend_work(extend_lens, self.per_program, lay.work)
        )
        self._inputs[: lay.size].copy_(staged, non_blocking=True)

    # ---- capture ------------------------------------------------------------------------

    def _bucket_forward(self, bucket: int) -> Callable[[], None]:
        """The function a bucket's graph captures: it reads only the static buffer (and
        the pool and request table, updated in place), never the step's lists."""
        tokens, seqs, sample, work = self._views(bucket)
        input_ids, positions, out_slots = tokens
        req_rows, seq_lens = seqs[0], seqs[1]
        layout = seqs[2:4]  # [2, S]: first new token, new tokens
        lay = self._layouts[bucket]
        logits = self._logits[: lay.seqs]
        table = self.req_table.table
        key = work_key(self.per_program)

        def forward() -> None:
            meta = AttentionMetadata(
                is_decode=False,
                out_slots=out_slots,
                req_rows=req_rows,
                seq_lens=seq_lens,
                req_table=table,
                # The bucket's shape, not the step's: attention reads the layout and work
                # list from the cache below and never these lists.
                prefix_lens_list=[0] * lay.seqs,
                extend_lens_list=[bucket] + [0] * (lay.seqs - 1),
                seq_lens_list=[bucket] + [0] * (lay.seqs - 1),
                max_seq_len=bucket,
            )
            meta.cache[EXTEND_LAYOUT] = layout
            meta.cache[key] = work
            hidden = self.model(input_ids, positions, meta, self.kv_pool)  # [T, hidden]
            logits.copy_(self.model.compute_logits(hidden.index_select(0, sample)))

        return forward

    def layout_of(self, bucket: int) -> tuple[int, int]:
        """(sequences, work-list programs) of ``bucket``'s graph."""
        lay = self._layouts[bucket]
        return lay.seqs, lay.work

    def capture(self, bucket: int) -> Replayable:
        """Capture ``bucket``'s graph now (graph_startup.capture_mixed_at_start does)."""
        started = time.perf_counter()
        # Padding only: warm-up runs really execute, and must write nothing but slot 0.
        self._copy_in(bucket, [], [], torch.zeros(0, dtype=torch.int64), [], [], [], [])
        forward = self._bucket_forward(bucket)
        graph: Replayable
        if self.api is None:
            graph = DirectCall(forward)
        else:
            graph = graph_startup.capture_warmed(self.api, self._spec, forward, self._pool)
        self.graphs[bucket] = graph
        logger.debug(
            "mixed graphs: captured %d tokens in %.0f ms",
            bucket,
            (time.perf_counter() - started) * 1e3,
        )
        return graph
