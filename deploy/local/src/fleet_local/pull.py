"""`fleet pull MODEL --source SRC`: stage a model through a running gateway, with a progress bar."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from fleet_local.bootstrap import BootstrapError, call


def pull(gateway: str, model: str, source: str, key: str = "", timeout_s: float = 3600.0) -> int:
    """`key`: the gateway's admin key when auth is on."""
    call("POST", f"{gateway}/downloads", {"model": model, "source": source}, key)
    bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=model, file=sys.stderr)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            status = call("GET", f"{gateway}/state", key=key)["downloads"].get(model)
            if status is not None:
                bar.set_postfix_str(status["phase"])
                if status["total_bytes"] and bar.total != status["total_bytes"]:
                    bar.reset(total=status["total_bytes"])
                bar.n = status["done_bytes"]
                bar.refresh()
                if status["phase"] == "done":
                    return 0
                if status["phase"] == "failed":
                    raise BootstrapError(f"staging {model} failed: {status['reason']}")
            time.sleep(0.5)
        raise BootstrapError(f"staging {model}: timed out after {timeout_s:.0f} s")
    finally:
        bar.close()
