"""The Triton kernels compiled for GPU targets on a machine with no GPU: for each kernel's
launches at the shapes of the model families the engine serves (a family's launches of
a kernel it does not use included, for coverage), whether it compiles, and its
registers, spilled bytes and shared memory against the target's limit.

    python -m bench.micro.kernel_resources [--target sm90 gfx942 ...] [--json]
                                           [--shared-limit BYTES]

Each launch goes through the kernels' own Python wrappers (paged_attention, the fused
ops, fused_experts) with tensors on the ``meta`` device, so the block sizes, constexprs
and argument types are the ones the engine picks on a GPU; Triton's launch is turned into
a compile for the chosen target (``compile_only``). The CUDA targets go down to a cubin
(Triton's own ptxas), the ROCm ones to a code object. A kernel that compiles here can
still be wrong or slow on the device; one that does not compile here, or asks for more
shared memory than the target has, would fail there at its first launch. MUSA has no
Triton compiler on PyPI, so it is not among the targets.

Needs the ``kernels`` extra (triton) and a process with ``TRITON_INTERPRET`` unset: the
interpreter replaces the kernels as their modules are imported. Written against the
Triton the set-up installs (3.9); the launch hook reaches into Triton's runtime.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

# Most shared memory one program may use (the opt-in limit per block), bytes.
TARGETS: dict[str, tuple[str, int | str, int, int]] = {
    # name: (backend, arch, warp size, shared memory limit)
    "sm80": ("cuda", 80, 32, 166_912),  # A100
    "sm89": ("cuda", 89, 32, 101_376),  # L4, L40S, RTX 4090
    "sm90": ("cuda", 90, 32, 232_448),  # H100, H200
    "gfx942": ("hip", "gfx942", 64, 65_536),  # MI300X
}
DEFAULT_TARGETS = ("sm90", "sm89", "gfx942")


@dataclass(frozen=True)
class ModelShape:
    """The attention, MLP and expert widths of one model family (public configs)."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    window: int | None = None
    softcap: float | None = None
    experts: int = 0
    top_k: int = 0


SHAPES = (
    ModelShape("SmolLM2-135M", 9, 3, 64, 576, 1536),
    ModelShape("TinyLlama-1.1B", 32, 4, 64, 2048, 5632),
    ModelShape("Llama-3-8B", 32, 8, 128, 4096, 14336),
    ModelShape("Qwen3-0.6B", 16, 8, 128, 1024, 3072),
    ModelShape("Gemma-2-2B", 8, 4, 256, 2304, 9216, window=4096, softcap=50.0),
    ModelShape("Mixtral-8x7B", 32, 8, 128, 4096, 14336, experts=8, top_k=2),
    ModelShape("Qwen3-30B-A3B", 32, 4, 128, 2048, 768, experts=128, top_k=8),
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class Launch:
    """One compiled launch and what it costs the target."""

    kernel: str
    shape: str
    dtype: str
    variant: str
    compiled: bool = False
    error: str = ""
    refused: int = 0  # larger options refused before this one (shared memory)
    registers: int = 0
    spilled_bytes: int = 0
    shared_bytes: int = 0
    shared_limit: int = 0
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.compiled and self.shared_bytes <= self.shared_limit


class _CompileDriver:
    """The little of Triton's driver a launch asks for before compiling."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")


@dataclass
class Compiled:
    """What ``compile_only`` saw: each kernel a device would load, with how many larger
    options of its launch it would have refused before it for want of shared memory (as
    a real launch does, before running)."""

    kernels: list[tuple[Any, int]]
    pending: int = 0  # refusals since the last kernel loaded


@contextlib.contextmanager
def compile_only(target: Any, shared_limit: int | None = None) -> Iterator[Compiled]:
    """Inside: every ``kernel[grid](...)`` compiles for ``target`` and launches nothing.
    A kernel needing more shared memory than ``shared_limit`` raises ``OutOfResources``
    as Triton does when it loads one, so launches pick options that fit
    (engine/layers/triton_ops/fitting.py)."""
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from engine.layers.triton_ops import fitting

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_only needs TRITON_INTERPRET unset (the interpreter is on)")
    compiled = Compiled([])
    touched: list[Any] = []
    launch = JITFunction.run

    def compile_instead(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        touched.append(self)
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        if shared_limit is not None and kernel.metadata.shared > shared_limit:
            compiled.pending += 1
            raise triton.OutOfResources(kernel.metadata.shared, shared_limit, "shared memory")
        compiled.kernels.append((kernel, compiled.pending))
        compiled.pending = 0
        return kernel

    previous = driver._active  # None until a real driver was asked for
    driver.set_active(_CompileDriver(target))
    JITFunction.run = compile_instead  # type: ignore[method-assign]
    fitting.forget()  # choices made for another target
    try:
        yield compiled
    finally:
        JITFunction.run = launch  # type: ignore[method-assign]
        driver._active = previous
        fitting.forget()
        for fn in touched:  # their binders hold this target
            fn.device_caches.clear()


def _cuda_usage(cubin: bytes) -> tuple[int, int]:
    """Registers and spilled (local memory) bytes per thread, read by cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return int(regs.group(1)) if regs else 0, int(local.group(1)) if local else 0


def _hip_usage(amdgcn: str) -> tuple[int, int]:
    """Vector registers and spilled registers (times 4 bytes), from the code object's
    metadata in the assembly."""
    vgprs = re.search(r"\.vgpr_count:\s+(\d+)", amdgcn)
    spills = sum(int(n) for n in re.findall(r"\.[sv]gpr_spill_count:\s+(\d+)", amdgcn))
    return int(vgprs.group(1)) if vgprs else 0, 4 * spills


def usage(kernel: Any) -> tuple[int, int]:
    """(registers, spilled bytes) of one compiled kernel."""
    if "cubin" in kernel.asm:
        return _cuda_usage(kernel.asm["cubin"])
    return _hip_usage(kernel.asm.get("amdgcn", ""))


# (step, new tokens, sequences) of the launches compiled for each model.
STEPS = (("decode", 64, 64), ("prefill", 2048, 8))


def _launches(
    shape: ModelShape, dtype: torch.dtype, tokens: int, seqs: int, decode: bool
) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(kernel, call) for each launch the engine makes for one model in one step: the
    fused ops and attention, and the experts of an MoE."""
    from engine.layers.triton_ops import fused, fused_moe, paged_attention

    meta = torch.device("meta")

    def empty(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*size, dtype=dt, device=meta)

    long = torch.int64
    heads = shape.q_heads + shape.kv_heads
    slots = empty(4096, shape.kv_heads, shape.head_dim)
    table = empty(64, 8192, dt=torch.int32)
    qkv = empty(tokens, heads + shape.kv_heads, shape.head_dim)
    cos = empty(tokens, 1, shape.head_dim)
    rows, lens = empty(seqs, dt=long), empty(seqs, dt=long)
    x = empty(tokens, shape.hidden)
    yield "add_rms_norm", lambda: fused.add_rms_norm(x, x, x[0], 1e-6)
    if not shape.experts:
        gate_up = empty(tokens, 2 * shape.intermediate)
        yield "silu_mul", lambda: fused.silu_mul(gate_up)
    yield "rotary", lambda: fused.rotary(qkv[:, : shape.q_heads], cos, cos)
    k, v = qkv[:, shape.q_heads : heads], qkv[:, heads:]
    yield "store_kv", lambda: fused.store_kv(k, v, empty(tokens, dt=long), slots, slots)
    yield (
        "rotary_store",
        lambda: fused.rotary_store(qkv[:, :heads], v, cos, cos, shape.q_heads, lens, slots, slots),
    )
    q = empty(tokens, shape.q_heads, shape.head_dim)
    extend: dict[str, Any] = {}
    if not decode:
        extend = {"q_starts": lens, "q_lens": lens, "work": empty(2, 64, dt=long)}
    yield (
        "paged_attention",
        lambda: paged_attention.paged_attention(
            q, slots, slots, table, rows, lens, window=shape.window, softcap=shape.softcap, **extend
        ),
    )
    if shape.experts:
        w13 = empty(shape.experts, 2 * shape.intermediate, shape.hidden)
        w2 = empty(shape.experts, shape.hidden, shape.intermediate)
        chosen, weights = empty(tokens, shape.top_k, dt=long), empty(tokens, shape.top_k)
        yield "fused_experts", lambda: fused_moe.fused_experts(x, w13, w2, chosen, weights)


def _name(kernel: Any) -> str:
    return str(getattr(kernel, "name", None) or kernel.metadata.name)


def _rows(compiled: Compiled, seen: set[str], call: Callable[[], Any], row: Launch) -> list[Launch]:
    """The rows of one launch: one per kernel it compiled that no earlier launch had, or
    ``row`` with the error where it did not compile."""
    done = len(compiled.kernels)
    start = time.perf_counter()
    try:
        call()
    except Exception as exc:  # a compile error is this row's result
        row.error = f"{type(exc).__name__}: {str(exc)[:400]}"
        return [row]
    seconds = time.perf_counter() - start
    rows = []
    for kernel, refused in compiled.kernels[done:]:
        if kernel.hash in seen:  # the same specialization as an earlier launch
            continue
        seen.add(kernel.hash)
        registers, spilled = usage(kernel)
        rows.append(
            replace(
                row,
                kernel=_name(kernel),
                compiled=True,
                registers=registers,
                spilled_bytes=spilled,
                shared_bytes=int(kernel.metadata.shared),
                seconds=seconds,
                refused=refused,
            )
        )
    return rows


def compile_all(
    target_name: str, shapes: tuple[ModelShape, ...] = SHAPES, shared_limit: int | None = None
) -> list[Launch]:
    """Every launch of every shape, dtype and step compiled for one target; a launch that
    calls two kernels (attention's split merge, the experts' two matmuls) gives a row
    each. ``shared_limit``: bytes of shared memory a block may use, in place of the
    target's (how the launches would fall back on a device with less)."""
    from triton.backends.compiler import GPUTarget

    backend, arch, warp, target_limit = TARGETS[target_name]
    if shared_limit is None:
        shared_limit = target_limit
    results: list[Launch] = []
    seen: set[str] = set()
    with compile_only(GPUTarget(backend, arch, warp), shared_limit) as compiled:
        for shape, dtype, (step, tokens, seqs) in itertools.product(shapes, DTYPES, STEPS):
            dtype_name = str(dtype).removeprefix("torch.")
            for name, call in _launches(shape, dtype, tokens, seqs, step == "decode"):
                row = Launch(name, shape.name, dtype_name, step, shared_limit=shared_limit)
                results += _rows(compiled, seen, call, row)
    return results


def _table(target: str, rows: list[Launch]) -> str:
    lines = [
        f"## {target}",
        "",
        "| kernel | model | dtype | step | registers | spilled B | shared B | fits |"
        " smaller options taken |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.compiled:
            lines.append(f"| {r.kernel} | {r.shape} | {r.dtype} | {r.variant} | {r.error} |")
            continue
        fits = "yes" if r.fits else f"no (limit {r.shared_limit})"
        lines.append(
            f"| {r.kernel} | {r.shape} | {r.dtype} | {r.variant} | {r.registers} | "
            f"{r.spilled_bytes} | {r.shared_bytes} | {fits} | {r.refused} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", nargs="+", choices=sorted(TARGETS), default=DEFAULT_TARGETS)
    parser.add_argument("--json", action="store_true", help="one JSON object per target")
    parser.add_argument(
        "--shared-limit",
        type=int,
        help="bytes of shared memory a block may use, in place of each target's limit",
    )
    args = parser.parse_args(argv)
    failed = 0
    for target in args.target:
        start = time.perf_counter()
        rows = compile_all(target, shared_limit=args.shared_limit)
        failed += sum(not r.fits for r in rows)
        if args.json:
            print(json.dumps({"target": target, "launches": [asdict(r) for r in rows]}))
        else:
            print(_table(target, rows))
            print(f"\n{len(rows)} kernels, {time.perf_counter() - start:.0f} s\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
