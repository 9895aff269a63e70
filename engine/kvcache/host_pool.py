"""HiCache host tier (L2): host KV buffers, a page-granular free list, device<->host copies."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.host_memory import check_host_memory
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.transfer import SlotRun, copy_all, fragmented, fused_kv_base, plan_runs
from engine.platform import DeviceSpec, alloc_host, host_alloc_method

HOST_LAYOUTS = ("layer_first", "page_first")
# Upper bound of one device staging buffer; larger transfers are split into chunks.
_STAGE_BYTES = 64 << 20
# Tokens per fused gather on CPU: a temporary of a few MiB stays cache-friendly.
_GATHER_TOKENS = 64


class HostKVPool:
    """Host copy of the KV pool geometry, ``[2, L, N, H, D]`` (layer_first) or
    ``[2, N, L, H, D]`` (page_first), handed out in pages of ``page_size`` slots.

    NOTE: every host slot is either free (its page is on ``_free_pages``) or owned by
    exactly one caller of ``alloc``; ``available + owned == capacity`` at all times.
    """

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: DeviceSpec,
        layout: str = "layer_first",
        page_size: int = 1,
        alloc_method: str = "auto",
    ) -> None:
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"host KV layout {layout!r} is not valid; one of {HOST_LAYOUTS}")
        if page_size < 1 or num_tokens < page_size:
            raise ValueError(
                f"the host KV pool needs at least one page of {page_size} tokens, "
                f"got num_tokens={num_tokens}"
            )
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.layout, self.page_size = dtype, device, layout, page_size
        self.num_pages = num_tokens // page_size
        self.capacity = self.num_pages * page_size
        self.bytes_per_token = DeviceKVPool.token_bytes(num_layers, kv_heads, head_dim, dtype)
        self.nbytes = self.capacity * self.bytes_per_token
        check_host_memory(
            self.nbytes, "the HiCache host KV pool", "--hicache-size or --hicache-ratio"
        )
        method = host_alloc_method(device, alloc_method)
        if layout == "layer_first":
            shape = (2, num_layers, self.capacity, kv_heads, head_dim)
        else:
            shape = (2, self.capacity, num_layers, kv_heads, head_dim)
        self.allocation = alloc_host(shape, dtype, device, method)
        self.kv_buffer = self.allocation.tensor
        # Stack of free page ids, popped from the top (the end): initially page 0 first.
        self._free_pages = torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int64)
        self._num_free = self.num_pages
        self._page_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        # Tests set this to run the accelerator copy path (staging buffers) on CPU tensors.
        self._force_staged = False
        self._fused_key: tuple[int, int] | None = None
        self._fused_base: torch.Tensor | None = None

    # ------------------------------------------------------------ accounting

    @property
    def method(self) -> str:
        return self.allocation.method

    @property
    def pinned(self) -> bool:
        return self.allocation.pinned

    @property
    def available(self) -> int:
        """Free slots."""
        return self._num_free * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots ``[ceil(num_tokens / page_size) * page_size]`` int64, or None if too few free."""
        if num_tokens < 0:
            raise ValueError(f"cannot allocate {num_tokens} host slots")
        num_pages = -(-num_tokens // self.page_size)
        if num_pages > self._num_free:
            return None
        top = self._num_free
        page_ids = self._free_pages[top - num_pages : top].flip(0)
        self._num_free -= num_pages
        self._page_free[page_ids] = False
        return (page_ids[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages, in the grouping ``alloc`` handed them out (any page order)."""
        slots = slots.reshape(-1).to("cpu", torch.int64)
        if slots.numel() == 0:
            return
        if slots.numel() % self.page_size:
            raise ValueError(
                f"freeing {slots.numel()} host slots: not whole pages of {self.page_size}"
            )
        pages = slots.view(-1, self.page_size)  # [num_pages, page_size]
        page_ids = pages[:, 0] // self.page_size
        whole = (pages == page_ids[:, None] * self.page_size + self._offsets).all()
        in_range = bool((page_ids >= 0).all()) and bool((page_ids < self.num_pages).all())
        if not (whole and in_range):
            raise ValueError("freeing host slots that are not whole pages of this pool")
        # NOTE: a page freed twice would later be handed to two owners; refuse it here.
        if self._page_free[page_ids].any() or torch.unique(page_ids).numel() != page_ids.numel():
            raise ValueError("host KV page freed twice")
        self._page_free[page_ids] = True
        n = page_ids.numel()
        # Pushed in descending order so the next alloc pops them in ascending order: pages
        # freed together come back as one run of consecutive slots (fewer, larger copies).
        self._free_pages[self._num_free : self._num_free + n] = page_ids.sort(descending=True)[0]
        self._num_free += n

    # ------------------------------------------------------------ copies

    def _pairs(
        self, device_pool: DeviceKVPool, layers: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device ``[S, H, D]``, host ``[N, H, D]``) buffers of K, then V, of ``layers``."""
        split = 0 if self.layout == "layer_first" else 1  # page_first views are strided
        host = [self.kv_buffer[kv].unbind(split) for kv in range(2)]
        device = (device_pool.k_buffers, device_pool.v_buffers)
        return [(device[kv][layer], host[kv][layer]) for kv in range(2) for layer in layers]

    def _fused(self, device_pool: DeviceKVPool) -> torch.Tensor | None:
        """The device pool as one ``[2, L, S, H, D]`` tensor, if its buffers are views of one."""
        key = (id(device_pool), device_pool.k_buffers[0].data_ptr())
        if self._fused_key != key:
            self._fused_key, self._fused_base = key, fused_kv_base(device_pool)
        return self._fused_base

    def _groups(self, base: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device ``[G, S, H, D]``, host ``[G, N, H, D]``) views covering all layers."""
        if self.layout == "layer_first":
            return [(base.flatten(0, 1), self.kv_buffer.flatten(0, 1))]
        return [(base[kv], self.kv_buffer[kv].transpose(0, 1)) for kv in range(2)]

    def _plan_direct(
        self,
        device_pool: DeviceKVPool,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        all_layers: bool,
    ) -> tuple[list[SlotRun], torch.Tensor | None]:
        """Runs for a CPU copy, and the fused device tensor when it can be used. With it,
        a run costs one or two copies whatever the layer count, so runs are also split
        where device slots jump (e.g. at page boundaries) unless they get too short."""
        base = self._fused(device_pool) if all_layers else None
        if base is not None:
            runs = plan_runs(host_slots, device_slots, joint=True)
            if not fragmented(runs, host_slots.numel()):
                return runs, base
        return plan_runs(host_slots, device_slots), base

    def _check(
        self, device_pool: DeviceKVPool, host_slots: torch.Tensor, device_slots: torch.Tensor
    ) -> torch.Tensor:
        ours = (self.num_layers, self.kv_heads, self.head_dim, self.dtype)
        theirs = (
            device_pool.num_layers,
            device_pool.kv_heads,
            device_pool.head_dim,
            device_pool.dtype,
        )
        if ours != theirs:
            raise ValueError(f"host pool geometry {ours} differs from the device pool {theirs}")
        if host_slots.numel() != device_slots.numel():
            raise ValueError(
                f"{host_slots.numel()} host slots vs {device_slots.numel()} "
                "device slots: a copy needs one of each per token"
            )
        return host_slots.reshape(-1).to("cpu", torch.int64)

    def _staged(self, device_pool: DeviceKVPool) -> bool:
        return device_pool.device.type != "cpu" or self._force_staged

    def _chunks(self, n: int, bytes_per_token: int) -> list[tuple[int, int]]:
        step = max(self.page_size, _STAGE_BYTES // max(bytes_per_token, 1))
        return [(s, min(s + step, n)) for s in range(0, n, step)]

    def backup(
        self,
        device_pool: DeviceKVPool,
        device_slots: torch.Tensor,
        host_slots: torch.Tensor,
        non_blocking: bool = False,
    ) -> None:
        """Copy K/V of ``device_slots`` (all layers) into ``host_slots``."""
        host_slots = self._check(device_pool, host_slots, device_slots)
        if host_slots.numel() == 0:
            return
        if not self._staged(device_pool):
            self._backup_direct(device_pool, device_slots.reshape(-1).to(torch.int64), host_slots)
            return
        device_slots = device_slots.reshape(-1).to(
            device_pool.device, torch.int64, non_blocking=True
        )
        for start, end in self._chunks(host_slots.numel(), self.bytes_per_token):
            self._backup_staged(
                device_pool, device_slots[start:end], host_slots[start:end], non_blocking
            )

    def _backup_direct(
        self, device_pool: DeviceKVPool, device_slots: torch.Tensor, host_slots: torch.Tensor
    ) -> None:
        """CPU pool: copy straight from the device buffers, one pass over the bytes."""
        runs, base = self._plan_direct(device_pool, host_slots, device_slots, True)
        many_runs = fragmented(runs, host_slots.numel())
        if base is None:  # with the fused pool every branch below copies all layers at once
            pairs = self._pairs(device_pool, list(range(self.num_layers)))
        if many_runs and base is not None:
            # One gather over every layer per piece: 2 x num_layers small copies cost more,
            # and one huge temporary costs more than it saves.
            self._gather_to_host(base, device_slots, host_slots)
            return
        if many_runs:
            for src, dst in pairs:
                dst.index_copy_(0, host_slots, src.index_select(0, device_slots))
            return
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for run in runs:
            host_part = slice(run.host_start, run.host_start + run.length)
            if run.device_start >= 0:  # consecutive on both sides: memcpy-like copies
                device_part = slice(run.device_start, run.device_start + run.length)
                if base is not None:  # every layer in one or two strided copies
                    for src, dst in self._groups(base):
                        dsts.append(dst[:, host_part])
                        srcs.append(src[:, device_part])
                else:
                    dsts.extend(dst[host_part] for _, dst in pairs)
                    srcs.extend(src[device_part] for src, _ in pairs)
                continue
            index = device_slots[run.offset : run.offset + run.length]
            if base is not None:
                self._gather_to_host(base, index, host_slots[run.offset : run.offset + run.length])
                continue
            for src, dst in pairs:  # gather straight into the host run
                out = dst[host_part]
                if out.is_contiguous():
                    torch.index_select(src, 0, index, out=out)
                else:
                    out.copy_(src.index_select(0, index))
        copy_all(dsts, srcs)

    def _gather_to_host(
        self, base: torch.Tensor, device_slots: torch.Tensor, host_slots: torch.Tensor
    ) -> None:
        """One gather over every layer of the fused device pool per cache-sized piece."""
        for lo in range(0, device_slots.numel(), _GATHER_TOKENS):
            gathered = base.index_select(2, device_slots[lo : lo + _GATHER_TOKENS])
            host_piece = host_slots[lo : lo + _GATHER_TOKENS]  # gathered: [2, L, piece, H, D]
            if self.layout == "layer_first":
                self.kv_buffer.index_copy_(2, host_piece, gathered)
            else:
                self.kv_buffer.index_copy_(1, host_piece, gathered.transpose(1, 2))

    def _backup_staged(
        self,
        device_pool: DeviceKVPool,
        device_slots: torch.Tensor,
        host_slots: torch.Tensor,
        non_blocking: bool,
    ) -> None:
        """Accelerator pool: gather on the device into the host layout, then one DMA per
        host run (per layer for layer_first, all layers at once for page_first)."""
        n, layer_first = host_slots.numel(), self.layout == "layer_first"
        geometry = (self.kv_heads, self.head_dim)
        shape = (
            (2, self.num_layers, n, *geometry)
            if layer_first
            else (2, n, self.num_layers, *geometry)
        )
        stage = torch.empty(shape, dtype=self.dtype, device=device_pool.device)
        base = self._fused(device_pool)
        if base is not None and layer_first:  # one gather kernel for every layer
            torch.index_select(base.flatten(0, 1), 1, device_slots, out=stage.flatten(0, 1))
        elif base is not None:
            for kv in range(2):  # [L, n, H, D] -> [n, L, H, D]
                stage[kv] = base[kv].index_select(1, device_slots).transpose(0, 1)
        else:
            for kv, buffers in enumerate((device_pool.k_buffers, device_pool.v_buffers)):
                for layer, src in enumerate(buffers):
                    if layer_first:  # stage[kv, layer]: [n, H, D] contiguous
                        torch.index_select(src, 0, device_slots, out=stage[kv, layer])
                    else:
                        stage[kv, :, layer] = src.index_select(0, device_slots)
        runs = plan_runs(host_slots, None)
        if fragmented(runs, n):  # one blocking DMA, scatter on the CPU
            self.kv_buffer.index_copy_(2 if layer_first else 1, host_slots, stage.cpu())
            return
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for run in runs:
            host_part = slice(run.host_start, run.host_start + run.length)
            stage_part = slice(run.offset, run.offset + run.length)
            for kv in range(2):
                if layer_first:  # host runs are contiguous per layer only
                    dsts.extend(self.kv_buffer[kv, :, host_part].unbind(0))
                    srcs.extend(stage[kv, :, stage_part].unbind(0))
                else:  # [length, L, H, D] contiguous on both sides
                    dsts.append(self.kv_buffer[kv, host_part])
                    srcs.append(stage[kv, stage_part])
        copy_all(dsts, srcs, non_blocking)

    def load_layer(
        self,
        device_pool: DeviceKVPool,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        layer: int,
        non_blocking: bool = False,
    ) -> None:
        """Copy one layer's K/V from ``host_slots`` into ``device_slots``."""
        self._load(device_pool, host_slots, device_slots, [layer], non_blocking, None)

    def load(
        self,
        device_pool: DeviceKVPool,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        non_blocking: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Copy all layers from ``host_slots`` into ``device_slots``, calling
        ``on_layer(layer)`` once that layer's copies are issued (events go there)."""
        self._load(
            device_pool,
            host_slots,
            device_slots,
            list(range(self.num_layers)),
            non_blocking,
            on_layer,
        )

    def _load(
        self,
        device_pool: DeviceKVPool,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        layers: list[int],
        non_blocking: bool,
        on_layer: Callable[[int], None] | None,
    ) -> None:
        host_slots = self._check(device_pool, host_slots, device_slots)
        device_slots = device_slots.reshape(-1).to(torch.int64)
        notify = on_layer if on_layer is not None else (lambda layer: None)
        all_layers = len(layers) == self.num_layers
        if host_slots.numel() == 0 or not self._staged(device_pool):
            if host_slots.numel():
                self._load_direct(device_pool, host_slots, device_slots, layers, all_layers)
            for layer in layers:
                notify(layer)
            return
        device_slots = device_slots.to(device_pool.device, non_blocking=True)
        if self.layout == "page_first" and all_layers:  # one DMA per run carries every layer
            chunks = self._chunks(host_slots.numel(), self.bytes_per_token)
            for i, (start, end) in enumerate(chunks):
                self._load_page_first_staged(
                    device_pool,
                    host_slots[start:end],
                    device_slots[start:end],
                    non_blocking,
                    notify if i == len(chunks) - 1 else None,
                )
            return
        chunks = self._chunks(host_slots.numel(), self.bytes_per_token // self.num_layers)
        for layer in layers:
            for start, end in chunks:
                self._load_layer_staged(
                    device_pool, host_slots[start:end], device_slots[start:end], layer, non_blocking
                )
            notify(layer)

    def _load_direct(
        self,
        device_pool: DeviceKVPool,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        layers: list[int],
        all_layers: bool,
    ) -> None:
        runs, base = self._plan_direct(device_pool, host_slots, device_slots, all_layers)
        many_runs = fragmented(runs, host_slots.numel())
        if many_runs or base is None or any(run.device_start < 0 for run in runs):
            pairs = self._pairs(device_pool, layers)
        if many_runs:
            for dst, src in pairs:
                dst.index_copy_(0, device_slots, src.index_select(0, host_slots))
            return
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for run in runs:
            host_part = slice(run.host_start, run.host_start + run.length)
            if run.device_start >= 0:
                device_part = slice(run.device_start, run.device_start + run.length)
                if base is not None:
                    for dst, src in self._groups(base):
                        dsts.append(dst[:, device_part])
                        srcs.append(src[:, host_part])
                else:
                    dsts.extend(dst[device_part] for dst, _ in pairs)
                    srcs.extend(src[host_part] for _, src in pairs)
                continue
            index = device_slots[run.offset : run.offset + run.length]
            if base is not None:  # one scatter over every layer from the host run
                if self.layout == "layer_first":
                    base.index_copy_(2, index, self.kv_buffer[:, :, host_part])
                else:
                    base.index_copy_(2, index, self.kv_buffer[:, host_part].transpose(1, 2))
                continue
            for dst, src in pairs:  # scatter straight from the host run
                dst.index_copy_(0, index, src[host_part])
        copy_all(dsts, srcs)

    def _load_layer_staged(
        self,
        device_pool: DeviceKVPool,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        layer: int,
        non_blocking: bool,
    ) -> None:
        n = host_slots.numel()
        stage = torch.empty(
            (2, n, self.kv_heads, self.head_dim), dtype=self.dtype, device=device_pool.device
        )
        runs = plan_runs(host_slots, None)
        for kv in range(2):
            src = self._pairs(device_pool, [layer])[kv][1]  # host [N, H, D]
            if fragmented(runs, n):  # gather on the CPU, one DMA
                stage[kv].copy_(src.index_select(0, host_slots))
                continue
            for run in runs:
                stage[kv, run.offset : run.offset + run.length].copy_(
                    src[run.host_start : run.host_start + run.length], non_blocking=non_blocking
                )
        device_pool.k_buffers[layer].index_copy_(0, device_slots, stage[0])
        device_pool.v_buffers[layer].index_copy_(0, device_slots, stage[1])

    def _load_page_first_staged(
        self,
        device_pool: DeviceKVPool,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        non_blocking: bool,
        on_layer: Callable[[int], None] | None,
    ) -> None:
        n = host_slots.numel()
        stage = torch.empty(
            (2, n, self.num_layers, self.kv_heads, self.head_dim),
            dtype=self.dtype,
            device=device_pool.device,
        )
        runs = plan_runs(host_slots, None)
        if fragmented(runs, n):
            stage.copy_(self.kv_buffer.index_select(1, host_slots))
        else:
            dsts = [stage[kv, r.offset : r.offset + r.length] for r in runs for kv in range(2)]
            srcs = [
                self.kv_buffer[kv, r.host_start : r.host_start + r.length]
                for r in runs
                for kv in range(2)
            ]
            copy_all(dsts, srcs, non_blocking)  # [length, L, H, D] contiguous on both sides
        base = self._fused(device_pool)
        if base is not None:  # one scatter kernel per K/V for every layer
            for kv in range(2):
                base[kv].index_copy_(1, device_slots, stage[kv].transpose(0, 1))
        for layer in range(self.num_layers):
            if base is None:
                device_pool.k_buffers[layer].index_copy_(0, device_slots, stage[0, :, layer])
                device_pool.v_buffers[layer].index_copy_(0, device_slots, stage[1, :, layer])
            if on_layer is not None:
                on_layer(layer)

    def close(self) -> None:
        """Release the host buffer (unregisters host-registered memory); idempotent."""
        self.allocation.release()
        self.kv_buffer = torch.empty(0, dtype=self.dtype)
