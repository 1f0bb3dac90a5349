"""Request stats as the gateway publishes them, with defaults, for the registry tests."""

from __future__ import annotations

from fleet_proto import RequestStats


def stats(model: str = "m", **kw) -> RequestStats:
    fields = dict(
        request_id="r",
        model_id=model,
        instance_id="i",
        node_id="n",
        prompt_tokens=100,
        completion_tokens=10,
        ttft_s=0.2,
        tpot_s=0.02,
        total_s=0.4,
        finish_reason="stop",
    )
    fields.update(kw)
    return RequestStats(**fields)
