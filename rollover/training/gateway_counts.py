"""What the gateway counted during a step, from its running totals (`ProxyState`) read at two
consecutive pauses: calls that carried request fields the engine cannot honour, per API and
field (`gateway/unhonoured_fields/anthropic.thinking`, ...: accepted, never passed on)."""

from __future__ import annotations

from rollover.store.models import ProxyState

PREFIX = "gateway/unhonoured_fields/"


def unhonoured_metrics(before: ProxyState | None, after: ProxyState) -> dict[str, float]:
    """Per field, the calls since `before` (None: since the gateway started) that carried it;
    fields seen at any time so far report 0 in steps without them, so their curves stay whole.
    A gateway restarted in between counts from 0 again: a total that fell counts from there."""
    seen = before.unhonoured_fields_total if before is not None else {}
    metrics = {}
    for key, total in after.unhonoured_fields_total.items():
        earlier = seen.get(key, 0)
        metrics[PREFIX + key] = float(total - earlier if total >= earlier else total)
    return metrics
