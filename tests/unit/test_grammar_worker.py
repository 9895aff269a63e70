"""The compile worker process: xgrammar without torch and transformers, the same grammars."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from engine.grammar import build_tokenizer_info
from engine.grammar_pool import CompilePool
from engine.grammar_spec import GrammarSpec
from engine.grammar_worker import import_xgrammar

SPECS = [
    GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        "response_format",
    ),
    GrammarSpec.regex(r"(yes|no|maybe)[0-9]{1,3}", "guided_regex"),
    GrammarSpec.choice(["Paris", "Rome", "Berlin"], "guided_choice"),
    GrammarSpec.ebnf('root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+', "guided_grammar"),
]


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_fresh_process_loads_xgrammar_without_torch() -> None:
    out = _run(
        "import sys\n"
        "from engine.grammar_worker import import_xgrammar\n"
        "xgr, how = import_xgrammar()\n"
        "info = xgr.TokenizerInfo(['a', 'b', '<eos>'], xgr.VocabType.RAW, stop_token_ids=[2])\n"
        "xgr.GrammarCompiler(info, max_threads=1).compile_regex('a+b')\n"
        "print(how, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    assert out == "slim False False"


def test_xgrammar_loads_whole_when_the_slim_load_fails() -> None:
    # A future xgrammar that uses torch while it loads must still compile, only heavier.
    out = _run(
        "import sys\n"
        "from engine import grammar_worker\n"
        "placeholder = grammar_worker._placeholder_module\n"
        "def broken(name):\n"  # fails inside xgrammar's own import, after its binding
        "    module = placeholder(name)\n"
        "    def attr(key):\n"
        "        raise RuntimeError('uses torch at load')\n"
        "    module.__getattr__ = attr\n"
        "    return module\n"
        "grammar_worker._placeholder_module = broken\n"
        "xgr, how = grammar_worker.import_xgrammar()\n"
        "info = xgr.TokenizerInfo(['a', 'b', '<eos>'], xgr.VocabType.RAW, stop_token_ids=[2])\n"
        "xgr.GrammarCompiler(info, max_threads=1).compile_regex('a+b')\n"
        "print(how, type(sys.modules['torch'].zeros(1)).__name__)\n"
    )
    assert out == "full Tensor"


def test_a_process_that_has_torch_already_loads_xgrammar_as_is() -> None:
    xgrammar, how = import_xgrammar()  # pytest's process has torch
    assert (xgrammar, how) == (xgr, "full")


@pytest.fixture(scope="module")
def real_info(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    return build_tokenizer_info(tokenizer, 49152, [0, 2])


@pytest.fixture(scope="module")
def real_pool(real_info: Any) -> Iterator[CompilePool]:
    pool = CompilePool(real_info, workers=1, timeout_s=120.0)
    yield pool
    pool.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_live_worker_has_no_torch_mapped(real_pool: CompilePool) -> None:
    assert real_pool.wait_started(120.0)
    (child,) = real_pool._children
    assert child is not None
    maps = Path(f"/proc/{child.pid}/maps").read_text()
    assert "libxgrammar" in maps or "xgrammar" in maps
    assert "libtorch" not in maps


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_a_worker_compiles_what_xgrammar_compiles_in_process(
    spec: GrammarSpec, real_pool: CompilePool, real_info: Any
) -> None:
    compiler = xgr.GrammarCompiler(real_info, max_threads=1, cache_enabled=False)
    if spec.kind == "json_schema":
        local = compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
    elif spec.kind == "regex":
        local = compiler.compile_regex(spec.value)
    else:
        local = compiler.compile_grammar(spec.as_ebnf())
    from_worker = real_pool.submit(spec).result(timeout=120)
    assert json.loads(from_worker.serialize_json()) == json.loads(local.serialize_json())
