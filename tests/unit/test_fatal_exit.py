"""After a fatal engine error the server process ends within a deadline, also when a
thread never returns (a forward blocked in a collective with a dead rank that no abort
releases): ``arm_exit_deadline``, which ``python -m server`` arms on a fatal error."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HUNG = """
import threading
from server.__main__ import arm_exit_deadline

def collective_with_a_dead_peer():
    threading.Event().wait()

threading.Thread(target=collective_with_a_dead_peer, name="hiserve-engine").start()
arm_exit_deadline(1.0)
print("armed", flush=True)
threading.Event().wait()  # the main thread waits for the engine thread, forever
"""


def test_a_hung_process_exits_with_status_1_and_says_where_it_hung() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HUNG],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "armed"  # imports done: the clock runs
        armed = time.monotonic()
        code = proc.wait(timeout=60)
        waited = time.monotonic() - armed
    finally:
        proc.kill()
        _, stderr = proc.communicate()
    assert code == 1
    assert waited < 30, waited
    assert "Timeout" in stderr and "collective_with_a_dead_peer" in stderr, stderr
