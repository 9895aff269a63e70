"""Device graphs made safe to use: a capture that cannot leave the backend capturing, and
the start-up passes that capture every decode batch size and every mixed-step token
size, largest first, and check each replay once against the eager forward before the
server reports healthy.

A failure anywhere in the start-up pass turns graphs off before serving starts, with the
reason logged; nothing is captured on the serving path afterwards.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine import platform
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.req_table import ReqTable
from engine.layers.attention_meta import AttentionMetadata

if TYPE_CHECKING:
    from engine.graph_runner import DecodeGraphRunner
    from engine.mixed_graphs import MixedGraphRunner

logger = logging.getLogger(__name__)

# How far a replay's logits may be from the eager forward's: the same kernels on the same
# inputs, so only reduction order may differ (float32 stays near exact).
REPLAY_TOLERANCE = {
    torch.float32: 1e-4,
    torch.float16: 2e-2,
    torch.bfloat16: 6e-2,
}


# Eager runs of a function on a side stream before its capture, as the PyTorch graph docs
# ask (lazy initialisation, autotuning and allocator warm-up stay out of it).
WARMUP_RUNS = 2


def capture_warmed(
    api: platform.GraphApi, spec: platform.DeviceSpec, forward: Callable[[], None], pool: Any
) -> Any:
    """``forward`` run ``WARMUP_RUNS`` times on a side stream, then captured into a new
    graph whose memory comes from ``pool`` (shared by every graph of the engine)."""
    main = platform.current_stream(spec)
    side = platform.new_stream(spec)
    assert main is not None and side is not None, "graph backends have streams"
    side.wait_stream(main)  # the warm-up reads what the main stream wrote
    with platform.stream_context(spec, side):
        for _ in range(WARMUP_RUNS):
            forward()
    main.wait_stream(side)
    return capture_safely(api, spec, forward, _capture_options(api, pool))


def _capture_options(api: platform.GraphApi, pool: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"pool": pool}
    try:
        accepted = inspect.signature(api.capture).parameters
    except (TypeError, ValueError):
        return options
    if "capture_error_mode" in accepted:
        # Only this thread's unsafe calls break the capture; another thread (an L3
        # reader, a grammar compile) may use the runtime meanwhile.
        options["capture_error_mode"] = "thread_local"
    return options


def capture_safely(
    api: platform.GraphApi,
    spec: platform.DeviceSpec,
    forward: Callable[[], None],
    options: dict[str, Any],
) -> Any:
    """Capture ``forward`` into a new graph of ``api``; on failure end the capture, restore
    the current stream and release the half-built graph before re-raising.

    NOTE: torch's ``graph.__exit__`` ends the capture and then leaves the capture stream;
    when ending the capture raises, neither the caching allocator's capture mode nor the
    stream is restored, and every later allocation would go to the dead graph's pool.
    """
    main = platform.current_stream(spec)
    graph = api.graph_cls()
    try:
        with api.capture(graph, **options):
            forward()
    except BaseException:
        _abandon(api, spec, graph, main)
        raise
    return graph


def _abandon(api: platform.GraphApi, spec: platform.DeviceSpec, graph: Any, main: Any) -> None:
    """Best effort, each step on its own: a step that fails is logged, the next still runs."""
    module = api.module

    def attempt(what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:  # the capture already failed; report and keep cleaning
            logger.debug("device graphs: %s after a failed capture: %s", what, exc)

    capturing = getattr(module, "is_current_stream_capturing", None)
    if capturing is not None:
        still = False
        try:
            still = bool(capturing())
        except Exception as exc:
            logger.debug("device graphs: capture state unknown: %s", exc)
        if still:
            attempt("ending the capture", graph.capture_end)
    if main is not None and hasattr(module, "set_stream"):
        attempt("restoring the stream", lambda: module.set_stream(main))
    if hasattr(graph, "reset"):
        attempt("releasing the graph", graph.reset)
    attempt("synchronizing", lambda: platform.synchronize(spec))


@torch.inference_mode()  # as serving runs them
def capture_at_start(
    runner: DecodeGraphRunner,
    check: bool = True,
    gather: Callable[[Any], list[Any]] | None = None,
) -> str | None:
    """Capture every batch bucket, largest first (later, smaller graphs reuse its pool
    memory), and check each replay once against eager; the failure reason, or None.

    ``gather`` (tensor parallelism: every rank's value on every rank): after each
    capture and each check the ranks share whether theirs went well, and all stop at
    the first failure of any, so no rank goes on to replay (and all-reduce) alone.
    """

    started = time.perf_counter()
    context = runner.context_buckets[-1]
    failure = _capture_each(
        runner.batch_buckets,
        lambda batch: runner.capture(batch, context),
        (lambda batch: check_replay(runner, batch)) if check else None,
        lambda batch: f"batch {batch}",
        gather,
    )
    if failure is not None:
        return failure
    runner.replays.clear()  # the checks' replays: count serving steps only
    logger.info(
        "device graphs: captured %d batch sizes %s at start-up in %.2f s%s%s",
        len(runner.batch_buckets),
        runner.batch_buckets,
        time.perf_counter() - started,
        ", each replay checked against eager" if check else "",
        ", in lockstep with the other tensor-parallel ranks" if gather is not None else "",
    )
    return None


def _capture_each(
    sizes: list[int],
    capture: Callable[[int], Any],
    check: Callable[[int], str | None] | None,
    name: Callable[[int], str],
    gather: Callable[[Any], list[Any]] | None,
) -> str | None:
    """Capture each of ``sizes``, largest first (later, smaller graphs reuse its pool
    memory), each followed by its ``check``; the first failure (this rank's or, with
    ``gather``, another rank's), or None."""
    for size in reversed(sizes):
        failure = None
        try:
            capture(size)
        except Exception as exc:
            failure = f"capturing {name(size)} failed ({type(exc).__name__}: {exc})"
        failure = _settle(gather, failure, f"capturing {name(size)}")
        if failure is None and check is not None:
            failure = _settle(gather, check(size), f"the replay check of {name(size)}")
        if failure is not None:
            return failure
    return None


def _settle(
    gather: Callable[[Any], list[Any]] | None, failure: str | None, what: str
) -> str | None:
    """This rank's ``failure`` (None: it went well), or, under tensor parallelism, the
    first other rank's: the ranks share after each capture and check whether theirs went
    well, so all stop at the first failure of any."""
    if gather is None:
        return failure
    failed = [rank for rank, ok in enumerate(gather(failure is None)) if not ok]
    if failure is None and failed:
        return f"tensor-parallel rank {failed[0]} failed {what} (its log says why)"
    return failure


def check_replay(runner: DecodeGraphRunner, batch: int) -> str | None:
    """Run one decode step of ``batch`` rows eagerly and from its graph; the difference
    when past the dtype's tolerance, else None (``check_step`` says where it runs)."""
    step = check_step(runner, [1] * batch, seed=batch)
    if step is None:
        return None  # not at start-up, or too small a pool to check in: nothing to compare
    eager = eager_logits(runner, step)
    logits = runner.run(step.input_ids, step.positions, step.out_slots, step.rows, [2] * batch)
    assert logits is not None, "run() after capture returns logits"
    return compare_logits(logits, eager, runner.kv_pool.dtype, f"batch {batch}")


class GraphParts(Protocol):
    """What a start-up check reads of a graph runner (decode or mixed)."""

    model: Any
    kv_pool: DeviceKVPool
    req_table: ReqTable
    device: torch.device


@dataclass
class CheckStep:
    """A step for a start-up replay check: sequence ``b`` in request-table row ``b`` has
    one cached key (random K/V) and ``extend_lens[b]`` new tokens."""

    rows: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    positions: list[int]
    out_slots: torch.Tensor  # [T] int64 on the CPU
    sample_ends: list[int]  # the last token of each sequence

    @property
    def prefix_lens(self) -> list[int]:
        return [1] * len(self.rows)


def check_step(runner: GraphParts, extend_lens: list[int], seed: int) -> CheckStep | None:
    """Write the table rows and cached keys of a check step of ``extend_lens`` and return
    it; None where it cannot run: not at start-up (a row in use), or too few rows, slots
    or table columns.

    It uses rows from 0 and KV slots from 1 (each sequence: its cached key, then its new
    tokens): nothing is allocated before serving, so they are free, and serving
    overwrites them before reading.
    """
    table, pool = runner.req_table, runner.kv_pool
    if table.free_rows < table.max_rows or len(extend_lens) > table.max_rows:
        return None
    if sum(extend_lens) + len(extend_lens) >= pool.num_slots:
        return None
    if max(extend_lens) + 1 > table.max_context:
        return None
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
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(
        2, pool.num_layers, len(cached), pool.kv_heads, pool.head_dim, generator=gen
    )
    pool.kv_buffer[:, :, torch.tensor(cached).to(pool.device)] = noise.to(pool.device, pool.dtype)
    vocab = int(runner.model.model.embed_tokens.shape[0])
    return CheckStep(
        rows=rows,
        extend_lens=list(extend_lens),
        input_ids=[(17 + 31 * i) % vocab for i in range(len(out_slots))],
        positions=[p for n in extend_lens for p in range(1, 1 + n)],
        out_slots=torch.tensor(out_slots, dtype=torch.int64),
        sample_ends=[end - 1 for end in itertools.accumulate(extend_lens)],
    )


def eager_logits(runner: GraphParts, step: CheckStep) -> torch.Tensor:
    """``step`` through the eager forward: its sampling rows' logits, float32."""
    device = runner.device

    def upload(values: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64).to(device)

    seq_lens = [1 + n for n in step.extend_lens]
    meta = AttentionMetadata(
        is_decode=all(n == 1 for n in step.extend_lens),
        out_slots=upload(step.out_slots),
        req_rows=upload(step.rows),
        seq_lens=upload(seq_lens),
        req_table=runner.req_table.table,
        prefix_lens_list=step.prefix_lens,
        extend_lens_list=step.extend_lens,
        seq_lens_list=seq_lens,
        max_seq_len=max(seq_lens),
        req_rows_list=step.rows,
    )
    hidden = runner.model(upload(step.input_ids), upload(step.positions), meta, runner.kv_pool)
    if hidden.shape[0] != len(step.sample_ends):
        hidden = hidden.index_select(0, upload(step.sample_ends))
    return runner.model.compute_logits(hidden).float().clone()  # type: ignore[no-any-return]


def compare_logits(
    replayed: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype, what: str
) -> str | None:
    """Why a replay's logits are not the eager forward's (past the tolerance for the KV
    pool's ``dtype``), or None."""
    tolerance = REPLAY_TOLERANCE.get(dtype, 1e-2)
    diff = (replayed.float() - eager).abs().max().item() if replayed.numel() else 0.0
    if not diff <= tolerance:  # NaN fails too
        return (
            f"{what}: the replayed logits differ from eager by {diff:.3g} "
            f"(tolerance {tolerance:g} for {dtype})"
        )
    return None


# ---- mixed steps (engine/mixed_graphs.py) -------------------------------------------------


@torch.inference_mode()  # as serving runs them
def capture_mixed_at_start(
    runner: MixedGraphRunner,
    check: bool = True,
    gather: Callable[[Any], list[Any]] | None = None,
) -> str | None:
    """Capture every token bucket, largest first, each replay checked once against the
    eager forward; the failure reason, or None. On failure no graph is kept.
    ``gather``: tensor-parallel ranks in lockstep, as ``capture_at_start``."""
    started = time.perf_counter()
    failure = _capture_each(
        runner.buckets,
        runner.capture,
        (lambda bucket: check_mixed_replay(runner, bucket)) if check else None,
        lambda bucket: f"{bucket} tokens",
        gather,
    )
    if failure is not None:
        runner.graphs.clear()
        return failure
    runner.replays.clear()  # the checks' replays: count serving steps only
    logger.info(
        "mixed graphs: captured %d token sizes %s (up to %d sequences) at start-up in %.2f s%s%s",
        len(runner.buckets),
        runner.buckets,
        runner.layout_of(runner.max_tokens)[0],
        time.perf_counter() - started,
        ", each replay checked against eager" if check else "",
        ", in lockstep with the other tensor-parallel ranks" if gather is not None else "",
    )
    return None


def check_layout(bucket: int, seqs: int, max_context: int) -> list[int] | None:
    """New tokens per sequence of the start-up check of ``bucket`` (each sequence has one
    cached key): a decode, then prefill chunks that the table's width holds, one token
    short of the bucket (so padding is checked too); None where they need more than
    ``seqs`` sequences."""
    if max_context < 2:
        return None  # no room for a cached key and a new token
    total = bucket - 1 if bucket > 2 else bucket
    new = [1]
    left = total - 1
    while left > 0:
        chunk = min(left, max_context - 1)
        new.append(chunk)
        left -= chunk
    return new if len(new) <= seqs else None


def check_mixed_replay(runner: MixedGraphRunner, bucket: int) -> str | None:
    """Run a mixed step of ``bucket`` eagerly and from its graph; the difference when past
    the dtype's tolerance, else None (check_step says where it runs)."""
    table = runner.req_table
    seqs = runner.layout_of(bucket)[0]
    layout = check_layout(bucket, min(seqs, table.max_rows), table.max_context)
    step = check_step(runner, layout, seed=bucket) if layout else None
    if step is None:
        return None  # not at start-up, or a table or pool too small to check in
    eager = eager_logits(runner, step)
    replayed = runner.run(
        step.input_ids,
        step.positions,
        step.out_slots,
        step.rows,
        step.prefix_lens,
        step.extend_lens,
        step.sample_ends,
    )
    return compare_logits(replayed, eager, runner.kv_pool.dtype, f"{bucket} tokens")
