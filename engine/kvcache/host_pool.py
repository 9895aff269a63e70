"""HiCache host tier (L2): host KV buffers, a page-granular free list, device<->host copies."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.host_alloc import alloc_host, host_alloc_method, pinned_size
from engine.host_memory import check_host_memory
from engine.kvcache import host_copy
from engine.kvcache.device_pool import DeviceKVPool
from engine.platform import DeviceSpec

HOST_LAYOUTS = ("layer_first", "page_first")


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
        method = host_alloc_method(device, alloc_method)
        # NOTE: checked at the size really taken: pin_memory pins a power of two.
        check_host_memory(
            pinned_size(method, self.nbytes),
            "the HiCache host KV pool",
            "--hicache-size or --hicache-ratio",
        )
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
        self._scratch: torch.Tensor | None = None  # reused by CPU copies; see _cpu_scratch

    # ------------------------------------------------------------ accounting

    @property
    def method(self) -> str:
        return self.allocation.method

    @property
    def pinned(self) -> bool:
        return self.allocation.pinned

    @property
    def pinned_nbytes(self) -> int:
        """Host bytes held pinned (the power-of-two block for pin_memory)."""
        return self.allocation.pinned_nbytes

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
        host_slots = host_slots.reshape(-1)
        if host_slots.device.type != "cpu":  # host slot ids live on the CPU
            host_slots = host_slots.cpu()
        return host_slots.to(torch.int64)

    def _cpu_scratch(self) -> torch.Tensor:
        """Bytes for one CPU copy piece, allocated on first use and then reused."""
        nbytes = host_copy.piece_tokens(self) * self.bytes_per_token
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch

    def _staged(self, device_pool: DeviceKVPool) -> bool:
        return device_pool.device.type != "cpu" or self._force_staged

    def _chunks(self, n: int, bytes_per_token: int) -> list[tuple[int, int]]:
        """Pieces of at most one staging buffer (whole pages)."""
        step = max(self.page_size, host_copy.STAGE_BYTES // max(bytes_per_token, 1))
        return host_copy.pieces(n, step)

    def backup(
        self,
        device_pool: DeviceKVPool,
        device_slots: torch.Tensor,
        host_slots: torch.Tensor,
        non_blocking: bool = False,
    ) -> list[Callable[[], None]]:
        """Copy K/V of ``device_slots`` (all layers) into ``host_slots``. Returns what must
        run once the issued copies are done (CPU scatters of fragmented pieces)."""
        host_slots = self._check(device_pool, host_slots, device_slots)
        if host_slots.numel() == 0:
            return []
        device_slots = device_slots.reshape(-1).to(torch.int64)
        if not self._staged(device_pool):
            host_copy.backup_cpu(self, device_pool, device_slots, host_slots, self._cpu_scratch())
            return []
        device_slots = device_slots.to(device_pool.device, non_blocking=True)
        finishers = []
        for start, end in self._chunks(host_slots.numel(), self.bytes_per_token):
            finish = host_copy.backup_staged(
                self, device_pool, device_slots[start:end], host_slots[start:end], non_blocking
            )
            if finish is not None:
                finishers.append(finish)
        return finishers

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
        layers = list(range(self.num_layers))
        self._load(device_pool, host_slots, device_slots, layers, non_blocking, on_layer)

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
        n = host_slots.numel()
        if n == 0 or not self._staged(device_pool):
            if n:
                host_copy.load_cpu(
                    self, device_pool, host_slots, device_slots, layers, self._cpu_scratch()
                )
            for layer in layers:
                notify(layer)
            return
        device_slots = device_slots.to(device_pool.device, non_blocking=True)
        # page_first: one DMA per host run carries every layer, so one group of all
        # layers; layer_first: layer by layer, so compute can start on the first ones.
        all_at_once = self.layout == "page_first" and len(layers) == self.num_layers
        groups = [layers] if all_at_once else [[layer] for layer in layers]
        for group in groups:
            group_bytes = self.bytes_per_token * len(group) // self.num_layers
            for start, end in self._chunks(n, group_bytes):
                host_copy.load_staged(
                    self,
                    device_pool,
                    host_slots[start:end],
                    device_slots[start:end],
                    group,
                    non_blocking,
                )
            for layer in group:
                notify(layer)

    @property
    def page_nbytes(self) -> int:
        return self.page_size * self.bytes_per_token

    def page_pieces(self, page: int) -> list[torch.Tensor]:
        """The contiguous views holding host page ``page`` (what the L3 store moves):
        K then V for page_first, K and V of every layer for layer_first."""
        rows = slice(page * self.page_size, (page + 1) * self.page_size)
        if self.layout == "page_first":
            return [self.kv_buffer[0, rows], self.kv_buffer[1, rows]]  # [P, L, H, D] each
        return [
            self.kv_buffer[kv, layer, rows] for kv in (0, 1) for layer in range(self.num_layers)
        ]

    def close(self) -> None:
        """Release the host buffer (unregisters host-registered memory); idempotent."""
        self.allocation.release()
        self._scratch = None
        self.kv_buffer = torch.empty(0, dtype=self.dtype)
