"""Shared fixtures: a real gateway on loopback and a stand-in upstream."""

from __future__ import annotations

import os
from typing import Iterator

import httpx
import pytest

from rollover.gateway.server import GatewayThread
from rollover.gateway.stub_upstream import StubUpstream

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

ADMIN_KEY = "test-admin-key"


@pytest.fixture
def gateway() -> Iterator[GatewayThread]:
    with GatewayThread(store_path=":memory:", admin_key=ADMIN_KEY) as server:
        yield server


@pytest.fixture
def stub() -> Iterator[StubUpstream]:
    with StubUpstream() as upstream:
        yield upstream


@pytest.fixture
def admin(gateway: GatewayThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30) as client:
        yield client
