"""The dashboard on a stack with API keys (as `fleet up` starts it), in headless Chromium: it asks
once for the key, then reads state with it and follows /events through the cookie (EventSource
cannot send headers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fleet_local import stack
from tests.support import embedded_stack
from tests.test_dashboard_browser import browser, css, screenshot, wait

__all__ = ["browser"]  # the fixture, shared with the dashboard's other browser tests


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    with embedded_stack(tmp_path_factory.mktemp("fleet-dashboard-auth"), auth=True) as manifest:
        yield manifest


def test_the_dashboard_asks_for_the_key_once_then_shows_the_cluster_live(secured, browser) -> None:
    from selenium.webdriver.support import expected_conditions

    browser.get(secured.gateway_url + "/")
    prompt = wait(browser, expected_conditions.alert_is_present(), 30)
    assert "API key" in prompt.text
    prompt.send_keys(secured.api_key)
    prompt.accept()
    node = wait(browser, lambda b: css(b, ".node[data-node-id]"))[0]
    assert node.get_attribute("data-node-id")
    wait(browser, lambda b: "live" in css(b, "#status")[0].text, 30)  # /events, with the cookie
    screenshot(browser, "topology-with-key")
    browser.refresh()  # the key is remembered: no second prompt
    wait(browser, lambda b: css(b, ".node[data-node-id]"), 30)
    assert not expected_conditions.alert_is_present()(browser)
