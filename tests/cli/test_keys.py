"""Keys for `rollover controller` and `rollover view` without argv: a private file, the
environment, or stdin."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from rollover.cli.keys import CONTROLLER_KEY_ENV, KeySourceError, read_key
from rollover.cli.main import main


def test_a_key_comes_from_a_private_file_the_environment_or_stdin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text("from-file\n")
    key_file.chmod(0o600)
    monkeypatch.setenv(CONTROLLER_KEY_ENV, "from-env")
    assert read_key(None, str(key_file), CONTROLLER_KEY_ENV) == "from-file"
    assert read_key(None, None, CONTROLLER_KEY_ENV) == "from-env"
    monkeypatch.setattr("sys.stdin", io.StringIO("from-stdin\n"))
    assert read_key("-", str(key_file), CONTROLLER_KEY_ENV) == "from-stdin"
    monkeypatch.delenv(CONTROLLER_KEY_ENV)
    assert read_key(None, None, CONTROLLER_KEY_ENV) is None


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text("k")
    key_file.chmod(0o644)
    with pytest.raises(KeySourceError, match="chmod 600"):
        read_key(None, str(key_file), CONTROLLER_KEY_ENV)


def test_the_controller_without_a_key_says_where_to_give_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(CONTROLLER_KEY_ENV, raising=False)
    assert main(["controller", "--gateway", "http://127.0.0.1:9"]) == 2
    assert "--key-file" in capsys.readouterr().err
