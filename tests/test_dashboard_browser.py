"""The dashboard in headless Chromium (Debian's chromium + chromedriver, driven by Selenium) against
the real embedded stack: the topology shows the worker node, creating an instance from the models
view (its engine picked from those the cluster offers, and its role) makes it ready and shows the
engine's measured speed and quality, a chat message streams an
answer, the metrics plot has points (node memory, and the chat's time to first token), the traces
view draws the chat request's timeline, the models view shows a scaling policy set through the API
and its form sets another (the autoscaler's decision then shows live). A screenshot of each view is
saved under test-artifacts/dashboard/."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from fleet_local import stack
from tests.support import REPO, call, embedded_stack, make_chat_model, until_state

MODEL = "tiny/dashboard"
ARTIFACTS = REPO / "test-artifacts" / "dashboard"
WAIT_S = 120


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    """A stack with the model staged but no instance of it (the models view creates one)."""
    model_dir = make_chat_model(tmp_path_factory.mktemp("dashboard-model"))
    # every engine of the node measured, quality included: MLX alone, so that only its measurement
    # runs beside the tests (tests elsewhere time only the engine they load)
    env = {**os.environ, "FLEET_CALIBRATION": "all", "FLEET_NODE_ENGINES": "mlx=dashboard"}
    with embedded_stack(tmp_path_factory.mktemp("fleet-dashboard"), env=env) as manifest:
        asyncio.run(stage(manifest.gateway_url, model_dir))
        yield manifest


async def stage(gateway: str, folder: Path) -> None:
    async with aiohttp.ClientSession() as session:
        await call(session, "POST", f"{gateway}/models", {"model": MODEL, "source": f"file://{folder}"})
        await until_state(session, gateway, lambda s: MODEL in s["models"] and s["nodes"], 120)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = shutil.which("chromedriver")
    if driver_path is None:
        pytest.fail("chromedriver is missing: `make test` installs Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1366,768"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def wait(browser, condition, timeout_s: float = WAIT_S):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The views re-render live (the events stream): an element found a moment ago may be gone
    # by the time the condition reads it, which only means "look again".
    ignored = (StaleElementReferenceException,)
    return WebDriverWait(browser, timeout_s, poll_frequency=0.2, ignored_exceptions=ignored).until(condition)


def css(browser, selector: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, selector)


def show(browser, view: str) -> None:
    css(browser, f"#nav-{view}")[0].click()
    wait(browser, lambda b: css(b, f"#view-{view}")[0].is_displayed(), 10)


def screenshot(browser, view: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"{view}.png"))


def test_the_topology_shows_the_worker_node(gateway, browser) -> None:
    browser.get(gateway.gateway_url + "/")
    assert browser.title and "Fleet" in browser.title
    node = wait(browser, lambda b: css(b, ".node[data-node-id]"))[0]
    assert node.get_attribute("data-node-id") and node.get_attribute("data-node-id") in node.text
    assert css(browser, ".node .memory-bar")
    assert "mlx" in css(browser, "#engine-list")[0].text  # which engines the cluster offers
    wait(browser, lambda b: "CPU load" in css(b, ".node")[0].text, 30)  # the node's live metrics sample
    wait(browser, lambda b: "live" in css(b, "#status")[0].text, 30)
    screenshot(browser, "topology")


def test_an_instance_created_from_the_models_view_becomes_ready(gateway, browser) -> None:
    from selenium.webdriver.support.ui import Select

    show(browser, "models")
    card = wait(browser, lambda b: css(b, f'.model-card[data-model-id="{MODEL}"]'))[0]
    card.find_element("css selector", ".preview-placements").click()
    wait(browser, lambda b: css(b, f'.model-card[data-model-id="{MODEL}"] .placement'), 30)
    engine = Select(card.find_element("css selector", ".instance-engine"))
    # auto (the scheduler picks), then the engines GET /capabilities lists
    assert [o.get_attribute("value") for o in engine.options] == ["", "mlx"]
    engine.select_by_value("mlx")
    role = Select(card.find_element("css selector", ".instance-role"))
    assert [o.get_attribute("value") for o in role.options] == ["both", "prefill", "decode"]
    role.select_by_value("both")
    card.find_element("css selector", ".create-instance").click()
    ready = f'.model-card[data-model-id="{MODEL}"] .instance[data-status="ready"]'
    # live: the events stream updates the view
    meta = wait(browser, lambda b: [e.text for e in css(b, f"{ready} .instance-meta")])
    assert meta[0].startswith("mlx · both"), meta
    # the worker times the engine it loaded at once, then (in the background) measures each engine's
    # quality against the model's float32 reference: both show in the card
    rows = f'.model-card[data-model-id="{MODEL}"] .measured'
    timed = wait(browser, lambda b: [e.text for e in css(b, rows)])
    assert "tok/s" in timed[0], timed
    wait(browser, lambda b: [r for r in css(b, rows) if "top-1" in r.text and "tok/s" in r.text], 300)
    screenshot(browser, "models")
    show(browser, "topology")
    wait(browser, lambda b: css(b, f'.node .instance[data-model-id="{MODEL}"][data-status="ready"]'), 30)
    screenshot(browser, "topology-serving")


def test_a_chat_message_streams_an_answer(gateway, browser) -> None:
    from selenium.webdriver.support.ui import Select

    show(browser, "chat")
    wait(browser, lambda b: MODEL in [o.get_attribute("value") for o in css(b, "#chat-model option")], 30)
    Select(css(browser, "#chat-model")[0]).select_by_value(MODEL)
    css(browser, "#chat-input")[0].send_keys("Say hello")
    css(browser, "#chat-send")[0].click()
    reply = wait(browser, lambda b: css(b, '.message.assistant[data-done="true"]'), 60)[0]
    assert "error" not in (reply.get_attribute("class") or "")
    answer = reply.find_element("css selector", ".answer").text
    reasoning = reply.find_element("css selector", ".reasoning-text").get_attribute("textContent")
    assert (answer + reasoning).strip()  # a random model says something
    assert "tok/s" in css(browser, "#chat-stats")[0].text or "tokens/s" in css(browser, "#chat-stats")[0].text
    screenshot(browser, "chat")


def test_the_metrics_plot_has_points(gateway, browser) -> None:
    from selenium.webdriver.support.ui import Select

    show(browser, "metrics")
    wait(browser, lambda b: len(css(b, "#metrics-metric option")) > 1, 30)
    Select(css(browser, "#metrics-metric")[0]).select_by_value("memory_used_bytes")
    plot = wait(
        browser,
        lambda b: [p for p in css(b, "#metrics-plot") if int(p.get_attribute("data-points") or 0) > 1],
        60,
    )
    assert plot and css(browser, "#metrics-plot circle.point")
    screenshot(browser, "metrics")
    # the chat's request left a time-to-first-token point on its node (the metrics-collector's series)
    Select(css(browser, "#metrics-metric")[0]).select_by_value("ttft_s")
    wait(browser, lambda b: int(css(b, "#metrics-plot")[0].get_attribute("data-points") or 0) >= 1, 30)


def test_the_traces_view_shows_the_chat_requests_timeline(gateway, browser) -> None:
    show(browser, "traces")

    def chat_requests(b):  # the list refreshes itself while the view is open
        return [item for item in css(b, ".trace-item .trace-pick") if "/v1/chat/completions" in item.text]

    wait(browser, chat_requests, 30)[0].click()
    timeline = "#trace-timeline:not([data-trace-id='']) .trace-bar"

    def whole_trace(b):
        """The bars once the worker's spans are in (they come in their own batch); else fetch again."""
        bars = css(b, timeline)
        if any(bar.get_attribute("data-category") == "decode" for bar in bars):
            return bars
        css(b, '.trace-item[aria-current="true"] .trace-pick')[0].click()
        return None

    bars = wait(browser, whole_trace, 30)
    categories = {bar.get_attribute("data-category") for bar in bars}
    services = {bar.get_attribute("data-service") for bar in bars}
    assert {"http", "tokenize", "route", "queue", "prefill", "decode"} <= categories
    assert {"gateway", "scheduler", "engine-worker"} <= services
    for bar in bars:  # every bar lies on the track
        left, width = (float(bar.value_of_css_property(p).removesuffix("px")) for p in ("left", "width"))
        track = bar.find_element("xpath", "..").size["width"]
        assert 0 <= left and left + width <= track + 1 and width > 0
    stats = css(browser, "#trace-stats tbody tr[data-category]")
    assert {row.get_attribute("data-category") for row in stats} >= {"prefill", "decode"}
    screenshot(browser, "traces")


def test_the_pages_pure_functions(gateway, browser) -> None:
    """The view's pure functions, run in the page's own module: node icons, prefill partners, the
    create-instance body, the timeline's span order and bars."""
    result = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        import("/ui/app.js").then((m) => {
          const span = (id, parent, start, end) =>
            ({ span_id: id, parent_id: parent, start_ns: start, end_ns: end });
          const spans = [span("c", "a", 50, 90), span("a", "", 0, 100), span("b", "a", 10, 40),
                         span("d", "b", 20, 30), span("x", "gone", 60, 61)];
          done({
            nvidia: m.deviceKind({ kind: "cuda" }),
            spark: m.deviceKind({ kind: "cuda", chip: "NVIDIA DGX Spark" }).key,
            apple: m.deviceKind({ kind: "apple" }).key, cpu: m.deviceKind({ kind: "cpu" }).key,
            partners: m.partnersText([{ instance_id: "p1", engine: "vllm", model_id: "x", why: "faster" }]),
            none: m.partnersText(undefined), noneEmpty: m.partnersText([]),
            body: m.instanceBody("x", "", "decode"), pinned: m.instanceBody("x", "vllm", "prefill"),
            scalingUrl: m.scalingUrl("org/a b"), scalingBody: m.scalingBody("0", "3"),
            policy: m.policyText({ enabled: true, min_instances: 0, max_instances: 3, target_utilization: 0.8,
                                   target_queued_tokens: 0, target_ttft_p90_s: 1.5 }),
            noPolicy: m.policyText(undefined),
            rows: m.spanRows(spans).map((r) => [r.span.span_id, r.depth]),
            whole: m.barGeometry(span("a", "", 0, 100), 0, 100),
            tiny: m.barGeometry(span("t", "", 100, 100), 0, 100),
            empty: m.barGeometry(span("e", "", 5, 5), 5, 0),
          });
        }).catch((e) => done({ error: String(e) }));
        """
    )
    assert "error" not in result, result
    assert result["nvidia"] == {"key": "nvidia", "label": "NVIDIA GPU"}  # NodeKind "cuda"
    assert (result["spark"], result["apple"], result["cpu"]) == ("spark", "apple", "cpu")
    assert result["partners"] == "prefill partners: p1 (vllm)"
    assert result["none"] is None and result["noneEmpty"] is None  # a /state without partners
    assert result["body"] == {"model": "x", "role": "decode"}  # no engine: the scheduler picks
    assert result["pinned"] == {"model": "x", "engine": "vllm", "role": "prefill"}
    assert result["scalingUrl"] == "/scaling/org/a%20b"  # the route takes the id's slashes as they are
    assert result["scalingBody"] == {"min_instances": 0, "max_instances": 3, "enabled": True}
    # a 0 target is no signal: not shown
    assert result["policy"] == "on · 0 to 3 instances · targets utilization 80%, TTFT p90 1.5 s"
    assert result["noPolicy"] == "off"
    assert result["rows"] == [["a", 0], ["b", 1], ["d", 2], ["c", 1], ["x", 0]]
    assert result["whole"] == {"left": 0, "width": 100}
    assert result["tiny"]["width"] > 0 and result["tiny"]["left"] + result["tiny"]["width"] <= 100
    assert result["empty"] == {"left": 0, "width": 100}


async def set_scaling(gateway: str, body: dict) -> None:
    async with aiohttp.ClientSession() as session:
        await call(session, "PUT", f"{gateway}/scaling/{MODEL}", body)


async def scaling_of(gateway: str) -> dict:
    async with aiohttp.ClientSession() as session:
        return await call(session, "GET", f"{gateway}/scaling/{MODEL}")


def test_the_models_view_shows_and_sets_the_scaling_policy(gateway, browser) -> None:
    """Last of the module: the policy its form sets drains the model's instance (idle: scale to zero)."""
    from selenium.webdriver.common.keys import Keys

    # idle after 1 s and no delay down: the form's min 0 below makes the autoscaler decide at once
    first = {"min_instances": 1, "max_instances": 1, "idle_s": 1, "scale_down_delay_s": 0}
    first["target_queued_tokens"] = 0  # not a signal: the panel leaves it out
    asyncio.run(set_scaling(gateway.gateway_url, first))
    show(browser, "models")
    card_css = f'.model-card[data-model-id="{MODEL}"]'
    # live: the scheduler's scaling_policy_set event refreshes the view
    panel = f'{card_css} .scaling[data-enabled="true"][data-min="1"][data-max="1"]'
    text = wait(browser, lambda b: [e.text for e in css(b, f"{panel} .scaling-policy")], 30)[0]
    assert text == "on · 1 to 1 instances · targets utilization 80%", text
    card = css(browser, card_css)[0]
    assert card.find_element("css selector", ".scaling-max").get_attribute("value") == "1"
    for field, value in ((".scaling-min", "0"), (".scaling-max", "2")):
        box = card.find_element("css selector", field)
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(value)
    card.find_element("css selector", ".scaling-save").click()
    saved = f'{card_css} .scaling[data-enabled="true"][data-min="0"][data-max="2"]'
    wait(browser, lambda b: css(b, saved), 30)
    policy = asyncio.run(scaling_of(gateway.gateway_url))["policy"]
    # the form's PUT changed the bounds and kept the rest of the policy
    assert (policy["min_instances"], policy["max_instances"], policy["idle_s"]) == (0, 2, 1)
    # nothing asked for the model within idle_s: down to min_instances 0, its instance drains
    down = f'{card_css} .decision[data-kind="scale_down"]'
    decision = wait(browser, lambda b: css(b, down), 60)[0]
    assert decision.get_attribute("data-instance-id")
    assert "drains" in decision.find_element("css selector", ".decision-reason").text
    assert decision.find_element("css selector", "time").text  # when
    assert css(browser, f"{card_css} .decision")[0].get_attribute("data-kind") == "scale_down"  # newest first
    screenshot(browser, "models-scaling")
    card.find_element("css selector", ".scaling-disable").click()  # DELETE /scaling/<model>
    wait(browser, lambda b: css(b, f'{card_css} .scaling[data-enabled="false"]'), 30)
    assert asyncio.run(scaling_of(gateway.gateway_url))["policy"]["enabled"] is False
