"""Command-line and environment arguments of the server.

Every EngineConfig field has a flag (``kv_cache_tokens`` -> ``--kv-cache-tokens``), and
every flag can also come from ``HISERVE_<FLAG_UPPER_SNAKE>`` (``HISERVE_KV_CACHE_TOKENS``).
The command line beats the environment, which beats the EngineConfig default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, NoReturn

from engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    HICACHE_HOST_ALLOC,
    HICACHE_MEM_LAYOUTS,
    HICACHE_PREFETCH_POLICIES,
    HICACHE_STORAGE_BACKENDS,
    HICACHE_WRITE_POLICIES,
    SCHEDULE_POLICIES,
    EngineConfig,
)
from server.tools.parsers import PARSER_NAMES

ENV_PREFIX = "HISERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
# Optional numbers also accept these words for "unset"; optional strings are unset when empty.
NONE_WORDS = ("none", "null", "auto")


@dataclass(frozen=True)
class FlagSpec:
    """One command-line flag: which EngineConfig field it sets (if any) and how."""

    flag: str  # without the leading dashes
    help: str
    field: str | None = None  # EngineConfig field; None: a server-only flag
    kind: str | None = None  # "str" | "int" | "float" | "bool"; None: from the field type
    optional: bool = False  # accepts None ("none"); taken from the field type when set
    default: Any = None  # server-only flags only
    choices: tuple[str, ...] | None = None
    invert: bool = False  # the flag sets the field to the opposite boolean

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


# NOTE: one row per flag; test_server_args asserts that every EngineConfig field has a row.
FLAG_TABLE: tuple[FlagSpec, ...] = (
    FlagSpec("model", "model directory, .gguf file, or 'default' (the embedded model)", "model"),
    FlagSpec("served-model-name", "model name reported by the API", "served_model_name"),
    FlagSpec("device", "cpu, cuda, cuda:1, musa:0, npu, xpu, mps or auto", "device"),
    FlagSpec("dtype", "weight and KV precision", "dtype", choices=DTYPES),
    FlagSpec(
        "attention-backend",
        "attention kernels (auto: native CPU decode for float32 on CPU, else torch)",
        "attention_backend",
        choices=ATTENTION_BACKENDS,
    ),
    FlagSpec("cache-dir", "where converted GGUF models are cached", "cache_dir"),
    FlagSpec("seed", "seed of the engine's default random generator", "seed"),
    FlagSpec("kv-cache-tokens", "device KV pool size in tokens", "kv_cache_tokens"),
    FlagSpec("kv-mem-fraction", "fraction of free device memory for KV", "kv_mem_fraction"),
    FlagSpec("page-size", "tokens per KV page", "page_size"),
    FlagSpec(
        "disable-radix-cache", "turn the prefix cache off", "enable_prefix_cache", invert=True
    ),
    FlagSpec(
        "enable-hierarchical-cache", "enable the HiCache host tier", "enable_hierarchical_cache"
    ),
    FlagSpec("hicache-ratio", "host tier size as a multiple of the device pool", "hicache_ratio"),
    FlagSpec("hicache-size", "host tier size in GB (overrides --hicache-ratio)", "hicache_size"),
    FlagSpec(
        "hicache-mem-layout",
        "host buffer layout",
        "hicache_mem_layout",
        choices=HICACHE_MEM_LAYOUTS,
    ),
    FlagSpec(
        "hicache-write-policy",
        "when KV is backed up to the host tier",
        "hicache_write_policy",
        choices=HICACHE_WRITE_POLICIES,
    ),
    FlagSpec(
        "hicache-host-alloc",
        "how host tier memory is allocated",
        "hicache_host_alloc",
        choices=HICACHE_HOST_ALLOC,
    ),
    FlagSpec(
        "hicache-load-threshold",
        "host hits shorter than this are recomputed",
        "hicache_load_threshold",
    ),
    FlagSpec(
        "hicache-storage-backend",
        "L3 store below the host tier, shared by replicas and kept across restarts",
        "hicache_storage_backend",
        choices=HICACHE_STORAGE_BACKENDS,
    ),
    FlagSpec("hicache-storage-dir", "directory of the file L3 backend", "hicache_storage_dir"),
    FlagSpec(
        "hicache-storage-size",
        "GB the file L3 backend may use (least recently used pages go first)",
        "hicache_storage_size",
    ),
    FlagSpec(
        "hicache-storage-prefetch-policy",
        "how long admission waits for L3 reads",
        "hicache_storage_prefetch_policy",
        choices=HICACHE_PREFETCH_POLICIES,
    ),
    FlagSpec(
        "hicache-storage-prefetch-threshold",
        "prompts continuing their cached prefix by fewer tokens skip L3",
        "hicache_storage_prefetch_threshold",
    ),
    FlagSpec("hicache-mooncake-master", "host:port of mooncake_master", "hicache_mooncake_master"),
    FlagSpec(
        "hicache-mooncake-metadata-server",
        "Mooncake metadata server (P2PHANDSHAKE or http://host:port/metadata)",
        "hicache_mooncake_metadata_server",
    ),
    FlagSpec("max-running-requests", "most requests decoded together", "max_running_requests"),
    FlagSpec("max-waiting-requests", "queue length before 503", "max_waiting_requests"),
    FlagSpec("max-prefill-tokens", "most new prompt tokens per step", "max_prefill_tokens"),
    FlagSpec("chunked-prefill-size", "prompt chunk size", "chunked_prefill_size"),
    FlagSpec("schedule-policy", "order of admission", "schedule_policy", choices=SCHEDULE_POLICIES),
    FlagSpec("max-model-len", "context length (prompt + output)", "max_model_len"),
    FlagSpec("max-stop-strings", "most stop strings per request", "max_stop_strings"),
    FlagSpec("max-stop-token-ids", "most stop_token_ids per request", "max_stop_token_ids"),
    FlagSpec(
        "max-logprobs",
        "most logprobs / top_logprobs a request may ask for (vLLM's max_logprobs)",
        "max_logprobs",
    ),
    FlagSpec(
        "max-queued-outputs",
        "outputs queued per stream for a slow reader before they are merged",
        "max_queued_outputs",
    ),
    FlagSpec(
        "stream-stall-timeout",
        "seconds a stream's reader may take nothing before its request is ended",
        "stream_stall_timeout",
    ),
    FlagSpec(
        "grammar-compile-timeout",
        "seconds a structured-output request may wait for its grammar to compile",
        "grammar_compile_timeout",
    ),
    # server-only
    FlagSpec("host", "address to listen on", kind="str", default="127.0.0.1"),
    FlagSpec("port", "port to listen on", kind="int", default=8000),
    FlagSpec(
        "fd",
        "serve on this inherited, already bound socket instead of --host/--port "
        "(a supervisor or test that holds the port hands it over with no window to lose it)",
        kind="int",
        optional=True,
    ),
    FlagSpec(
        "api-key",
        "require 'Authorization: Bearer <key>' on /v1 and admin routes",
        kind="str",
        optional=True,
    ),
    FlagSpec("log-level", "logging level", kind="str", default="info", choices=LOG_LEVELS),
    FlagSpec(
        "max-body-bytes",
        "largest request body accepted (413 past it)",
        kind="int",
        default=8 * 1024 * 1024,
    ),
    FlagSpec(
        "shutdown-grace",
        "seconds in-flight requests get to finish on SIGTERM",
        kind="float",
        default=30.0,
    ),
    FlagSpec(
        "max-choices",
        "most choices (prompts x n) per request",
        kind="int",
        default=256,
    ),
    FlagSpec(
        "allowed-hosts",
        "comma-separated Host header values accepted (DNS-rebinding guard); empty: any",
        kind="str",
        optional=True,
    ),
    FlagSpec(
        "enable-docs",
        "serve /docs, /redoc and /openapi.json",
        kind="bool",
        default=False,
    ),
    FlagSpec(
        "trust-message-special-tokens",
        "tokenize special-token strings inside chat message content as control tokens "
        "(only for trusted callers: lets them forge system and assistant turns)",
        kind="bool",
        default=False,
    ),
    FlagSpec(
        "tool-call-parser",
        "format of tool calls in free text (auto: from the chat template; hermes otherwise)",
        kind="str",
        default="auto",
        choices=PARSER_NAMES,
    ),
)


@dataclass(frozen=True)
class ServerArgs:
    """Effective server configuration: the engine's part plus the HTTP part."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    fd: int | None = None
    api_key: str | None = None
    log_level: str = "info"
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_grace: float = 30.0
    max_choices: int = 256
    allowed_hosts: tuple[str, ...] = ()  # empty: any Host header
    enable_docs: bool = False
    trust_message_special_tokens: bool = False
    tool_call_parser: str = "auto"

    def summary(self) -> dict[str, Any]:
        """Flat view for the startup line; the API key is never shown."""
        out = self.engine.to_dict()
        out.update(
            host=self.host,
            port=self.port,
            fd=self.fd,
            log_level=self.log_level,
            api_key="set" if self.api_key else "none",
            max_body_bytes=self.max_body_bytes,
            shutdown_grace=self.shutdown_grace,
            max_choices=self.max_choices,
            allowed_hosts=",".join(self.allowed_hosts) or "any",
            enable_docs=self.enable_docs,
            trust_message_special_tokens=self.trust_message_special_tokens,
            tool_call_parser=self.tool_call_parser,
        )
        return out


_FIELDS = {f.name: f for f in fields(EngineConfig)}


def _resolve(spec: FlagSpec) -> tuple[str, bool, Any]:
    """(kind, optional, default) of a flag, read from the EngineConfig field when it has one."""
    if spec.field is None:
        assert spec.kind is not None
        return spec.kind, spec.optional, spec.default
    f = _FIELDS[spec.field]
    parts = [p.strip() for p in str(f.type).split("|")]
    optional = "None" in parts
    kinds = [p for p in parts if p != "None"]
    if len(kinds) != 1 or kinds[0] not in ("str", "int", "float", "bool"):
        raise TypeError(f"EngineConfig.{f.name} has unsupported type {f.type!r}")
    default = f.default if f.default is not MISSING else None
    if spec.invert:
        default = not default
    return kinds[0], optional, default


def _bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"expected one of {'/'.join(TRUE_WORDS + FALSE_WORDS)}, got {text!r}")


def _converter(kind: str, optional: bool) -> Callable[[str], Any]:
    converters: dict[str, Callable[[str], Any]] = {
        "str": str,
        "int": int,
        "float": float,
        "bool": _bool,
    }
    base = converters[kind]

    def convert(text: str) -> Any:
        if optional and kind != "str" and text.strip().lower() in NONE_WORDS:
            return None
        return base(text)

    convert.__name__ = kind  # argparse names the type in its error messages
    return convert


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser; every default is None so that unset flags can fall back to env."""
    parser = argparse.ArgumentParser(
        prog="hiserve",
        description="OpenAI-compatible LLM server. Every flag can also be set through the "
        f"environment as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}KV_CACHE_TOKENS=4096); "
        "flags given on the command line win.",
    )
    for spec in FLAG_TABLE:
        kind, optional, default = _resolve(spec)
        help_text = f"{spec.help} (default: {default}; env {spec.env})"
        if kind == "bool":
            parser.add_argument(
                f"--{spec.flag}",
                dest=spec.dest,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            parser.add_argument(
                f"--{spec.flag}",
                dest=spec.dest,
                default=None,
                type=_converter(kind, optional),
                choices=spec.choices,
                metavar=None if spec.choices else spec.dest.upper(),
                help=help_text,
            )
    return parser


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerArgs:
    """Parse flags, then the environment; exit with status 2 and a clear message on errors."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    namespace = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    values: dict[str, Any] = {}
    for spec in FLAG_TABLE:
        kind, optional, default = _resolve(spec)
        value = getattr(namespace, spec.dest)
        raw = environ.get(spec.env)
        if value is None and raw is not None and raw.strip() != "":
            try:
                value = _converter(kind, optional)(raw)
            except ValueError as exc:
                _fail(parser, f"environment variable {spec.env}={raw!r}: invalid {kind} ({exc})")
            if spec.choices is not None and value not in spec.choices:
                _fail(
                    parser,
                    f"environment variable {spec.env}={raw!r}: choose one of "
                    f"{', '.join(spec.choices)}",
                )
        values[spec.dest] = default if value is None else value

    engine_kwargs: dict[str, Any] = {}
    for spec in FLAG_TABLE:
        if spec.field is not None:
            value = values[spec.dest]
            engine_kwargs[spec.field] = (not value) if spec.invert else value
    try:
        engine = EngineConfig(**engine_kwargs)
    except ValueError as exc:
        _fail(parser, f"invalid engine configuration: {exc}")
    if not 0 <= values["port"] <= 65535:
        _fail(parser, f"--port must be in [0, 65535], got {values['port']}")
    if values["fd"] is not None and values["fd"] < 0:
        _fail(parser, f"--fd must be an open file descriptor (>= 0), got {values['fd']}")
    if values["max_body_bytes"] < 1024:
        _fail(parser, f"--max-body-bytes must be >= 1024, got {values['max_body_bytes']}")
    if values["shutdown_grace"] < 0:
        _fail(parser, f"--shutdown-grace must be >= 0, got {values['shutdown_grace']}")
    if values["max_choices"] < 1:
        _fail(parser, f"--max-choices must be >= 1, got {values['max_choices']}")
    return ServerArgs(
        engine=engine,
        host=values["host"],
        port=values["port"],
        fd=values["fd"],
        api_key=values["api_key"] or None,
        log_level=values["log_level"],
        max_body_bytes=values["max_body_bytes"],
        shutdown_grace=values["shutdown_grace"],
        max_choices=values["max_choices"],
        allowed_hosts=parse_hosts(values["allowed_hosts"]),
        enable_docs=bool(values["enable_docs"]),
        trust_message_special_tokens=bool(values["trust_message_special_tokens"]),
        tool_call_parser=values["tool_call_parser"],
    )


def parse_hosts(text: str | None) -> tuple[str, ...]:
    """``"a.example, 127.0.0.1"`` -> ``("a.example", "127.0.0.1")``, lower-cased."""
    if not text:
        return ()
    return tuple(h.strip().lower() for h in text.split(",") if h.strip())
