"""Server flags: one per EngineConfig field, env fallbacks, CLI precedence, clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineConfig
from server.args import FLAG_TABLE, ServerArgs, build_parser, parse_args


def test_every_engine_field_has_exactly_one_flag() -> None:
    mapped = [spec.field for spec in FLAG_TABLE if spec.field is not None]
    assert sorted(mapped) == sorted(EngineConfig.field_names())
    assert len(mapped) == len(set(mapped))


def test_every_flag_is_in_help() -> None:
    text = build_parser().format_help()
    for spec in FLAG_TABLE:
        assert f"--{spec.flag}" in text
        assert spec.env in text


def test_defaults_equal_engine_defaults() -> None:
    args = parse_args([], environ={})
    assert args.engine == EngineConfig()
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.max_body_bytes == 8 * 1024 * 1024
    assert args.shutdown_grace == 30.0


def test_cli_flags_map_onto_config() -> None:
    args = parse_args(
        [
            "--model",
            "/models/x",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--kv-cache-tokens",
            "4096",
            "--page-size",
            "16",
            "--max-running-requests",
            "8",
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            "3.5",
            "--hicache-size",
            "1.5",
            "--hicache-write-policy",
            "write_back",
            "--hicache-mem-layout",
            "page_first",
            "--hicache-host-alloc",
            "pageable",
            "--disable-radix-cache",
            "--disable-mixed-batches",
            "--schedule-policy",
            "lpm",
            "--max-model-len",
            "1024",
            "--seed",
            "7",
            "--served-model-name",
            "m",
            "--port",
            "9000",
            "--api-key",
            "k",
            "--shutdown-grace",
            "2.5",
            "--max-body-bytes",
            "4096",
        ],
        environ={},
    )
    expected = dataclasses.replace(
        EngineConfig(),
        model="/models/x",
        device="cpu",
        dtype="float32",
        kv_cache_tokens=4096,
        page_size=16,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=3.5,
        hicache_size=1.5,
        hicache_write_policy="write_back",
        hicache_mem_layout="page_first",
        hicache_host_alloc="pageable",
        enable_prefix_cache=False,
        enable_mixed_batches=False,
        schedule_policy="lpm",
        max_model_len=1024,
        seed=7,
        served_model_name="m",
    )
    assert args.engine == expected
    assert (args.port, args.api_key, args.shutdown_grace, args.max_body_bytes) == (
        9000,
        "k",
        2.5,
        4096,
    )


def test_env_fills_unset_flags_and_cli_wins() -> None:
    env = {
        "HISERVE_KV_CACHE_TOKENS": "2048",
        "HISERVE_ENABLE_HIERARCHICAL_CACHE": "true",
        "HISERVE_PORT": "9100",
        "HISERVE_DISABLE_RADIX_CACHE": "1",
        "HISERVE_DISABLE_MIXED_BATCHES": "yes",
        "HISERVE_API_KEY": "from-env",
        "HISERVE_HICACHE_SIZE": "none",
    }
    args = parse_args([], environ=env)
    assert args.engine.kv_cache_tokens == 2048
    assert args.engine.enable_hierarchical_cache is True
    assert args.engine.enable_prefix_cache is False
    assert args.engine.enable_mixed_batches is False
    assert args.engine.hicache_size is None
    assert (args.port, args.api_key) == (9100, "from-env")
    args = parse_args(
        ["--kv-cache-tokens", "512", "--no-enable-hierarchical-cache", "--port", "9200"],
        environ=env,
    )
    assert args.engine.kv_cache_tokens == 512
    assert args.engine.enable_hierarchical_cache is False
    assert args.port == 9200


@pytest.mark.parametrize(
    "word,value",
    [("0", False), ("false", False), ("No", False), ("1", True), ("TRUE", True), ("on", True)],
)
def test_env_bool_words(word: str, value: bool) -> None:
    args = parse_args([], environ={"HISERVE_ENABLE_HIERARCHICAL_CACHE": word})
    assert args.engine.enable_hierarchical_cache is value


@pytest.mark.parametrize(
    "name,value",
    [
        ("HISERVE_KV_CACHE_TOKENS", "lots"),
        ("HISERVE_ENABLE_HIERARCHICAL_CACHE", "maybe"),
        ("HISERVE_SCHEDULE_POLICY", "random"),
        ("HISERVE_KV_MEM_FRACTION", "half"),
    ],
)
def test_bad_env_value_names_the_variable(
    name: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args([], environ={name: value})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert name in err and value in err


def test_invalid_engine_config_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--page-size", "0"], environ={})
    assert "page_size must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "int3"], environ={})
    assert "invalid choice" in capsys.readouterr().err


def test_empty_env_is_unset() -> None:
    args = parse_args([], environ={"HISERVE_SERVED_MODEL_NAME": "", "HISERVE_PORT": " "})
    assert args.engine.served_model_name is None
    assert args.port == 8000


def test_summary_never_shows_the_key() -> None:
    args = ServerArgs(engine=EngineConfig(), api_key="s3cret")
    summary = args.summary()
    assert "s3cret" not in repr(summary)
    assert summary["api_key"] == "set"
    assert set(EngineConfig.field_names()) <= set(summary)


def test_inherited_socket_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args([], environ={}).fd is None
    assert parse_args(["--fd", "7"], environ={}).fd == 7
    assert parse_args([], environ={"HISERVE_FD": "5"}).fd == 5
    with pytest.raises(SystemExit) as info:
        parse_args(["--fd", "-1"], environ={})
    assert info.value.code == 2
    assert "--fd must be an open file descriptor" in capsys.readouterr().err


def test_uvicorn_gets_the_grace_period() -> None:
    from server.__main__ import uvicorn_config

    args = ServerArgs(engine=EngineConfig(), shutdown_grace=2.5, port=1234, log_level="error")
    config = uvicorn_config(object(), args)
    assert config.timeout_graceful_shutdown == 3  # whole seconds, never shorter
    assert (config.port, config.log_level, config.lifespan) == (1234, "error", "on")


def test_allowed_hosts_default_to_loopback_names_without_a_key() -> None:
    """Issue 25 item 11: a keyless server used to answer any Host (DNS rebinding)."""
    assert parse_args([], environ={}).allowed_hosts == ("localhost", "127.0.0.1", "[::1]")
    for argv in (["--api-key", "k"], ["--admin-key", "a"]):
        assert parse_args(argv, environ={}).allowed_hosts == ()  # any, as before
    given = parse_args(["--allowed-hosts", "api.example, *"], environ={})
    assert given.allowed_hosts == ("api.example", "*")
    from_env = parse_args([], environ={"HISERVE_ALLOWED_HOSTS": "svc"})
    assert from_env.allowed_hosts == ("svc",)


def test_admin_key_and_metrics_public_flags() -> None:
    args = parse_args(["--metrics-public"], environ={"HISERVE_ADMIN_KEY": "zq9-secret"})
    assert (args.admin_key, args.metrics_public, args.api_key) == ("zq9-secret", True, None)
    assert args.summary()["admin_key"] == "set" and "zq9-secret" not in str(args.summary())
    with pytest.raises(SystemExit):
        parse_args(["--api-key", "same", "--admin-key", "same"], environ={})
