"""An L3 storage backend without a page size: the server picks one that suits L3 and says
so at start-up, instead of refusing a page size of 1 the operator never chose."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from engine.config import L3_DEFAULT_PAGE_SIZE
from server.args import parse_args

L3_ENV = {
    "HISERVE_ENABLE_HIERARCHICAL_CACHE": "1",
    "HISERVE_HICACHE_STORAGE_BACKEND": "file",
    "HISERVE_HICACHE_STORAGE_DIR": "/var/lib/hiserve/l3",
}


def test_l3_without_a_page_size_gets_one_that_suits_it() -> None:
    args = parse_args([], L3_ENV)
    assert args.engine.page_size == L3_DEFAULT_PAGE_SIZE > 1
    (note,) = args.notes
    assert f"page size {L3_DEFAULT_PAGE_SIZE}" in note and "'file'" in note


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--page-size", "32"], {}), ([], {"HISERVE_PAGE_SIZE": "32"})],
    ids=["flag", "env"],
)
def test_a_page_size_the_operator_gave_is_kept(argv: list[str], env: dict[str, str]) -> None:
    args = parse_args(argv, {**L3_ENV, **env})
    assert args.engine.page_size == 32 and args.notes == ()


def test_a_page_size_of_one_given_explicitly_is_still_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stop:
        parse_args(["--page-size", "1"], L3_ENV)
    assert stop.value.code == 2 and "--page-size 16 to 64" in capsys.readouterr().err


def test_without_l3_the_page_size_default_is_unchanged() -> None:
    args = parse_args([], {"HISERVE_ENABLE_HIERARCHICAL_CACHE": "1"})
    assert args.engine.page_size == 1 and args.notes == ()


def test_the_chosen_page_size_is_in_the_start_up_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import server.__main__ as entry

    class Stop(Exception):
        pass

    def no_app(*args: Any, **kwargs: Any) -> None:
        raise Stop

    for name, value in L3_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HISERVE_PAGE_SIZE", raising=False)
    monkeypatch.setattr(entry, "create_app", no_app)
    with caplog.at_level(logging.INFO, logger="server"), pytest.raises(Stop):
        entry.main([])
    assert f"page size {L3_DEFAULT_PAGE_SIZE} tokens" in caplog.text
