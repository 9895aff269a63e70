"""The copies behind HostKVPool.backup/load: device KV pool <-> host KV pool.

Both pools are addressed as flat rows of one token's K (or V) in one layer (``H * D``
values): the device pool ``[2, L, S, H, D]`` has row ``(kv * L + layer) * S + slot``; the
host pool has row ``(kv * L + layer) * N + slot`` (layer_first ``[2, L, N, H, D]``) or
``(kv * N + slot) * L + layer`` (page_first ``[2, N, L, H, D]``). A copy of any slot set
over any layer set is then one gather (``index_select``) and at most one scatter
(``index_copy_``) over row ids, whatever the layer count, instead of 2 x L small copies.
Row ids are built in the host buffer's memory order, so a run of consecutive host slots
is a contiguous block (page_first) or one block per layer plane (layer_first).

On CPU the pools share memory: copies go straight between them, in pieces of a few MiB.
On accelerators a device-side staging buffer in the host layout is filled by one gather
kernel, then moved by one DMA per host run (asynchronous from pinned memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch

from engine.host_alloc import pinned_empty
from engine.kvcache.device_pool import DeviceKVPool


class HostLayout(Protocol):
    """What the copies read of a host pool: the buffer and its layout (kvcache/host_pool.py's
    HostKVPool has them).

    NOTE: a protocol, not an import: host_pool uses this module, never the other way."""

    kv_buffer: torch.Tensor  # [2, L, N, H, D] layer_first or [2, N, L, H, D] page_first
    layout: str
    num_layers: int
    capacity: int
    bytes_per_token: int


# Below this mean run size, a DMA per run costs more in calls than it moves: the run is
# gathered (load) or scattered (backup) on the CPU through one pinned buffer instead.
MIN_RUN_BYTES = 64 << 10
# Upper bound of one device staging buffer; larger transfers are split into chunks.
STAGE_BYTES = 64 << 20
# Bytes per CPU piece: a temporary of this size stays in the last-level cache.
CPU_PIECE_BYTES = 4 << 20


# ---------------------------------------------------------------- planning


class SlotRun(NamedTuple):
    """Positions ``offset .. offset+length-1`` of a slot list whose host slots are
    consecutive from ``host_start``."""

    offset: int
    host_start: int
    length: int


def plan_runs(host_slots: torch.Tensor) -> list[SlotRun]:
    """Split a CPU int64 slot list into maximal runs of consecutive slots (numpy: a few
    torch calls here would cost more than a 1 MiB copy)."""
    host = host_slots.numpy()
    if host.size == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(host) != 1) + 1))
    ends = np.concatenate((starts[1:], [host.size]))
    columns = zip(starts.tolist(), host[starts].tolist(), (ends - starts).tolist(), strict=True)
    return [SlotRun(*column) for column in columns]


def fragmented(runs: list[SlotRun], num_tokens: int, run_token_bytes: int) -> bool:
    """Too many short runs: one indexed copy beats a copy per run. ``run_token_bytes``:
    bytes one token adds to one run's block (a layer plane, or a page_first K/V half)."""
    return len(runs) > 1 and num_tokens * run_token_bytes < len(runs) * MIN_RUN_BYTES


def run_start(slots: torch.Tensor) -> int | None:
    """First slot if ``slots`` (CPU int64) are consecutive, else None."""
    n = slots.numel()
    first = int(slots[0])
    if n == 1 or (int(slots[-1]) - first == n - 1 and bool((slots.diff() == 1).all())):
        return first
    return None


def piece_tokens(host: HostLayout) -> int:
    """Tokens per CPU piece: about CPU_PIECE_BYTES, at least one token."""
    return max(1, CPU_PIECE_BYTES // host.bytes_per_token)


def pieces(num_tokens: int, tokens_per_piece: int) -> list[tuple[int, int]]:
    step = max(1, tokens_per_piece)
    return [(s, min(s + step, num_tokens)) for s in range(0, num_tokens, step)]


def copy_all(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False
) -> None:
    """Pairwise ``dst.copy_(src)``; between CPU tensors in one dispatch, since per-call
    overhead dominates small runs (device copies are one DMA each either way)."""
    if not dsts:
        return
    if dsts[0].device.type == srcs[0].device.type == "cpu":
        torch._foreach_copy_(dsts, srcs)
        return
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=non_blocking)


# ---------------------------------------------------------------- row ids


def _layer_ids(layers: list[int], device: torch.device | None = None) -> torch.Tensor:
    """``layers`` as int64 on ``device``: built there (arange) when consecutive, as they
    always are here; a blocking upload would wait for all work queued on the stream."""
    first = layers[0]
    if layers == list(range(first, first + len(layers))):
        return torch.arange(first, first + len(layers), dtype=torch.int64, device=device)
    return torch.tensor(layers, dtype=torch.int64).to(device, non_blocking=True)


def device_rows(
    pool: DeviceKVPool, slots: torch.Tensor, layers: list[int], layer_major: bool
) -> torch.Tensor:
    """Device row ids ``[2, layers, n]`` (layer_major) or ``[2, n, layers]``, computed on
    ``slots.device`` (no host-device copy, no stream synchronise)."""
    kv = torch.arange(2, dtype=torch.int64, device=slots.device)
    planes = (kv[:, None] * pool.num_layers + _layer_ids(layers, slots.device)) * pool.num_slots
    if layer_major:
        return planes[:, :, None] + slots[None, None, :]
    return planes[:, None, :] + slots[None, :, None]


def host_rows(host: HostLayout, slots: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """Host row ids in the host buffer's order: ``[2, layers, n]`` or ``[2, n, layers]``."""
    kv = torch.arange(2)[:, None, None]
    if host.layout == "layer_first":
        return (kv * host.num_layers + _layer_ids(layers)[:, None]) * host.capacity + slots
    return (kv * host.capacity + slots[:, None]) * host.num_layers + _layer_ids(layers)


def rows_view(buffer: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """``[rows, H * D]`` view of a KV buffer. ``wide``: reinterpret each row as 16-byte
    elements where it divides evenly; CPU scatters run per element, so fewer, wider
    elements move the same bytes faster (a bit-exact copy, never arithmetic)."""
    rows = buffer.view(-1, buffer.shape[-2] * buffer.shape[-1])
    if wide and rows.device.type == "cpu" and (rows.shape[1] * rows.element_size()) % 16 == 0:
        return rows.view(torch.uint8).view(torch.complex128)
    return rows


# ---------------------------------------------------------------- CPU: one pass, in place


def _block_views(
    host: HostLayout, pool: DeviceKVPool, device_start: int, host_start: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device and host ``[2, L, length, H, D]`` views of consecutive slots on both sides:
    one strided copy between them moves every layer."""
    device = pool.kv_buffer[:, :, device_start : device_start + length]
    if host.layout == "layer_first":
        return device, host.kv_buffer[:, :, host_start : host_start + length]
    return device, host.kv_buffer[:, host_start : host_start + length].transpose(1, 2)


def _half_block(host: HostLayout, kv: int, start: int, length: int) -> slice:
    """page_first: the host rows of K (kv=0) or V of consecutive slots ``start ..
    start+length-1``, every layer: one contiguous block of ``length * L`` rows."""
    first = (kv * host.capacity + start) * host.num_layers
    return slice(first, first + length * host.num_layers)


def _gather(src: torch.Tensor, rows: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``src[rows]`` into the front of a reused scratch buffer: a fresh temporary of a few
    MiB per piece costs page faults that are slower than the copy itself."""
    out = scratch.view(src.dtype)[: rows.numel() * src.shape[1]].view(-1, src.shape[1])
    return torch.index_select(src, 0, rows, out=out)


def backup_cpu(
    host: HostLayout,
    pool: DeviceKVPool,
    device_slots: torch.Tensor,
    host_slots: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """All layers of ``device_slots`` into ``host_slots`` (both on the CPU); ``scratch``:
    a byte buffer of at least one piece (``piece_tokens`` tokens of all layers)."""
    layers = list(range(host.num_layers))
    layer_first = host.layout == "layer_first"
    src = rows_view(pool.kv_buffer)
    dst = rows_view(host.kv_buffer)
    planes = 2 * host.num_layers
    for lo, hi in pieces(host_slots.numel(), piece_tokens(host)):
        d, h = device_slots[lo:hi], host_slots[lo:hi]
        start, m = run_start(h), hi - lo
        device_start = run_start(d) if start is not None else None
        if start is not None and device_start is not None:  # consecutive on both sides
            device_view, host_view = _block_views(host, pool, device_start, start, m)
            host_view.copy_(device_view)
            continue
        rows = device_rows(pool, d, layers, layer_major=layer_first)
        if start is None:  # scattered host slots: gather, then scatter
            dst.index_copy_(
                0, host_rows(host, h, layers).reshape(-1), _gather(src, rows.reshape(-1), scratch)
            )
        elif layer_first:  # one block per layer plane
            gathered = _gather(src, rows.reshape(-1), scratch).view(planes, m, -1)
            dst.view(planes, host.capacity, -1)[:, start : start + m].copy_(gathered)
        else:  # each K/V half is one contiguous block: gather straight into it
            for kv in range(2):
                block = dst[_half_block(host, kv, start, m)]
                torch.index_select(src, 0, rows[kv].reshape(-1), out=block)


def load_cpu(
    host: HostLayout,
    pool: DeviceKVPool,
    host_slots: torch.Tensor,
    device_slots: torch.Tensor,
    layers: list[int],
    scratch: torch.Tensor,
) -> None:
    """``layers`` of ``host_slots`` into ``device_slots`` (both on the CPU)."""
    layer_first = host.layout == "layer_first"
    dst = rows_view(pool.kv_buffer, wide=True)
    src = rows_view(host.kv_buffer, wide=True)
    all_layers = len(layers) == host.num_layers
    for lo, hi in pieces(host_slots.numel(), piece_tokens(host)):
        d, h = device_slots[lo:hi], host_slots[lo:hi]
        start = run_start(h) if all_layers else None
        device_start = run_start(d) if start is not None else None
        if start is not None and device_start is not None:  # consecutive on both sides
            device_view, host_view = _block_views(host, pool, device_start, start, hi - lo)
            device_view.copy_(host_view)
            continue
        rows = device_rows(pool, d, layers, layer_major=layer_first)
        if start is None or layer_first:  # gather the host rows (memcpy-fast), one scatter
            values = _gather(src, host_rows(host, h, layers).reshape(-1), scratch)
            dst.index_copy_(0, rows.reshape(-1), values)
            continue
        for kv in range(2):  # each K/V half of the run is one contiguous block
            dst.index_copy_(0, rows[kv].reshape(-1), src[_half_block(host, kv, start, hi - lo)])


# ---------------------------------------------------------------- accelerators: staged


def _run_token_bytes(host: HostLayout) -> int:
    """Bytes one token adds to a run's block: a layer plane (layer_first) or a K/V half
    of every layer (page_first)."""
    planes = 2 * host.num_layers if host.layout == "layer_first" else 2
    return host.bytes_per_token // planes


def backup_staged(
    host: HostLayout,
    pool: DeviceKVPool,
    device_slots: torch.Tensor,  # on the device
    host_slots: torch.Tensor,  # CPU
    non_blocking: bool,
) -> Callable[[], None] | None:
    """One gather kernel into a device buffer in the host layout, then one DMA per host
    run (per layer plane for layer_first, per K/V half for page_first).

    Fragmented host slots: one DMA into a pinned buffer and a CPU scatter. Returns that
    scatter when it must wait for the copy stream (run it once the copy is done), else
    None."""
    layers = list(range(host.num_layers))
    layer_first = host.layout == "layer_first"
    n = host_slots.numel()
    rows = device_rows(pool, device_slots, layers, layer_major=layer_first)
    stage = rows_view(pool.kv_buffer).index_select(0, rows.reshape(-1))  # [rows, H*D]
    runs = plan_runs(host_slots)
    dst = rows_view(host.kv_buffer)
    if fragmented(runs, n, _run_token_bytes(host)):
        targets = host_rows(host, host_slots, layers).reshape(-1)
        if not non_blocking:  # pageable host memory: the copy blocks anyway
            dst.index_copy_(0, targets, stage.cpu())
            return None
        # NOTE: off the host's critical path: the DMA is queued now, the scatter runs when
        # the handle finds the copy done; the node stays locked until then.
        landing = pinned_empty(tuple(stage.shape), stage.dtype)
        landing.copy_(stage, non_blocking=True)

        def scatter() -> None:
            dst.index_copy_(0, targets, landing)

        return scatter
    planes = 2 * host.num_layers
    if layer_first:
        stage_planes = stage.view(planes, n, -1)
        host_planes = dst.view(planes, host.capacity, -1)
    else:
        stage_planes = stage.view(2, n * host.num_layers, -1)
        host_planes = dst.view(2, host.capacity * host.num_layers, -1)
    scale = 1 if layer_first else host.num_layers  # rows per slot within a plane
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for run in runs:
        host_part = slice(run.host_start * scale, (run.host_start + run.length) * scale)
        stage_part = slice(run.offset * scale, (run.offset + run.length) * scale)
        dsts.extend(host_planes[:, host_part].unbind(0))
        srcs.extend(stage_planes[:, stage_part].unbind(0))
    copy_all(dsts, srcs, non_blocking)
    return None


def load_staged(
    host: HostLayout,
    pool: DeviceKVPool,
    host_slots: torch.Tensor,  # CPU
    device_slots: torch.Tensor,  # on the device
    layers: list[int],
    non_blocking: bool,
) -> None:
    """``layers`` of host rows into a device buffer (one DMA per host run and layer plane,
    or per run and K/V half when ``layers`` is all of page_first's; else a CPU gather and
    one DMA), then one scatter kernel into the device pool."""
    n = host_slots.numel()
    layer_first = host.layout == "layer_first"
    src = rows_view(host.kv_buffer)
    dst = rows_view(pool.kv_buffer)
    rows = device_rows(pool, device_slots, layers, layer_major=layer_first)
    stage = torch.empty((*rows.shape, src.shape[1]), dtype=src.dtype, device=dst.device)
    runs = plan_runs(host_slots)
    if fragmented(runs, n, _run_token_bytes(host)) or not (
        layer_first or len(layers) == host.num_layers
    ):
        # One CPU gather, one DMA. Pinned: asynchronous (the caching host allocator keeps
        # the buffer until the copy ran); pageable: blocking, the temporary is freed next.
        sources = host_rows(host, host_slots, layers).reshape(-1)
        if non_blocking:
            gathered = pinned_empty((sources.numel(), src.shape[1]), src.dtype)
            torch.index_select(src, 0, sources, out=gathered)
        else:
            gathered = src.index_select(0, sources)
        stage.view(-1, src.shape[1]).copy_(gathered, non_blocking=non_blocking)
    else:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for run in runs:
            part = slice(run.offset, run.offset + run.length)
            for kv in range(2):
                if layer_first:  # [2, layers, n, H*D]: one block per layer plane
                    for i, layer in enumerate(layers):
                        first = (kv * host.num_layers + layer) * host.capacity + run.host_start
                        dsts.append(stage[kv, i, part])
                        srcs.append(src[first : first + run.length])
                else:  # [2, n, L, H*D]: the run's K (or V) rows are one block
                    dsts.append(stage[kv, part].flatten(0, 1))
                    srcs.append(src[_half_block(host, kv, run.host_start, run.length)])
        copy_all(dsts, srcs, non_blocking)
    dst.index_copy_(0, rows.reshape(-1), stage.view(-1, src.shape[1]))
