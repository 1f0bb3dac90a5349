"""Markdown for the README from a suite run's results: pure functions over the result dicts."""

from __future__ import annotations

import math

BEGIN = "<!-- bench:begin (written by make bench; edits are overwritten) -->"
END = "<!-- bench:end -->"


def number(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    """value * scale with thousands separators, or a dash for a missing (None / NaN) figure."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value * scale:,.{digits}f}"


def _find(workloads: dict, prompt: int | None, concurrency: int) -> dict | None:
    """The workload with this concurrency and prompt length (None: the shortest prompt)."""
    matches = [e for e in workloads.values() if e["workload"]["concurrency"] == concurrency]
    if prompt is not None:
        matches = [e for e in matches if e["workload"]["prompt_tokens"] == prompt]
    return min(matches, key=lambda e: e["workload"]["prompt_tokens"], default=None)


def _prompt_size(entry: dict) -> int:
    """Prompt tokens as the servers counted them (chat template included), else as asked for."""
    counted = [s.get("prompt_tokens_p50", 0) for s in entry["sides"].values()]
    return int(max(counted, default=0)) or entry["workload"]["prompt_tokens"]


def _cell(entry: dict | None, side: str, metric: str, ratio_key: str, digits: int, scale: float = 1.0) -> str:
    if entry is None or side not in entry["sides"]:
        return "—"
    value = number(entry["sides"][side][metric], digits, scale)
    ratio = entry["ratios"].get(side)
    if ratio is not None and not math.isnan(ratio[ratio_key]):
        value += f" ({ratio[ratio_key]:.2f})"
    return value


def compare_table(compare: dict) -> str:
    """One row per side: TTFT and decode at 1 stream, aggregate at 8, TTFT of the longest prompt;
    a peer's cell carries Fleet / peer in parentheses (from back-to-back round pairs)."""
    workloads = compare["workloads"]
    short_1 = _find(workloads, None, 1)
    short_8 = _find(workloads, short_1["workload"]["prompt_tokens"] if short_1 else None, 8)
    longest = max((e["workload"]["prompt_tokens"] for e in workloads.values()), default=0)
    long_1 = (
        _find(workloads, longest, 1) if short_1 and longest > short_1["workload"]["prompt_tokens"] else None
    )
    p_short = _prompt_size(short_1) if short_1 else "?"
    header = [
        "side",
        "compared with",
        f"TTFT ms, {p_short}-token prompt, 1 stream",
        "decode tok/s, 1 stream",
        "aggregate tok/s, 8 streams",
    ]
    if long_1:
        header.append(f"TTFT ms, {_prompt_size(long_1)}-token prompt")
    header.append("peak memory MiB, 8 streams")
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for side, label in compare["sides"].items():
        baseline = compare["baselines"].get(side, "")
        cells = [
            label,
            compare["sides"].get(baseline, "") if baseline else "",
            _cell(short_1, side, "ttft_s_p50", "ttft_s", 0, 1000),
            _cell(short_1, side, "decode_tps_per_stream_p50", "decode_tps_per_stream", 1),
            _cell(short_8, side, "aggregate_tps_p50", "aggregate_tps", 1),
        ]
        if long_1:
            cells.append(_cell(long_1, side, "ttft_s_p50", "ttft_s", 0, 1000))
        memory = short_8["sides"].get(side, {}).get("peak_rss_bytes") if short_8 else None
        cells.append(number(memory, 0, 2**-20) if memory else "—")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_link(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return f"[{name.removesuffix('.png')}](bench/results/{name})"


def generation_note(compare: dict) -> str:
    """Whether every side did the same work: all requests generated the asked-for token count."""
    short = [
        f"{name} {summary['completion_tokens_p50']:g} of {entry['workload']['gen_tokens']} ({label})"
        for label, entry in compare["workloads"].items()
        for name, summary in entry["sides"].items()
        if summary["completion_tokens_p50"] != entry["workload"]["gen_tokens"]
    ]
    if short:
        return "Sides stopped early (median tokens generated): " + "; ".join(short) + "."
    return "Every side generated every request's full token count."


def other_lines(results: dict) -> list[str]:
    """One line per other benchmark of the suite, ratios first."""
    lines = []
    if control := results.get("control_plane"):
        r, n, g = control["routing"], control["nats"], control["gateway"]
        lines.append(
            "- **Control plane** (`fleet bench control-plane`): the scheduler answers "
            f"{r['sequential_decisions_per_s']:,.0f} routing decisions/s one at a time "
            f"({r['decisions_per_s_16_in_flight']:,.0f}/s with 16 in flight; `route()` alone "
            f"{r['pure_route_decisions_per_s']:,.0f}/s), a round trip "
            f"{r['ratio_route_over_bare_echo_p50']:.2f}x a bare NATS echo; with the echo engine a "
            f"1-token chat completion takes {g['chat_1_token_ms_p50']:.1f} ms p50 "
            f"({g['added_over_http_floor_ms_p50']:.1f} ms over `GET /health`), "
            f"{g['requests_per_s_16_in_flight']:,.0f} requests/s at 16 in flight, streams carry "
            f"{g['stream_tokens_per_s_1_stream']:,.0f} tok/s (1) / "
            f"{g['stream_tokens_per_s_8_streams']:,.0f} tok/s (8); NATS core "
            f"{n['core_publish_msgs_per_s']:,.0f} msg/s published, JetStream "
            f"{n['jetstream_acked_publish_msgs_per_s']:,.0f} acked msg/s."
        )
    if kv := results.get("kv"):
        lines.append(
            f"- **KV tiers** (`fleet bench kv`, {kv['model']}): TTFT of a "
            f"{kv['cold']['prompt_tokens']}-token prompt warm from object storage "
            f"{kv['ratio_object_storage_over_cold']:.3f}x cold, warm in memory "
            f"{kv['ratio_memory_over_cold']:.3f}x cold."
        )
    if disagg := results.get("disagg"):
        longest = max(disagg["sweep"], key=lambda s: s["pp"])
        lines.append(
            f"- **Disaggregation** (`fleet bench disagg`, {disagg['model']}, "
            f"{disagg['prefill_engine']} prefill -> {disagg['decode_engine']} decode): TTFT of a "
            f"{longest['colocated']['prompt_tokens']}-token prompt over the stream "
            f"{longest['ttft_stream_over_colocated']:.2f}x colocated, staged "
            f"{longest['ttft_staged_over_colocated']:.2f}x."
        )
    if serve := results.get("serve"):
        plots = ", ".join(plot_link(p) for p in serve.get("plots", []))
        engine = f" on {serve['engine']}" if serve.get("engine") else ""
        lines.append(f"- **Serving sweep** (`fleet bench serve`, {serve['model']}{engine}): {plots}.")
    return lines


def readme_block(results: dict, machine: dict, at: str) -> str:
    parts = [
        BEGIN,
        f"Measured {at} on {machine['summary']} by `make bench` (`bench/results/latest.json`). "
        "Every figure is from one run with the sides taking turns; absolute numbers describe this "
        "machine only — read the ratios (Fleet / peer, in parentheses: above 1 is better for Fleet in "
        "tok/s, below 1 in TTFT).",
        "",
    ]
    if compare := results.get("compare"):
        parts += [
            f"{compare['model']}, greedy, p50 of {compare['repeats']} rounds per side; MLX sides skip "
            f"prompts over {compare.get('mlx_max_prompt', 128)} tokens. {generation_note(compare)}",
            "",
            compare_table(compare),
            "",
            "Aggregate tok/s against concurrency: "
            + ", ".join(plot_link(p) for p in compare.get("plots", []))
            + ".",
        ]
        if compare["unavailable"]:
            missing = "; ".join(f"{k} ({v})" for k, v in compare["unavailable"].items())
            parts += ["", f"Not run: {missing}."]
    parts += ["", *other_lines(results), END]
    return "\n".join(parts)


def replace_block(text: str, block: str) -> str:
    """`text` with its bench block replaced by `block` (ValueError when it has no block)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError("the README has no bench block (its begin and end markers)")
    return text[:start] + block + text[end + len(END) :]
