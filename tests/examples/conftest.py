"""The controller's fixtures (a gateway client, a kmock cluster) for the examples' Job tests."""

from tests.controller.conftest import client  # noqa: F401
from tests.controller.test_k8s_runner import cluster  # noqa: F401
