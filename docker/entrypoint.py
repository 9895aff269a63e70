"""Container entrypoint: check the accelerator, pick the model, then exec the server.

Stdlib only: nothing here may import torch, because ``MUSA_VISIBLE_DEVICES`` (and
``CUDA_VISIBLE_DEVICES``) only take effect when set before torch is first imported.
The device check itself runs ``import torch`` in a child process with a timeout, so
a missing driver or a hung import ends in a clear message within seconds instead of
a traceback or a stalled container.

Environment (all optional):
  HISERVE_DEVICE            auto | cpu | cuda[:N] | hip[:N] | musa[:N] | npu[:N] |
                            xpu[:N] | mps (default auto)
  HISERVE_MODEL             model dir, .gguf file or ``default``; unset or empty: a
                            model mounted at HISERVE_MODEL_MOUNT if there is one, else
                            the default model baked into the image
  HISERVE_MODEL_MOUNT       where a model volume is mounted (default /models)
  HISERVE_PREFLIGHT         1 (default): check, then serve; 0: skip the check;
                            only: check, print the summary and exit
  HISERVE_PREFLIGHT_TIMEOUT seconds the device check may take (default 45)
Every other HISERVE_* variable passes through to the server; empty ones are dropped,
so docker-compose can list every variable with an empty default.

Arguments starting with ``-`` are appended to the server command line; any other
first argument is run as a command instead (``docker run IMAGE bash``).

Exit codes: 2 bad configuration, 3 the requested device is not usable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

from preflight import (
    EXIT_BAD_CONFIG,
    PROBE_TYPE,
    VISIBLE_DEVICES_VAR,
    DeviceSpec,
    PreflightError,
    parse_device,
    pin_visible_device,
    resolve_device,
    visible_devices_warning,
)

DEFAULT_MODEL_MOUNT = "/models"
DEFAULT_PREFLIGHT_TIMEOUT_S = 45.0


def drop_empty_settings(env: MutableMapping[str, str]) -> None:
    """Remove empty HISERVE_* values: compose passes unset variables as ''."""
    for key in [k for k, v in env.items() if k.startswith("HISERVE_") and not v.strip()]:
        del env[key]


def find_models(mount: Path) -> list[Path]:
    """Models at ``mount`` or one level below: directories with config.json, .gguf files."""
    if not mount.is_dir():
        return []
    if (mount / "config.json").is_file():
        return [mount]
    found: list[Path] = []
    for entry in sorted(mount.iterdir()):
        if entry.is_dir() and not (entry / "config.json").is_file():
            found.extend(sorted(entry.glob("*.gguf")))
        elif entry.is_dir() or entry.suffix == ".gguf":
            found.append(entry)
    return found


def choose_model(env: Mapping[str, str]) -> tuple[str, str]:
    """Return (model, why): the explicit setting, the one mounted model, or the default."""
    mount = Path(env.get("HISERVE_MODEL_MOUNT", DEFAULT_MODEL_MOUNT))
    explicit = env.get("HISERVE_MODEL", "").strip()
    if explicit == "default":
        return explicit, "HISERVE_MODEL"
    if explicit:
        if not Path(explicit).exists():
            mounted = ", ".join(str(p) for p in find_models(mount)) or "none"
            raise PreflightError(
                f"HISERVE_MODEL={explicit} does not exist in the container. Mount the model "
                f"directory (compose: HISERVE_MODEL_DIR) and point HISERVE_MODEL at the path "
                f"inside it. Models found under {mount}: {mounted}.",
                EXIT_BAD_CONFIG,
            )
        return explicit, "HISERVE_MODEL"
    models = find_models(mount)
    if len(models) == 1:
        return str(models[0]), f"the one model mounted under {mount}"
    if len(models) > 1:
        names = ", ".join(str(p) for p in models)
        raise PreflightError(
            f"{mount} holds several models ({names}); set HISERVE_MODEL to the one to serve.",
            EXIT_BAD_CONFIG,
        )
    return "default", f"no model under {mount}: the default model baked into the image"


def log(message: str) -> None:
    print(f"[hiserve-entrypoint] {message}", file=sys.stderr, flush=True)


def summarize(
    spec: DeviceSpec, report: dict, model: str, why: str, env: Mapping[str, str]
) -> list[str]:
    """The startup summary lines (the server adds the host-tier method and pinned flag)."""
    probe_type = PROBE_TYPE.get(spec.type, spec.type)
    info: dict = next((p for p in report.get("probes", []) if p.get("type") == probe_type), {})
    versions = " ".join(
        f"{name}={report.get(name) or info.get(name)}"
        for name in ("torch", "torch_musa", "torch_npu")
        if report.get(name) or info.get(name)
    )
    visible = " ".join(
        f"{v}={env[v]}"
        for v in ("MTHREADS_VISIBLE_DEVICES", *VISIBLE_DEVICES_VAR.values())
        if v in env
    )
    names = ", ".join(info.get("names", []))
    hicache_on = env.get("HISERVE_ENABLE_HIERARCHICAL_CACHE", "0").lower() in (
        "1",
        "true",
        "yes",
        "on",
    )
    hicache = "off"
    if hicache_on:
        size = (
            f"size={env['HISERVE_HICACHE_SIZE']}GB"
            if "HISERVE_HICACHE_SIZE" in env
            else f"ratio={env.get('HISERVE_HICACHE_RATIO', 'server default')}"
        )
        hicache = (
            f"on, {size}, layout={env.get('HISERVE_HICACHE_MEM_LAYOUT', 'default')}, "
            f"write={env.get('HISERVE_HICACHE_WRITE_POLICY', 'default')}, "
            f"host_alloc={env.get('HISERVE_HICACHE_HOST_ALLOC', 'auto')} requested "
            "(the server's 'HiCache host tier' line shows the allocation used and pinned)"
        )
    lines = [
        f"device: {spec}" + (f" ({names})" if names else "") + (f"; {visible}" if visible else ""),
        f"model: {model} ({why})",
        f"hicache: {hicache}",
    ]
    if versions:
        lines.insert(1, f"versions: {versions}")
    return lines


def server_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "server", *args]


def _tp_ranks(args: list[str], env: Mapping[str, str]) -> int | None:
    """GPUs a tensor-parallel server uses (1 without TP), from ``--tp`` /
    ``--tensor-parallel-size`` or the environment; None when the ranks' devices are
    listed explicitly (``HISERVE_TENSOR_PARALLEL_DEVICES`` / ``--tensor-parallel-devices``)."""
    names = [arg.partition("=")[0] for arg in args]
    if env.get("HISERVE_TENSOR_PARALLEL_DEVICES") or "--tensor-parallel-devices" in names:
        return None
    text = env.get("HISERVE_TENSOR_PARALLEL_SIZE", "1")
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--tp", "--tensor-parallel-size"):
            text = value if eq else (args[i + 1] if i + 1 < len(args) else text)
    try:
        return max(1, int(text))
    except ValueError:
        return 1  # the server rejects it with its own message


def _cli_device(args: list[str]) -> tuple[int, str, str] | None:
    """Position, value and prefix of a ``--device`` given on the command line, if any."""
    for i, arg in enumerate(args):
        if arg == "--device" and i + 1 < len(args):
            return i + 1, args[i + 1], ""
        if arg.startswith("--device="):
            return i, arg.partition("=")[2], "--device="
    return None


def prepare(args: list[str], env: MutableMapping[str, str]) -> list[str]:
    """Validate settings, run the preflight, update ``env``; return the server command."""
    drop_empty_settings(env)
    cli = _cli_device(args)
    device_text = cli[1] if cli else env.get("HISERVE_DEVICE", "auto")
    requested = parse_device(device_text)
    pairing = visible_devices_warning(requested, env)
    if pairing:
        log(f"warning: {pairing}")
    ranks = _tp_ranks(args, env)
    # An explicit rank device list names GPUs by their host index: leave visibility alone.
    spec = requested if ranks is None else pin_visible_device(requested, env, ranks)
    label = str(requested)
    if spec != requested:
        var = VISIBLE_DEVICES_VAR[spec.type]
        label += f" ({var}={env[var]} set, so the process sees it as {spec})"
        log(f"{requested}: set {var}={env[var]}; the server uses {spec}")
    mode = env.get("HISERVE_PREFLIGHT", "1").strip().lower()
    if mode not in ("0", "1", "only"):
        raise PreflightError(f"HISERVE_PREFLIGHT={mode!r}: use 1, 0 or only.", EXIT_BAD_CONFIG)
    try:
        timeout_s = float(env.get("HISERVE_PREFLIGHT_TIMEOUT", DEFAULT_PREFLIGHT_TIMEOUT_S))
    except ValueError as exc:
        raise PreflightError(
            "HISERVE_PREFLIGHT_TIMEOUT must be a number of seconds.", EXIT_BAD_CONFIG
        ) from exc
    report: dict = {}
    if mode != "0":
        spec, report = resolve_device(spec, env, timeout_s, label)
    model, why = choose_model(env)
    env["HISERVE_MODEL"] = model
    if cli:  # the command line wins over the environment: rewrite it there too
        position, _, prefix = cli
        args[position] = f"{prefix}{spec}"
    env["HISERVE_DEVICE"] = str(spec)
    for line in summarize(spec, report, model, why, env):
        log(line)
    return server_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        # A command of its own (a shell, the bench tool): run it untouched.
        try:
            os.execvp(args[0], args)
        except OSError as exc:
            log(f"error: cannot run {args[0]!r}: {exc.strerror}")
            return 127
    env = dict(os.environ)
    try:
        command = prepare(args, env)
    except PreflightError as exc:
        log(f"error: {exc}")
        return exc.exit_code
    if env.get("HISERVE_PREFLIGHT", "1").strip().lower() == "only":
        log("preflight passed (HISERVE_PREFLIGHT=only): not starting the server")
        log(f"would run: {' '.join(command)} with HISERVE_DEVICE={env['HISERVE_DEVICE']}")
        return 0
    log(f"starting: {' '.join(command)}")
    # NOTE: exec, not a child process: the server becomes PID 1 and gets SIGTERM directly.
    os.execve(command[0], command, env)
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
