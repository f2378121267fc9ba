"""The viewer page in a real headless browser, against a recorded real run.

Screenshots land in test-artifacts/viewer/ (ignored by git) for a person to look at.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from rollover.viewer.app import ViewerThread
from rollover.viewer.data import RunFolder
from tests.runs import SEED_ASYNC_METRICS
from tests.viewer import browser
from tests.viewer.runfolder import recorded_run

pytestmark = pytest.mark.slow  # a real browser / the Agent Lightning peer: seconds per test

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "viewer"


@pytest.fixture(scope="module")
def viewer(tmp_path_factory):
    run_dir = recorded_run(tmp_path_factory.mktemp("recorded"))
    with ViewerThread(RunFolder(run_dir)) as server:
        yield server


@pytest.fixture(scope="module")
def api(viewer):
    with httpx.Client(base_url=viewer.url, headers=viewer.headers, timeout=60) as client:
        yield lambda path, **params: client.get(path, params=params).json()


@pytest.fixture(scope="module")
def driver():
    reason = browser.missing()
    if reason:
        pytest.fail(reason)
    chromium = browser.start_chromium()
    yield chromium
    chromium.quit()


def open_page(driver, viewer, route: str, ready: str):
    """Load a route and wait until the page has rendered `ready` (a CSS selector)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(viewer.landing_url + route)
    WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ready))
    return driver


def css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def test_metric_charts_render_the_runs_data(driver, viewer, api):
    rows = api("api/metrics")["rows"]
    train_steps = [r["step"] for r in rows if "training/async/n_completed_rollouts" in r]
    assert len(train_steps) >= 2
    open_page(driver, viewer, "#/", "#charts [data-chart] svg")
    for key in (*SEED_ASYNC_METRICS, "critic/score/mean", "timing/rollout_run_duration_s/mean", "timing/step_s"):
        [line] = css(driver, f'polyline[data-series="{key}"]')
        assert int(line.get_attribute("data-points")) == len(train_steps), key
        assert len(line.get_attribute("points").split()) == len(train_steps)
    assert css(driver, 'polyline[data-series="val/reward_mean"]')  # held-out before and after
    assert "no data" not in css(driver, '[data-chart="n_completed_rollouts"]')[0].text
    browser.full_page_screenshot(driver, ARTIFACTS / "metrics.png")


def test_the_timeline_shows_every_phase_of_every_step(driver, viewer, api):
    timeline = api("api/timeline")
    open_page(driver, viewer, "#/timeline", "#timeline rect.segment")
    for phase in ("rollout wait", "update", "weight sync"):
        bars = css(driver, f'#timeline rect.segment[data-phase="{phase}"]')
        assert len(bars) == len(timeline["steps"]), phase
    assert css(driver, '#timeline rect.segment[data-phase="evaluation"]')
    assert css(driver, '#timeline rect.segment[data-phase="pause"]')
    assert len(css(driver, "#timeline-table tr")) == len(timeline["steps"]) + 1
    browser.full_page_screenshot(driver, ARTIFACTS / "timeline.png")


def test_filters_narrow_the_rollout_list(driver, viewer, api):
    from selenium.webdriver.support.ui import Select, WebDriverWait

    total = api("api/rollouts", limit=5000)["total"]
    open_page(driver, viewer, "#/rollouts", "#rollouts tr[data-rollout]")
    assert len(css(driver, "#rollouts tr[data-rollout]")) == min(total, 500)

    def apply(**fields):
        form = css(driver, "#filters")[0]
        for name, value in fields.items():
            [field] = css(driver, f'#filters [name="{name}"]')
            if field.tag_name == "select":
                Select(field).select_by_value(value)
            else:
                field.clear()
                field.send_keys(value)
        before = driver.execute_script("return document.body.dataset.rendered")
        form.submit()
        WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.body.dataset.rendered") != before)
        return css(driver, "#rollouts tr[data-rollout]")

    rows = apply(mode="val")
    expected = api("api/rollouts", mode="val", limit=5000)
    assert 0 < len(rows) == expected["total"] < total
    assert {r.get_attribute("data-rollout") for r in rows} == {r["rollout_id"] for r in expected["rollouts"]}

    rows = apply(mode="train", step="1")
    expected = api("api/rollouts", mode="train", step=1, limit=5000)
    assert 0 < len(rows) == expected["total"]
    assert all(r.find_elements("css selector", "td")[3].text == "1" for r in rows)

    rows = apply(step="", state="succeeded", reward_min="1")
    expected = api("api/rollouts", mode="train", state="succeeded", reward_min=1, limit=5000)
    assert len(rows) == expected["total"]
    assert all(float(r.find_element("css selector", "td.reward").text) >= 1 for r in rows)
    assert "state=succeeded" in driver.current_url and "reward_min=1" in driver.current_url


def test_a_rollout_shows_its_calls_and_its_masked_tokens(driver, viewer, api):
    listing = api("api/rollouts", mode="train", state="succeeded", limit=5000)["rollouts"]
    details = [api(f"api/rollouts/{r['rollout_id']}") for r in listing[:12]]
    # the richest one: most calls (the calc agent's tool turns)
    detail = max(details, key=lambda d: (len(d["calls"]), d["reward"] or 0))
    assert detail["calls"] and detail["samples"]
    open_page(driver, viewer, f"#/rollout/{detail['rollout_id']}", "#samples .tok")

    calls = css(driver, "#calls .call")
    assert len(calls) == len(detail["calls"])
    reply = detail["calls"][0]["response_message"]["content"]
    assert reply.strip() and reply.strip().splitlines()[0] in calls[0].text

    trained = css(driver, "#samples .tok.trained")
    context = css(driver, "#samples .tok.context")
    assert len(trained) == sum(s["n_loss_tokens"] for s in detail["samples"])
    assert len(context) == sum(s["n_tokens"] - s["n_loss_tokens"] for s in detail["samples"])
    # the first trained tokens spell the first reply the model gave (decoded by the run's tokenizer)
    first = css(driver, '#samples .tokens[data-sample="0"]')[0]
    spelled = driver.execute_script(
        "return [...arguments[0].querySelectorAll('.tok')].filter(t => t.dataset.mask === '1').map(t => t.textContent).join('')",
        first,
    )
    assert spelled.replace(" ", "").startswith(reply.replace(" ", "")[:20])
    assert all(t.get_attribute("data-version") != "" for t in trained)
    assert all(t.get_attribute("data-logprob") != "" for t in trained)
    assert css(driver, "#samples .vbadge")
    assert len(css(driver, "#siblings .sibling")) == api("api/run")["n"]
    browser.full_page_screenshot(driver, ARTIFACTS / "rollout.png")


def test_a_group_shows_its_siblings_side_by_side(driver, viewer, api):
    listing = api("api/rollouts", mode="train", state="succeeded", limit=5000)["rollouts"]
    group = quote(listing[0]["group"], safe="")  # the calc example's ids hold a '#'
    # The rollout page before this one shows sibling cards too: wait for the group page's own.
    open_page(driver, viewer, f"#/group/{group}", 'body[data-route="group"] #siblings .sibling')
    cards = css(driver, "#siblings .sibling")
    expected = api(f"api/groups/{group}")["rollouts"]
    assert len(cards) == len(expected) == api("api/run")["n"]
    assert [c.get_attribute("data-rollout") for c in cards] == [r["rollout_id"] for r in expected]
    for card, row in zip(cards, expected):
        for name in ("reward", "advantage"):
            shown = card.find_element("css selector", f".{name}").text
            if name == "advantage" and row.get("filtered"):
                assert shown == "filtered: no signal"  # the zero-variance filter took the group out
            else:
                assert (shown == "—") if row[name] is None else float(shown) == pytest.approx(row[name], abs=1e-3)
