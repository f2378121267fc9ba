from rollover.store.models import ProxyState
from rollover.training.gateway_counts import unhonoured_metrics


def state(**totals: int) -> ProxyState:
    return ProxyState(paused=True, retry_after_seconds=1.0, reason=None, inflight=0, unhonoured_fields_total=totals)


def test_each_step_reports_the_calls_since_the_last_pause_per_field() -> None:
    first = state(**{"anthropic.thinking": 3})
    assert unhonoured_metrics(None, first) == {"gateway/unhonoured_fields/anthropic.thinking": 3.0}
    second = state(**{"anthropic.thinking": 5, "responses.reasoning": 1})
    assert unhonoured_metrics(first, second) == {
        "gateway/unhonoured_fields/anthropic.thinking": 2.0,
        "gateway/unhonoured_fields/responses.reasoning": 1.0,
    }
    # A field seen before reports 0 in a step without it; a restarted gateway counts from 0 again.
    assert unhonoured_metrics(second, second)["gateway/unhonoured_fields/responses.reasoning"] == 0.0
    restarted = state(**{"anthropic.thinking": 1})
    assert unhonoured_metrics(second, restarted) == {"gateway/unhonoured_fields/anthropic.thinking": 1.0}
