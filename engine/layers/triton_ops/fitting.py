"""Launch options that fit the device: a kernel's block sizes and pipeline depth chosen
from a list, best first, by whether the compiled kernel loads on this device.

A Triton kernel's shared memory is known only once it is compiled for the device, and
the limit differs by an order of magnitude between the GPUs hiserve runs on (227 KiB a
block on an H100, 99 KiB on an L40S or RTX 4090, 64 KiB on an MI300X). Triton refuses a
kernel that needs more with ``OutOfResources`` as it loads it, before anything runs, so
the next, smaller option can be launched in its place. The choice is remembered per
launch key (the constexprs that decide a kernel's size: dtype, head size, ...), so the
refused options cost one compile at the first launch, which the engine makes at load
(triton_attention.unfit_reason) or in its start-up warm-up, before any graph is captured. ``python -m bench.micro.kernel_resources``
shows what each target is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import triton

logger = logging.getLogger(__name__)

Option = TypeVar("Option")

_chosen: dict[Hashable, int] = {}


class NoFitError(RuntimeError):
    """No launch option of a kernel fits the device. ``reason``: which, and why each was
    refused; the message adds what the operator can start the server with instead."""

    def __init__(self, key: Hashable, refused: list[str], advice: str) -> None:
        self.reason = f"no launch option of {key} fits this device ({'; '.join(refused)})"
        super().__init__(f"{self.reason}; {advice}")


def launch_fitting(
    key: Hashable, options: Sequence[Option], launch: Callable[[Option], None], advice: str
) -> Option:
    """``launch(option)`` with the first of ``options`` (from the one chosen for ``key``
    before) whose kernel the device can load; returns it. Raises when none fits, with
    ``advice``: what the operator can start the server with instead."""
    first = _chosen.get(key, 0)
    refused: list[str] = []
    for index in range(first, len(options)):
        try:
            launch(options[index])
        except triton.OutOfResources as exc:
            refused.append(f"{options[index]}: {exc}")
            continue
        if refused:
            logger.info(
                "%s: %s does not fit this device, using %s", key, refused[0], options[index]
            )
        _chosen[key] = index
        return options[index]
    raise NoFitError(key, refused, advice)


def pipeline(stages: int | None) -> dict[str, int]:
    """A launch's ``num_stages`` option: Triton's default where None."""
    return {} if stages is None else {"num_stages": stages}


def taken() -> dict[Hashable, int]:
    """Each launch key's chosen option (0: the first, best one)."""
    return dict(_chosen)


def forget() -> None:
    """Drop every remembered choice (the next launches start from the best option)."""
    _chosen.clear()
