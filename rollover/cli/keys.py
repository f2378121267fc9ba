"""Where a command takes a key from without leaving it in argv (visible to every local user
in `ps` and `/proc/PID/cmdline`): a file only its user reads, an environment variable, or
stdin (`--key -`). `--key VALUE` still works, for a quick local trial."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

CONTROLLER_KEY_ENV = "ROLLOVER_ADMIN_KEY"
VIEWER_KEY_ENV = "ROLLOVER_VIEW_KEY"


class KeySourceError(ValueError):
    """A key file that cannot be read, or one other users can read."""


def read_key(value: str | None, key_file: str | None, env_name: str) -> str | None:
    """`--key` (`-`: one line of stdin), else `--key-file`, else `$env_name`; None if none."""
    if value == "-":
        return sys.stdin.readline().strip() or None
    if value:
        return value
    if key_file:
        path = Path(key_file)
        try:
            mode = path.stat().st_mode
            text = path.read_text()
        except OSError as exc:
            raise KeySourceError(f"--key-file {key_file}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeySourceError(f"--key-file {key_file} can be read by other users: chmod 600 it")
        return text.strip() or None
    return os.environ.get(env_name) or None
