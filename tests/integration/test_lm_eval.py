"""lm-evaluation-harness end to end: its ``local-completions`` model scores a small local
multiple-choice task and a perplexity (loglikelihood_rolling) task through a live hiserve
server, and every per-item loglikelihood equals its in-process ``hf`` model's on the same
weights (float32, within 1e-4)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.slow

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["hiserve_tiny_mc", "hiserve_tiny_rolling"]
ATOL = 1e-4
# NOTE: every item fits in one window. Past it the harness itself splits a rolling text
# differently for API models (windows one token shorter, room for a generated token)
# than for `hf`, so their sums would differ for reasons of its own, not the server's.
MAX_LENGTH = 128


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task YAMLs with their data files' absolute paths filled in."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for yaml in TASKS_DIR.glob("*.yaml"):
        text = yaml.read_text().replace("DATA_DIR", str(TASKS_DIR))
        (out / yaml.name).write_text(text)
    return out


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Any:
    proc = ServerProcess(
        tmp_path_factory.mktemp("lm_eval_server") / "server.log",
        extra_args=["--model", str(tiny_llama_dir), "--served-model-name", "tiny"],
        api_key=None,
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def per_item(results: dict[str, Any]) -> dict[tuple[str, int], list[Any]]:
    """(task, doc id) -> the model's raw responses: one (loglikelihood, is_greedy) per
    choice for multiple choice, one loglikelihood for a rolling task."""
    table = {}
    for task, samples in results["samples"].items():
        for sample in samples:
            table[task, sample["doc_id"]] = [resp[0] for resp in sample["resps"]]
    return table


def evaluate(model: str, model_args: dict[str, Any], task_dir: Path) -> dict[tuple[str, int], Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=4,
    )
    assert results is not None
    return per_item(results)


def test_local_completions_equal_hf(
    tiny_server: ServerProcess,
    tiny_llama_dir: Path,
    task_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("lm_eval", reason="the `eval` extra is not installed")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    served = evaluate(
        "local-completions",
        {
            "model": "tiny",
            "base_url": tiny_server.base_url + "/v1/completions",
            "tokenizer": str(tiny_llama_dir),
            "tokenizer_backend": "huggingface",
            "max_length": MAX_LENGTH,
            "max_retries": 1,
        },
        task_dir,
    )
    local = evaluate(
        "hf",
        {
            "pretrained": str(tiny_llama_dir),
            "dtype": "float32",
            "device": "cpu",
            "max_length": MAX_LENGTH,
        },
        task_dir,
    )
    assert sorted(served) == sorted(local)
    assert {task for task, _ in served} == set(TASKS)
    for key, ours in served.items():
        theirs = local[key]
        assert len(ours) == len(theirs), key
        for a, b in zip(ours, theirs, strict=True):
            if isinstance(b, tuple | list):  # multiple choice: (loglikelihood, is_greedy)
                assert a[0] == pytest.approx(b[0], abs=ATOL), key
                assert bool(a[1]) == bool(b[1]), key
            else:
                assert a == pytest.approx(b, abs=ATOL), key
