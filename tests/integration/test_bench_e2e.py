"""The bench against the real server on the default model (CPU, tiny workloads).

- A short multiturn run reports cached/prompt token totals equal to the deltas of the
  server's own ``/metrics`` counters (device and host tiers separately).
- ``compare`` of radix-only vs HiCache, with a device pool about a third of the working
  set, shows HiCache's hit rate clearly higher.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.compare import LaunchedServer, LaunchOptions
from bench.workloads import WorkloadConfig, generate

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# 4 clients x 3 rounds of 150-token user turns and 40-token synthetic assistant turns:
# the longest prompt is 150 + 2 * (40 + 150) = 530 tokens; the working set ~2.1k tokens.
CONFIG = WorkloadConfig(workload="multiturn", seed=1, num_clients=4, num_rounds=3,
                        user_turn_len=150, assistant_turn_len=40, output_len=4)  # fmt: skip
WORKLOAD_ARGS = ["--workload", "multiturn", "--seed", "1", "--num-clients", "4",
                 "--num-rounds", "3", "--user-turn-len", "150", "--assistant-turn-len", "40",
                 "--output-len", "4", "--no-progress"]  # fmt: skip
KV_CACHE_TOKENS = 720  # about a third of the working set; one 534-token request fits
HICACHE_RATIO = 5.0  # the host tier holds the whole working set


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (prometheus text)."""
    total, found = 0.0, False
    pattern = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
    for line in text.splitlines():
        match = pattern.match(line)
        if match is None or match.group(1) != name:
            continue
        sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
            found = True
    assert found, f"{name}{labels} not in /metrics"
    return total


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        "prompt": _metric(text, "hiserve:prompt_tokens_total"),
        "device": _metric(text, "hiserve:cached_prompt_tokens_total", source="device"),
        "host": _metric(text, "hiserve:cached_prompt_tokens_total", source="host"),
    }


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "bench", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # NOTE: SIGINT, not a kill: the servers bench launched run in their own sessions,
        # and only bench's own clean-up (on KeyboardInterrupt) stops them.
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_multiturn_hit_rate_matches_server_metrics(tmp_path: Path) -> None:
    launch = LaunchOptions(kv_cache_tokens=KV_CACHE_TOKENS, hicache_ratio=HICACHE_RATIO)
    out = tmp_path / "run.json"
    with LaunchedServer("hicache", launch) as server:
        before = _counters(server.url)
        proc = _bench("run", "--base-url", server.url, *WORKLOAD_ARGS,
                      "--max-concurrency", "2", "--json", str(out))  # fmt: skip
        after = _counters(server.url)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 12 and report["failed"] == 0
    delta = {key: after[key] - before[key] for key in before}
    workload = generate(CONFIG)
    sent = sum(len(r.prompt) for r in workload.requests)
    assert report["total_prompt_tokens"] == delta["prompt"] == sent
    assert report["total_cached_tokens_device"] == delta["device"]
    assert report["total_cached_tokens_host"] == delta["host"]
    assert report["total_cached_tokens"] == delta["device"] + delta["host"]
    assert report["cache_hit_rate"] == pytest.approx(
        (delta["device"] + delta["host"]) / delta["prompt"]
    )
    assert report["ideal_hit_rate"] == pytest.approx(workload.ideal_hit_rate())
    assert 0 < report["cache_hit_rate"] <= report["ideal_hit_rate"] + 1e-9
    assert report["total_output_tokens"] == 12 * 4


def test_compare_radix_vs_hicache(tmp_path: Path) -> None:
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    proc = _bench("compare", "--target", "radix", "--target", "hicache",
                  "--kv-cache-tokens", str(KV_CACHE_TOKENS),
                  "--hicache-ratio", str(HICACHE_RATIO),
                  *WORKLOAD_ARGS, "--max-concurrency", "1",
                  "--json", str(out), "--plot", str(png))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    radix, hicache = json.loads(out.read_text())["targets"]
    assert radix["label"] == "radix" and hicache["label"] == "hicache"
    assert radix["completed"] == hicache["completed"] == 12
    assert radix["ideal_hit_rate"] == pytest.approx(hicache["ideal_hit_rate"])
    # The device pool cannot hold four conversations, so radix-only loses most prefixes
    # between rounds; the host tier keeps them.
    assert hicache["cache_hit_rate"] > radix["cache_hit_rate"] + 0.1
    assert hicache["total_cached_tokens_host"] > 0
    assert hicache["rounds"][2]["cache_hit_rate"] > radix["rounds"][2]["cache_hit_rate"]
    assert png.stat().st_size > 0
    assert "radix" in proc.stdout and "hicache" in proc.stdout
