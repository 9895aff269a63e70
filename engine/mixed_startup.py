"""The start-up pass of the mixed-step graphs (engine/mixed_graphs.py): every token bucket
captured, largest first, and each replay checked once against the eager forward of the
same step before the server reports healthy. A failure leaves mixed steps eager."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from engine import graph_startup
from engine.layers.attention_meta import AttentionMetadata
from engine.mixed_graphs import MixedGraphRunner

logger = logging.getLogger(__name__)


@torch.inference_mode()  # as serving runs them
def capture_mixed_at_start(runner: MixedGraphRunner, check: bool = True) -> str | None:
    """Capture every token bucket, largest first, each replay checked once against the
    eager forward; the failure reason, or None. On failure no graph is kept."""
    started = time.perf_counter()
    for bucket in reversed(runner.buckets):
        try:
            runner.capture(bucket)
        except Exception as exc:
            runner.graphs.clear()
            return f"capturing {bucket} tokens failed ({type(exc).__name__}: {exc})"
        failure = check_mixed_replay(runner, bucket) if check else None
        if failure is not None:
            runner.graphs.clear()
            return failure
    runner.replays.clear()  # the checks' replays: count serving steps only
    logger.info(
        "mixed graphs: captured %d token sizes %s (up to %d sequences) at start-up in %.2f s%s",
        len(runner.buckets),
        runner.buckets,
        runner.layout_of(runner.max_tokens)[0],
        time.perf_counter() - started,
        ", each replay checked against eager" if check else "",
    )
    return None


def check_layout(bucket: int, seqs: int, max_context: int) -> tuple[list[int], list[int]] | None:
    """Prefix and new-token counts of the start-up check of ``bucket``: a decode (one
    cached key, one new token) and prefill chunks over one cached key each, one token
    short of the bucket (so padding is checked too); None where it does not fit."""
    total = bucket - 1 if bucket > 2 else bucket
    prefix, new = [1], [1]
    left = total - 1
    while left > 0:
        chunk = min(left, max_context - 1)
        prefix.append(1)
        new.append(chunk)
        left -= chunk
    return (prefix, new) if len(new) <= seqs else None


def check_mixed_replay(runner: MixedGraphRunner, bucket: int) -> str | None:
    """Run a mixed step of ``bucket`` eagerly and from its graph; the difference when past
    the dtype's tolerance, else None.

    Like the decode check it uses request-table rows from 0 and KV slots from 1: nothing
    is allocated before serving, and serving overwrites them before reading.
    """
    table, pool = runner.req_table, runner.kv_pool
    seqs = runner.layout_of(bucket)[0]
    layout = check_layout(bucket, min(seqs, table.max_rows), table.max_context)
    if table.free_rows < table.max_rows or layout is None:
        return None  # not at start-up, or a table too small to check in
    prefix_lens, extend_lens = layout
    if sum(prefix_lens) + sum(extend_lens) >= pool.num_slots:
        return None  # too small a pool to check in
    rows = list(range(len(extend_lens)))
    out_slots: list[int] = []
    cached: list[int] = []
    slot = 1
    for row, n in zip(rows, extend_lens):
        table.write(row, 0, torch.arange(slot, slot + 1 + n))
        cached.append(slot)
        out_slots.extend(range(slot + 1, slot + 1 + n))
        slot += 1 + n
    table.flush()
    gen = torch.Generator().manual_seed(bucket)
    noise = torch.randn(
        2, pool.num_layers, len(cached), pool.kv_heads, pool.head_dim, generator=gen
    )
    pool.kv_buffer[:, :, torch.tensor(cached, device=pool.device)] = noise.to(
        pool.device, pool.dtype
    )
    vocab = int(runner.model.model.embed_tokens.shape[0])
    input_ids = [(17 + 31 * i) % vocab for i in range(len(out_slots))]
    positions = [p for n in extend_lens for p in range(1, 1 + n)]
    ends = list(itertools.accumulate(extend_lens))
    sample_ends = [e - 1 for e in ends]
    slots = torch.tensor(out_slots, dtype=torch.int64)
    eager = _eager_logits(
        runner, input_ids, positions, slots, rows, prefix_lens, extend_lens, sample_ends
    )
    replayed = runner.run(
        input_ids, positions, slots, rows, prefix_lens, extend_lens, sample_ends
    ).float()
    tolerance = graph_startup.REPLAY_TOLERANCE.get(pool.dtype, 1e-2)
    diff = (replayed - eager).abs().max().item()
    if not diff <= tolerance:  # NaN fails too
        return (
            f"{bucket} tokens: the replayed logits differ from eager by {diff:.3g} "
            f"(tolerance {tolerance:g} for {pool.dtype})"
        )
    return None


def _eager_logits(
    runner: MixedGraphRunner,
    input_ids: list[int],
    positions: list[int],
    out_slots: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    sample_ends: list[int],
) -> torch.Tensor:
    """The same step through the eager forward: ``[len(sample_ends), vocab]`` float32."""
    device = runner.device

    def upload(values: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64).to(device)

    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    meta = AttentionMetadata(
        is_decode=False,
        out_slots=upload(out_slots),
        req_rows=upload(rows),
        seq_lens=upload(seq_lens),
        req_table=runner.req_table.table,
        prefix_lens_list=prefix_lens,
        extend_lens_list=extend_lens,
        seq_lens_list=seq_lens,
        max_seq_len=max(seq_lens),
        req_rows_list=rows,
    )
    hidden = runner.model(upload(input_ids), upload(positions), meta, runner.kv_pool)
    picked = hidden.index_select(0, upload(sample_ends))
    return runner.model.compute_logits(picked).float().clone()  # type: ignore[no-any-return]
