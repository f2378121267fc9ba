"""The controller's fixtures (a gateway, its client, a kmock cluster) for the examples' Job tests."""

from tests.controller.conftest import client, gateway  # noqa: F401
from tests.controller.test_k8s_runner import cluster  # noqa: F401
