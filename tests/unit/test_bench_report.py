"""The bench CLI against a fake OpenAI-compatible server (tests/unit/fake_openai_server.py):
reports, JSON, plot, bad targets.

The fake server keeps its own log of what it received and what it reported, so the
bench's totals are checked against numbers it did not compute itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.report import format_table, write_json
from bench.workloads import WorkloadConfig, generate
from tests.unit.fake_openai_server import FakeState, serve

REPO = Path(__file__).resolve().parents[2]
STAT_KEYS = {"mean", "p50", "p90", "p99"}
TOP_KEYS = {
    "cache_hit_rate", "ideal_hit_rate", "output_throughput", "request_throughput", "ttft", "itl",
}  # fmt: skip
# `python -m bench ARGS` with SIGINT raising KeyboardInterrupt, whatever was inherited.
WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'bench'; runpy.run_module('bench', run_name='__main__', alter_sys=True)"
)
SMALL = ["--workload", "multiturn", "--num-clients", "3", "--num-rounds", "3",
         "--user-turn-len", "20", "--assistant-turn-len", "5", "--output-len", "4",
         "--system-prompt-len", "6", "--seed", "5"]  # fmt: skip
SMALL_CONFIG = WorkloadConfig(workload="multiturn", num_clients=3, num_rounds=3, user_turn_len=20,
                              assistant_turn_len=5, output_len=4, system_prompt_len=6, seed=5)  # fmt: skip


@pytest.fixture
def fake() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    with serve(state) as url:
        yield url, state


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "bench", *args, "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def _no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    # A launched server's log may be quoted (indented, "  server| ..."); ours never.
    for line in (proc.stderr + proc.stdout).splitlines():
        assert not line.startswith("Traceback"), proc.stderr


def test_itl_is_per_token_when_chunks_carry_several(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    url, state = fake
    state.tokens_per_chunk, state.chunk_delay = 3, 0.03  # 4 tokens: chunks of 1 and 3
    out = tmp_path / "r.json"
    proc = bench("run", "--base-url", url, *SMALL, "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["total_output_tokens"] == 9 * 4  # from the usage, not the 2 chunks
    # one 30 ms gap between the chunks, shared by the second chunk's 3 tokens
    assert 0.008 <= report["itl"]["p50"] <= 0.02


def test_run_report_matches_fake_server_log(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = bench("run", "--base-url", url, *SMALL, "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    _no_traceback(proc)
    report = json.loads(out.read_text())
    assert set(report) >= TOP_KEYS
    assert set(report["ttft"]) == STAT_KEYS and set(report["itl"]) == STAT_KEYS
    assert state.flushes == 1
    # Totals against the fake server's own log.
    assert len(state.log) == report["completed"] == 9
    prompt_tokens = sum(len(e["body"]["prompt"]) for e in state.log)
    cached = sum(e["cached"] for e in state.log)
    assert report["total_prompt_tokens"] == prompt_tokens
    assert report["total_cached_tokens"] == cached
    assert report["cache_hit_rate"] == pytest.approx(cached / prompt_tokens)
    assert report["total_cached_tokens_device"] == sum(min(e["cached"], 5) for e in state.log)
    assert report["cache_miss_reasons"]["never_seen"] == prompt_tokens - cached - 9
    assert report["cache_miss_reasons"]["below_page"] == 9  # one per request
    assert "miss: never seen" in proc.stdout
    assert report["ideal_hit_rate"] == pytest.approx(generate(SMALL_CONFIG).ideal_hit_rate())
    assert report["total_output_tokens"] == 9 * 4
    assert report["output_throughput"] == pytest.approx(36 / report["duration"])
    assert report["request_throughput"] == pytest.approx(9 / report["duration"])
    assert report["itl"]["p50"] >= 0.003  # the fake sleeps 4 ms between chunks
    assert 0 < report["ttft"]["p50"] <= report["ttft"]["p99"]
    assert [r["round"] for r in report["rounds"]] == [0, 1, 2]
    # What went over the wire.
    body = state.log[0]["body"]
    assert body["model"] == "fake-model" and body["stream"] is True
    assert body["ignore_eos"] is True and body["max_tokens"] == 4
    assert body["stream_options"] == {"include_usage": True}
    # A conversation's next round starts only after its previous round finished.
    index = {tuple(r.prompt): (r.conversation, r.round) for r in generate(SMALL_CONFIG).requests}
    ends: dict[tuple[int, int], float] = {}
    for e in state.log:
        ends[index[tuple(e["body"]["prompt"])]] = e["end"]
    for e in state.log:
        conv, rnd = index[tuple(e["body"]["prompt"])]
        if rnd:
            assert e["start"] >= ends[(conv, rnd - 1)]
    assert "Cache hit rate" in proc.stdout and "Round 2 hit rate" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert height > 200 and width > 400


def test_max_concurrency_one_interleaves_rounds(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    proc = bench("--base-url", url, *SMALL, "--max-concurrency", "1")  # `run` implied
    assert proc.returncode == 0, proc.stderr
    index = {tuple(r.prompt): (r.conversation, r.round) for r in generate(SMALL_CONFIG).requests}
    order = [index[tuple(e["body"]["prompt"])] for e in state.log]
    assert order == [(c, r) for r in range(3) for c in range(3)]


def test_poisson_arrivals_shared_prefix(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    out = tmp_path / "r.json"
    proc = bench("run", "--base-url", url, "--workload", "shared-prefix", "--num-groups", "2",
                 "--prompts-per-group", "4", "--shared-prefix-len", "30", "--suffix-len", "5",
                 "--output-len", "2", "--request-rate", "10", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    config = WorkloadConfig(workload="shared-prefix", num_groups=2, prompts_per_group=4,
                            shared_prefix_len=30, suffix_len=5, output_len=2)  # fmt: skip
    assert report["ideal_hit_rate"] == pytest.approx(generate(config).ideal_hit_rate())
    assert report["request_rate"] == 10 and report["completed"] == 8
    # 7 exponential gaps at 10/s average 0.7 s; unpaced, the 8 requests start together.
    starts = sorted(e["start"] for e in state.log)
    assert starts[-1] - starts[0] > 0.2


def test_unauthorized(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    state.api_key = "secret"
    out = tmp_path / "r.json"
    proc = bench("run", "--base-url", url, *SMALL, "--json", str(out))
    assert proc.returncode == 1
    _no_traceback(proc)
    assert "401" in proc.stderr and "--api-key" in proc.stderr
    report = json.loads(out.read_text())
    assert report["partial"] is True and report["completed"] == 0 and report["aborted"]
    ok = bench("run", "--base-url", url, *SMALL, "--api-key", "secret")
    assert ok.returncode == 0, ok.stderr


def test_overloaded_gives_up_after_retries(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    state.mode = "overloaded"
    out = tmp_path / "r.json"
    args = ["--max-retries", "2", "--retry-backoff", "0.01", "--json", str(out)]
    proc = bench("run", "--base-url", url, *SMALL, *args)
    assert proc.returncode == 1
    _no_traceback(proc)
    assert "503" in proc.stderr and "overloaded" in proc.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == 9 and report["completed"] == 0 and report["partial"] is True
    assert report["cache_hit_rate"] is None and report["ttft"]["mean"] is None
    assert state.attempts == 9 * 3  # first try + 2 retries each


def test_503_burst_is_retried(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    state.reject_first = 3
    out = tmp_path / "r.json"
    proc = bench("run", "--base-url", url, *SMALL, "--max-concurrency", "1",
                 "--retry-backoff", "0.01", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 9 and report["partial"] is False
    assert report["requests"][0]["retries"] == 3


def test_dropped_connections_keep_partial_results(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    url, state = fake
    state.mode = "drop_odd"
    out = tmp_path / "r.json"
    proc = bench("run", "--base-url", url, *SMALL, "--json", str(out), "--max-concurrency", "1")
    assert proc.returncode == 1
    _no_traceback(proc)
    assert "mid-response" in proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 5 and report["failed"] == 4 and report["partial"] is True
    assert report["total_prompt_tokens"] == sum(
        len(e["body"]["prompt"]) for e in state.log if e["arrival"] % 2 == 0
    )


def test_connection_refused(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    # Bound but never listening: connections are refused, and the port stays ours for the
    # whole test (a closed one could be taken by another process meanwhile).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        proc = bench("run", "--base-url", f"http://127.0.0.1:{port}", *SMALL, "--json", str(out))
    assert proc.returncode == 1
    _no_traceback(proc)
    assert "cannot reach" in proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 0 and report["not_sent"] == 9 and report["partial"] is True


def test_bad_arguments() -> None:
    proc = bench("run", "--base-url", "localhost:8000")
    assert proc.returncode == 2 and "http://" in proc.stderr
    _no_traceback(proc)
    proc = bench("compare", "--target", "bogus")
    assert proc.returncode == 2 and "bogus" in proc.stderr
    _no_traceback(proc)


def test_interrupt_writes_partial_results(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    state.mode = "slow"  # 0.3 s per token: 1.2 s per request
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # NOTE: a process started in the background by a shell without job control (nohup,
    # `cmd &` in a script, some CI runners) inherits SIGINT ignored, and so would the
    # tool; it is started with Python's own Ctrl-C handler, as an interactive run has it.
    cmd = [sys.executable, "-c", WITH_CTRL_C, "run", "--base-url", url, *SMALL,
           "--max-concurrency", "1", "--json", str(out), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 30
    # The second request starts only once the client has finished the first (concurrency
    # 1). Waiting for the server to end the first is not enough: the client may not have
    # read its last chunk yet when the interrupt lands, and then nothing has completed.
    while len(state.log) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    report = json.loads(out.read_text())
    assert report["partial"] is True and 1 <= report["completed"] < 9


def test_compare_urls_and_failed_launch(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, _state = fake
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    proc = bench("compare", "--target", f"first={url}", "--target", f"second={url}/v1",
                 "--target", "radix", "--server-arg=--no-such-flag", "--startup-timeout", "60",
                 *SMALL, "--json", str(out), "--plot", str(png), timeout=120)  # fmt: skip
    # The launched `radix` server cannot start (unknown flag): that column fails, the
    # URL columns still run, and the exit status says something went wrong.
    assert proc.returncode == 1
    _no_traceback(proc)
    assert "radix" in proc.stderr and "before it was ready" in proc.stderr
    payload = json.loads(out.read_text())
    labels = [t["label"] for t in payload["targets"]]
    assert labels == ["first", "second", "radix"]
    first, second, radix = payload["targets"]
    assert first["completed"] == second["completed"] == 9
    assert first["cache_hit_rate"] == pytest.approx(second["cache_hit_rate"])
    assert radix["completed"] == 0 and radix["aborted"]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("Metric"))
    assert header.split() == ["Metric", "first", "second", "radix"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_json_has_no_infinities(tmp_path: Path) -> None:
    path = tmp_path / "x" / "y.json"
    write_json(path, {"request_rate": float("inf"), "nested": [float("nan"), 1.0]})
    assert json.loads(path.read_text()) == {"request_rate": None, "nested": [None, 1.0]}


def test_table_formats_missing_values() -> None:
    report: dict[str, Any] = {
        "label": "x", "base_url": "http://h", "completed": 0, "failed": 2, "not_sent": 1,
        "duration": 0.0, "request_throughput": None, "input_throughput": None,
        "output_throughput": None, "cache_hit_rate": None, "device_hit_rate": None,
        "host_hit_rate": None, "ideal_hit_rate": None, "rounds": [],
        "ttft": dict.fromkeys(STAT_KEYS), "itl": dict.fromkeys(STAT_KEYS),
        "e2e_latency": dict.fromkeys(STAT_KEYS), "workload": {"workload": "random"},
    }  # fmt: skip
    table = format_table([report])
    assert "0 / 2 / 1" in table and "TTFT p99 (ms)" in table
