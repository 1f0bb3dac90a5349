"""The dashboard's shipped files: each one the page links is in the package, and nothing else is
reachable through /ui/<name>; the lists the page keeps of the gateway's names (events, engines,
instance roles, node kinds) are complete, and the scaling panel speaks the policy's field names."""

from __future__ import annotations

import inspect
import re

import pytest

from fleet_gateway.admin import INSTANCE_ROLES, CreateInstanceBody
from fleet_gateway.dashboard_routes import ASSETS, asset
from fleet_gateway.errors import ApiError
from fleet_gateway.scaling_routes import ScalingBody
from fleet_proto import events
from fleet_proto.common import NodeKind
from fleet_proto.engines import ENGINE_FACTS
from fleet_proto.scaling import ModelScaling, ScalingDecision, ScalingPolicy
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


def js_list(name: str) -> list[str]:
    listed = re.search(rf"const {name} = \[(.*?)\];", (ASSETS / "app.js").read_text(), re.DOTALL)
    assert listed, name
    return re.findall(r'"([a-z_]+)"', listed.group(1))


def test_the_create_form_offers_every_engine_and_role_the_gateway_takes() -> None:
    assert js_list("SERVING_ENGINES") == list(ENGINE_FACTS)
    assert js_list("INSTANCE_ROLES") == list(INSTANCE_ROLES)
    source = (ASSETS / "app.js").read_text()
    body = re.search(r"export function instanceBody\(.*?\n}", source, re.DOTALL)
    assert body and "engine" in body.group(0) and "role" in body.group(0)
    assert set(re.findall(r"(\w+): ", body.group(0))) <= set(CreateInstanceBody.__struct_fields__)


def test_each_node_kind_has_its_icon() -> None:
    """NVIDIA nodes say "cuda" (NodeKind), not "nvidia": the icon follows the kind the nodes send."""
    kind = re.search(
        r"export function deviceKind\(node\) \{(.*?)\n}", (ASSETS / "app.js").read_text(), re.DOTALL
    )
    assert kind
    tested = set(re.findall(r'kind === "([a-z]+)"', kind.group(1)))
    assert tested == {k.value for k in NodeKind} - {NodeKind.CPU.value}  # cpu: the fallback


def test_the_scaling_panel_reads_and_sends_only_the_policys_fields() -> None:
    """The form's PUT body takes fields the admin API knows; the panel reads fields the State has."""
    source = (ASSETS / "app.js").read_text()
    body = re.search(r"export function scalingBody\(.*?\n}", source, re.DOTALL)
    assert body
    sent = set(re.findall(r"(\w+): ", body.group(0)))
    assert {"min_instances", "max_instances", "enabled"} <= sent <= set(ScalingBody.__struct_fields__)
    read = set(re.findall(r"policy\??\.(\w+)", source)) | set(re.findall(r"saved\.(\w+)", source))
    assert read and read <= set(ScalingPolicy.__struct_fields__), read - set(ScalingPolicy.__struct_fields__)
    decisions = set(re.findall(r"decision\.(\w+)", source))
    assert decisions == set(ScalingDecision.__struct_fields__)  # kind, instance, reason and time all show
    assert set(ModelScaling.__struct_fields__) <= set(re.findall(r"scaling\?\.(\w+)", source))
