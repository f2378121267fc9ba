"""`gateway.sqlite_synchronous`: NORMAL by default (a process kill loses nothing acknowledged),
FULL for power loss too; every connection of the store runs with it."""

from __future__ import annotations

import pytest

from rollover.config import ConfigError, GatewaySettings, RolloverConfig
from rollover.gateway.server import GatewayThread
from tests.conftest import ADMIN_KEY

LEVELS = {"NORMAL": 1, "FULL": 2}  # what PRAGMA synchronous answers


@pytest.mark.parametrize("level", ["NORMAL", "FULL"])
def test_the_gateways_store_runs_with_the_configured_synchronous_level(tmp_path, level):
    with GatewayThread(store=str(tmp_path / "store.db"), admin_key=ADMIN_KEY, sqlite_synchronous=level) as server:
        store = server.server.config.app.state.gateway.store
        connections = [store._file.conn, store._file._read_conn, store._file._checkpointer._conn]
        assert [c.execute("PRAGMA synchronous").fetchone()[0] for c in connections] == [LEVELS[level]] * 3


def test_normal_is_the_default_and_other_levels_are_refused_naming_the_key():
    assert RolloverConfig().gateway.sqlite_synchronous == "NORMAL"
    with pytest.raises(ConfigError, match="gateway.sqlite_synchronous"):
        GatewaySettings.from_config(sqlite_synchronous="OFF")
