"""The run's report: one self-contained HTML page made from a manifest's body alone.

``render(manifest)`` is a pure function, so the job writes the page beside the manifest when it publishes and
anyone can make it again later from a published ``_manifest.json``. The page fetches nothing: styles are
inline, the charts are inline SVG, there is no script, and its Content-Security-Policy forbids scripts and
network fetches, so even a value that slipped past the escaping could neither run nor call out. Every value
taken from the manifest is escaped (model names, run ids and error reasons come from users and their data).
"""

from __future__ import annotations

import html
from typing import Any, Mapping, Sequence

CSP = "default-src 'none'; style-src 'unsafe-inline'"
WIDTH, HEIGHT, PAD = 640, 220, 44

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:900px;color:#1c2430;padding:0 16px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #dde3ea}
.sub{color:#5a6675}.figs{display:flex;flex-wrap:wrap;gap:10px;margin:16px 0}
.fig{border:1px solid #dde3ea;border-radius:6px;padding:8px 12px;min-width:120px}
.fig b{display:block;font-size:20px}.fig span{color:#5a6675;font-size:12px}
table{border-collapse:collapse;width:100%}td,th{text-align:left;padding:3px 8px;border-bottom:1px solid #eef1f4}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}code{font-size:12px;word-break:break-all}
.bar{background:#d9534f;height:10px;display:inline-block}svg text{font-size:11px;fill:#5a6675}
"""
PHASE_COLOURS = ("#8aa4c8", "#e0a458", "#4f9d69", "#9b7bb8")


def esc(value: Any) -> str:
    """Text or attribute value, escaped (quotes too)."""
    return html.escape("" if value is None else str(value), quote=True)


def number(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:,.{digits}f}"
    return esc(value)


def phases(manifest: Mapping[str, Any]) -> list[tuple[str, float]]:
    """Where the job's seconds went, from the driver's timeline: (name, seconds), in order, each a span between
    two moments the driver recorded (a phase whose ends were not recorded is left out)."""
    timeline = manifest.get("timeline") or {}
    plan = timeline.get("plan_started_s")
    ready = timeline.get("engine_ready_s")
    stream_end = timeline.get("stream_done_s") or timeline.get("last_answer_s")
    end = manifest.get("wall_time_s")
    spans = [
        ("start-up and checks", 0.0, plan),
        ("engine start (input read meanwhile)", plan, ready),
        ("streaming: answering and writing", ready if ready is not None else plan, stream_end),
        ("checks and publish", stream_end, end),
    ]
    return [(name, max(0.0, b - a)) for name, a, b in spans if a is not None and b is not None]


def answering_seconds(manifest: Mapping[str, Any]) -> float | None:
    """Seconds the engine or endpoint was answering: from its start (the engine ready, else the plan's start)
    to the end of the stream."""
    timeline = manifest.get("timeline") or {}
    start = timeline.get("engine_ready_s")
    if start is None:
        start = timeline.get("plan_started_s")
    end = timeline.get("stream_done_s") or timeline.get("last_answer_s")
    if start is None or end is None or end - start <= 0:
        return None
    return float(end - start)


def _figure(value: str, label: str, element_id: str = "") -> str:
    at = f' id="{element_id}"' if element_id else ""
    return f'<div class="fig"><b{at}>{value}</b><span>{esc(label)}</span></div>'


def _cost(manifest: Mapping[str, Any]) -> str:
    cost = manifest.get("estimated_cost")
    if cost is None:
        return _figure("not priced", "cost (no price given)")
    per_million = manifest.get("cost_per_million_output_tokens")
    extra = f", {number(per_million, 4)} per 1M tokens out" if per_million is not None else ""
    return _figure(number(cost, 4), f"estimated cost{extra}")


def _rows_chart(manifest: Mapping[str, Any]) -> str:
    """Rows answered over the job's seconds: a line through the driver's samples, moments as dashed marks."""
    points = [(float(p["t_s"]), float(p["rows"])) for p in manifest.get("rows_over_time") or []]
    timeline = manifest.get("timeline") or {}
    span = max([float(manifest.get("wall_time_s") or 0.0)] + [t for t, _ in points] + [1.0])
    top = max([float(manifest.get("rows_in") or 0)] + [r for _, r in points] + [1.0])
    start = timeline.get("plan_started_s") or 0.0
    # Steps: the rows stay as they were until the next sample, then rise to it.
    line, done = [(float(start), 0.0)], 0.0
    for t, r in sorted(points):
        line += [(t, done), (t, r)]
        done = r

    def x(t: float) -> float:
        return PAD + (WIDTH - 2 * PAD) * t / span

    def y(r: float) -> float:
        return HEIGHT - PAD + (2 * PAD - HEIGHT) * r / top

    marks: list[str] = []
    for key, label in (
        ("engine_ready_s", "engine ready"),
        ("first_output_file_s", "first file"),
        ("stream_done_s", "stream done"),
    ):
        at = timeline.get(key)
        if at is not None:
            marks.append(
                f'<line x1="{x(at):.1f}" y1="{PAD - 10}" x2="{x(at):.1f}" y2="{HEIGHT - PAD}" stroke="#aab4c0" '
                f'stroke-dasharray="3,3"><title>{esc(label)} at {at:.1f} s</title></line>'
                f'<text x="{x(at) + 3:.1f}" y="{PAD - 12 + 12 * len(marks)}">{esc(label)}</text>'
            )
    path = " ".join(f"{x(t):.1f},{y(r):.1f}" for t, r in line)
    dots = "".join(
        f'<circle cx="{x(t):.1f}" cy="{y(r):.1f}" r="2.5" fill="#2f6db5"><title>{r:.0f} rows at {t:.1f} s</title></circle>'
        for t, r in points
    )
    axes = (
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#5a6675"/>'
        f'<line x1="{PAD}" y1="{PAD - 10}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#5a6675"/>'
        f'<text x="{PAD}" y="{HEIGHT - PAD + 16}">0 s</text>'
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 16}" text-anchor="end">{span:.0f} s</text>'
        f'<text x="{PAD - 6}" y="{HEIGHT - PAD}" text-anchor="end">0</text>'
        f'<text x="{PAD - 6}" y="{y(top) + 4:.1f}" text-anchor="end">{top:.0f}</text>'
        f'<text x="{WIDTH / 2:.0f}" y="{HEIGHT - PAD + 16}" text-anchor="middle">seconds since the driver started</text>'
        f'<text x="{PAD + 6}" y="{HEIGHT - PAD - 6}">rows answered</text>'
    )
    return (
        f'<svg class="chart" id="rows-over-time" role="img" aria-label="rows answered over time" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" width="100%">{axes}{"".join(marks)}'
        f'<polyline fill="none" stroke="#2f6db5" stroke-width="2" points="{path}"/>{dots}</svg>'
    )


def _phases_chart(manifest: Mapping[str, Any]) -> str:
    spans = phases(manifest)
    total = sum(s for _, s in spans) or 1.0
    rects, rows, at = [], [], 0.0
    for (name, seconds), colour in zip(spans, PHASE_COLOURS):
        w = (WIDTH - 2) * seconds / total
        rects.append(
            f'<rect x="{1 + at:.1f}" y="4" width="{w:.1f}" height="22" fill="{colour}">'
            f"<title>{esc(name)}: {seconds:.1f} s</title></rect>"
        )
        rows.append(
            f'<tr><td><span class="bar" style="background:{colour};width:10px"></span> {esc(name)}</td>'
            f'<td class="n">{seconds:.1f} s</td><td class="n">{100 * seconds / total:.0f}%</td></tr>'
        )
        at += w
    svg = (
        f'<svg class="chart" id="seconds" role="img" aria-label="where the seconds went" viewBox="0 0 {WIDTH} 30" '
        f'width="100%">{"".join(rects)}</svg>'
    )
    return f"{svg}<table>{''.join(rows)}</table>"


def _errors(manifest: Mapping[str, Any]) -> str:
    reasons: Mapping[str, int] = manifest.get("errors_by_reason") or {}
    if not reasons:
        return "<p>No error rows.</p>"
    top = max(reasons.values()) or 1
    rows = "".join(
        f'<tr><td>{esc(reason)}</td><td class="n">{number(count)}</td>'
        f'<td><span class="bar" style="width:{200 * count / top:.0f}px"></span></td></tr>'
        for reason, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    return (
        f'<table id="errors"><tr><th>reason</th><th class="n">rows</th><th></th></tr>{rows}</table>'
        f"<p>The error rows, each with its input and reason: <code>{esc(manifest.get('errors_folder'))}</code></p>"
        f"{_files(manifest.get('error_files') or [])}"
    )


def _files(files: Sequence[Mapping[str, Any]]) -> str:
    rows = "".join(
        f'<tr><td><code>{esc(f.get("uri"))}</code></td><td class="n">{number(f.get("rows"))}</td>'
        f'<td class="n">{number(f.get("bytes"))}</td></tr>'
        for f in files
    )
    return f'<table><tr><th>file</th><th class="n">rows</th><th class="n">bytes</th></tr>{rows}</table>'


def _incremental(manifest: Mapping[str, Any]) -> str:
    """An incremental run's rows reused from its base, computed and dropped, and the base it read."""
    inc = manifest.get("incremental")
    if not inc:
        return ""
    figures = "".join(
        (
            _figure(number(inc.get("rows_reused")), "rows reused", "rows-reused"),
            _figure(number(inc.get("rows_computed")), "rows computed", "rows-computed"),
            _figure(number(inc.get("rows_dropped")), "rows dropped"),
        )
    )
    base = inc.get("base")
    said = f"<code>{esc(base)}</code>" if base else "none found: every row was computed"
    return (
        f'<h2>Incremental</h2><div class="figs">{figures}</div>'
        f'<p class="sub">Base run: {said}; rows keyed by <code>{esc(inc.get("key"))}</code> and their request.</p>'
    )


def render(manifest: Mapping[str, Any]) -> str:
    """The report page for a manifest's body (as published in ``_manifest.json`` or returned to XCom)."""
    run = manifest.get("run") or {}
    answering = answering_seconds(manifest)
    tokens_out = manifest.get("output_tokens") or 0
    rate = tokens_out / answering if answering else None
    title = f"{run.get('dag_id', '')} / {run.get('task_id', '')}: {run.get('run_id', '')}"
    figures = "".join(
        (
            _figure(number(manifest.get("rows_out")), "rows out", "rows-out"),
            _figure(number(manifest.get("rows_in")), "rows in"),
            _figure(number(manifest.get("rows_errored")), "error rows"),
            _figure(number(manifest.get("rows_resumed")), "rows resumed"),
            _figure(number(manifest.get("input_tokens")), "tokens in"),
            _figure(number(tokens_out), "tokens out"),
            _figure(number(rate, 1), "tokens out per second answering"),
            _figure(number(manifest.get("wall_time_s"), 1) + " s", "wall time"),
            _cost(manifest),
        )
    )
    versions = ", ".join(f"{esc(k)} {esc(v)}" for k, v in sorted((manifest.get("versions") or {}).items()))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Run report: {esc(title)}</title><style>{STYLE}</style></head>
<body>
<h1>Run report: {esc(title)}</h1>
<p class="sub">{esc(manifest.get("status"))}: {esc(manifest.get("kind"))} {esc(manifest.get("task_type"))} with
<code>{esc(manifest.get("model"))}</code>; {esc(manifest.get("started_at"))} to {esc(manifest.get("finished_at"))};
Ray submission <code>{esc(manifest.get("submission_id"))}</code></p>
<div class="figs">{figures}</div>
{_incremental(manifest)}
<h2>Rows over time</h2>{_rows_chart(manifest)}
<h2>Where the seconds went</h2>{_phases_chart(manifest)}
<p class="sub">Seconds from the job's driver start (connected to Ray) to its manifest; the engine starts while the
input is read, so "engine start" includes reading.</p>
<h2>Error rows by reason</h2>{_errors(manifest)}
<h2>Output</h2><p><code>{esc(manifest.get("outputs_folder"))}</code> ({esc(manifest.get("format"))})</p>
{_files(manifest.get("output_files") or [])}
<p class="sub">Generation <code>{esc(manifest.get("generation"))}</code>; {versions}</p>
</body></html>
"""
