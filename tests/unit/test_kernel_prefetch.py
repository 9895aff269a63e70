"""The software prefetches the CPU kernels' speed depends on are in the built code.

A prefetch changes no result, so no numeric test notices when one goes missing, and one
did: GCC deleted amx_rows' loop of ``_mm_prefetch`` calls as a loop without effect, and
the change measured as "no gain" until the disassembly showed no prefetch at all
(vec_math.h's prefetch_lines now writes them as inline asm). These tests read the built
extension's disassembly (``objdump``, from binutils beside the compiler that built it)
and fail where a kernel that should ask for its next rows does not.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache

import pytest

from engine.layers import quant_cpu

pytestmark = pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump here")

FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")


@cache
def disassembly() -> dict[str, list[str]]:
    """Instruction mnemonics per (demangled) function of the built quant kernel."""
    module = quant_cpu.quant_kernel()
    if module is None:
        pytest.skip("the packed-weight kernel is not built here")
    text = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", module.__file__],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    functions: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = FUNCTION.match(line)
        if match:
            name = match.group(1)
            current = None if name.endswith("@plt") else functions.setdefault(name, [])
        elif current is not None and "\t" in line:
            current.append(line.split("\t")[-1].split(" ")[0])
    return functions


def mnemonics(prefix: str) -> list[str]:
    """The instructions of the one function whose name starts with ``prefix``."""
    found = [name for name in disassembly() if name.startswith(prefix)]
    assert len(found) == 1, f"{prefix!r}: {found}"
    return disassembly()[found[0]]


def amx_built() -> bool:
    module = quant_cpu.quant_kernel()
    return module is not None and bool(module.AMX)


@pytest.mark.skipif(not amx_built(), reason="no AMX path on this CPU")
def test_bf16_tiles_ask_for_the_next_chunk() -> None:
    # amx_rows<30> (bf16 weights, tile-loaded where they lie): Ahead, into L2.
    code = mnemonics("void hiserve_quant::amx_rows<30>(")
    assert "tdpbf16ps" in code
    assert "prefetcht1" in code


@pytest.mark.skipif(not amx_built(), reason="no AMX path on this CPU")
@pytest.mark.parametrize("qtype", [2, 3, 8, 12])  # Q4_0, Q4_1, Q8_0, Q4_K
def test_packed_rows_ask_for_the_next_chunk(qtype: int) -> None:
    # pack_rows<Q> (each block unpacked into the tiles' rows): the row a chunk ahead.
    names = [
        name
        for name in disassembly()
        if name.startswith(f"void hiserve_quant::pack_rows<{qtype}>(")
        or name.startswith(f"void hiserve_quant::amx_rows<{qtype}>(")
    ]
    assert names
    assert any("prefetcht0" in disassembly()[name] for name in names)


@pytest.mark.parametrize(
    "prefix",
    [
        "void hiserve_quant::rows_in_registers<",  # the decode GEMV: rows streamed once a step
        "void hiserve_paged::(anonymous namespace)::attend_part<",  # K/V rows by slot
    ],
)
def test_streaming_kernels_ask_for_rows_ahead(prefix: str) -> None:
    found = {name: code for name, code in disassembly().items() if name.startswith(prefix)}
    assert found, f"no {prefix!r} in the build (inlined into its caller?)"
    missing = [
        name for name, code in found.items() if not any(m.startswith("prefetch") for m in code)
    ]
    assert not missing
