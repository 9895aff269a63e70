#!/usr/bin/env bash
# One short device session's checks in one command, most important first:
#
#     bash tests/gpu/session.sh            (logs to $OUT, or to a new temporary folder)
#
# 1. the device check (every GPU test, and its report: host-tier copies, graphs and the
#    overlapped loop's inter-token latency at batch 1 and 32);
# 2. issue 27's goal figures (tests/gpu/kernel_goals.py);
# 3. issue 28's host share of a batch-64 step through the overlapped loop
#    (tests/gpu/profile_decode.py --overlap).
#
# Each part runs under its own time limit (under 9.5 minutes in all, inside one device
# call's 10) and writes its whole log to $OUT as it goes, so a part that runs over leaves
# the others' results; the tail of each log is printed too. Uses the machine's python3
# and torch, like the device check. Before spending device time on it, the CPU dry runs
# (`TRITON_INTERPRET=1 python tests/gpu/kernel_goals.py --dry-run`, `python
# tests/gpu/profile_decode.py --device cpu --layers 1 --skip-hf`) show that each script
# still goes through.
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1  # a part killed at its limit still leaves what it printed
mkdir -p "$OUT"
echo "logs in $OUT; $(date -u '+%Y-%m-%d %H:%M UTC')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

part() {  # part NAME SECONDS COMMAND...: run it under a limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - started)) s (limit $limit s; 124: it ran over)"
    tail -n "${TAIL_LINES:-45}" "$OUT/$name.log"
    return $rc
}

# Its figures stay in $OUT/device_check as each is measured (its JUnit XML at the end).
export HISERVE_DEVICE_CHECK_DIR="$OUT/device_check"
part device_check 230 python3 tests/gpu/device_check.py
[ $? -eq 3 ] && exit 3  # no CUDA device: the device check said why
part kernel_goals 200 python3 tests/gpu/kernel_goals.py
# It builds a 1.2B-parameter model first (tens of seconds); the plain loop's profile,
# for comparison, is a second call's work where time is left:
#     python3 tests/gpu/profile_decode.py --skip-hf --out "$OUT/plain"
part profile_overlapped 90 python3 tests/gpu/profile_decode.py --overlap --skip-hf --out "$OUT/overlapped"
