"""Device graphs made safe to use: a capture that cannot leave the backend capturing, and
the start-up pass that captures every batch size, largest first, and checks each replay
once against the eager forward before the server reports healthy.

A failure anywhere in the start-up pass turns graphs off before serving starts, with the
reason logged; nothing is captured on the serving path afterwards.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine import platform
from engine.layers.attention_meta import AttentionMetadata

if TYPE_CHECKING:
    from engine.graph_runner import DecodeGraphRunner

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

    def settle(failure: str | None, what: str) -> str | None:
        if gather is None:
            return failure
        failed = [rank for rank, ok in enumerate(gather(failure is None)) if not ok]
        if failure is None and failed:
            return f"tensor-parallel rank {failed[0]} failed {what} (its log says why)"
        return failure

    started = time.perf_counter()
    context = runner.context_buckets[-1]
    for batch in reversed(runner.batch_buckets):
        failure = None
        try:
            runner.capture(batch, context)
        except Exception as exc:
            failure = f"capturing batch {batch} failed ({type(exc).__name__}: {exc})"
        failure = settle(failure, f"capturing batch {batch}")
        if failure is None and check:
            failure = settle(check_replay(runner, batch), f"the replay check of batch {batch}")
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


def check_replay(runner: DecodeGraphRunner, batch: int) -> str | None:
    """Run one decode step of ``batch`` rows eagerly and from its graph; the difference
    when past the dtype's tolerance, else None.

    The step uses request-table rows ``0..batch-1`` and KV slots ``1..2*batch``: nothing
    is allocated before serving, so they are free, and serving overwrites them before
    reading (each row: a random cached key at slot ``2b+1``, the new token at ``2b+2``).
    """
    table, pool = runner.req_table, runner.kv_pool
    if table.free_rows < table.max_rows or pool.num_slots <= 2 * batch or batch > table.max_rows:
        return None  # not at start-up, or too small a pool to check in: nothing to compare
    rows = list(range(batch))
    cached = torch.arange(1, 2 * batch + 1, 2)  # [batch]
    new = cached + 1  # [batch]
    for row in rows:
        table.write(row, 0, torch.stack([cached[row], new[row]]))
    table.flush()
    gen = torch.Generator().manual_seed(batch)
    noise = torch.randn(2, pool.num_layers, batch, pool.kv_heads, pool.head_dim, generator=gen)
    pool.kv_buffer[:, :, cached.to(pool.device)] = noise.to(pool.device, pool.dtype)
    vocab = int(runner.model.model.embed_tokens.shape[0])
    input_ids = [(17 + 31 * b) % vocab for b in rows]
    positions, seq_lens = [1] * batch, [2] * batch
    eager = _eager_logits(runner, input_ids, positions, new, rows, seq_lens)
    logits = runner.run(input_ids, positions, new, rows, seq_lens)
    assert logits is not None, "run() after capture returns logits"
    replayed = logits.float()
    tolerance = REPLAY_TOLERANCE.get(pool.dtype, 1e-2)
    diff = (replayed - eager).abs().max().item() if replayed.numel() else 0.0
    if not diff <= tolerance:  # NaN fails too
        return (
            f"batch {batch}: the replayed logits differ from eager by {diff:.3g} "
            f"(tolerance {tolerance:g} for {pool.dtype})"
        )
    return None


def _eager_logits(
    runner: DecodeGraphRunner,
    input_ids: list[int],
    positions: list[int],
    out_slots: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
) -> torch.Tensor:
    """The same decode step through the eager forward: ``[batch, vocab]`` float32."""
    device = runner.device

    def upload(values: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64).to(device)

    meta = AttentionMetadata(
        is_decode=True,
        out_slots=upload(out_slots),
        req_rows=upload(rows),
        seq_lens=upload(seq_lens),
        req_table=runner.req_table.table,
        prefix_lens_list=[n - 1 for n in seq_lens],
        extend_lens_list=[1] * len(seq_lens),
        seq_lens_list=list(seq_lens),
        max_seq_len=max(seq_lens),
        req_rows_list=list(rows),
    )
    hidden = runner.model(upload(input_ids), upload(positions), meta, runner.kv_pool)
    return runner.model.compute_logits(hidden).float().clone()  # type: ignore[no-any-return]
