"""The gateway: store REST API, recording OpenAI-compatible proxy, pause/drain management."""

from rollover.gateway.app import create_app
from rollover.gateway.auth import scoped_key
from rollover.gateway.client import ConflictError, GatewayClient, GatewayError, NotFoundError
from rollover.gateway.server import GatewayProcess, GatewayThread

__all__ = [
    "ConflictError",
    "GatewayClient",
    "GatewayError",
    "GatewayProcess",
    "GatewayThread",
    "NotFoundError",
    "create_app",
    "scoped_key",
]
