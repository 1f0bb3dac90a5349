"""The dashboard's shipped files: each one the page links is in the package, and nothing else is
reachable through /ui/<name>."""

from __future__ import annotations

import inspect
import re

import pytest

from fleet_gateway.dashboard_routes import ASSETS, asset
from fleet_gateway.errors import ApiError
from fleet_proto import events
from fleet_proto.subjects import event_subject
from fleet_proto.traces import SPAN_CATEGORIES

pytestmark = pytest.mark.unit


def test_the_page_links_only_shipped_assets_and_no_other_origin() -> None:
    page = (ASSETS / "index.html").read_text()
    linked = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert linked and all(link.startswith("/ui/") for link in linked), linked
    for link in linked:
        assert (ASSETS / link.removeprefix("/ui/")).is_file()
    for name in ("index.html", "app.js", "style.css"):
        text = (ASSETS / name).read_text().replace("http://www.w3.org/", "")  # XML namespaces fetch nothing
        assert "http://" not in text and "https://" not in text  # no CDN: the cluster may be offline


@pytest.mark.parametrize("name", ["../main.py", ".hidden.js", "missing.js", "main.py", "app.js/x"])
def test_anything_else_is_a_404(name: str) -> None:
    with pytest.raises(ApiError) as missing:
        asset(name)
    assert missing.value.status == 404


def test_a_shipped_file_is_served_with_its_type() -> None:
    response = asset("app.js")
    assert response.headers["Content-Type"].startswith("text/javascript")


def test_the_page_listens_to_every_named_event_of_the_stream() -> None:
    kinds = [c for _, c in inspect.getmembers(events, inspect.isclass) if issubclass(c, events.EventBase)]
    names = {event_subject(kind).rsplit(".", 1)[-1] for kind in kinds if kind is not events.EventBase}
    listed = re.search(r"const EVENT_NAMES = \((.*?)\)\.split", (ASSETS / "app.js").read_text(), re.DOTALL)
    assert listed
    assert set(re.findall(r"[a-z_]+", listed.group(1))) == names


def test_the_timeline_has_a_colour_for_every_span_category() -> None:
    styled = set(re.findall(r'\[data-category="([a-z]+)"\]', (ASSETS / "style.css").read_text()))
    assert styled == set(SPAN_CATEGORIES)
