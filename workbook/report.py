"""Write OUT/report.html: one self-contained page with the measurements and plots of every executed notebook."""

from __future__ import annotations

import html
import json
from pathlib import Path

VALUE_CHARS = 300


def read_notebook(path: str | Path):
    """Read a notebook file (nbformat 4)."""
    import nbformat
    return nbformat.read(path, as_version=4)


def format_value(name: str, value) -> str:
    """Format one measurement for the report (thousands separators, MiB for *_bytes, 4 significant digits)."""
    if isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, int):
        text = f"{value:,}"
        if name.endswith("_bytes"):
            text += f" ({value / 2**20:,.1f} MiB)"
    elif isinstance(value, float):
        text = f"{value:.4g}"
        if name.endswith("_bytes"):
            text += f" ({value / 2**20:,.1f} MiB)"
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."


def _images(executed: Path) -> list[tuple[str | None, str]]:
    """Return (nearest preceding markdown heading, base64 PNG) for every image output, in order."""
    if not executed.exists():
        return []
    try:
        nb = read_notebook(executed)
    except Exception:
        return []
    heading, found = None, []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.lstrip().startswith("#"):
                    heading = line.lstrip().lstrip("#").strip() or heading
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                found.append((heading, "".join(png).replace("\n", "") if isinstance(png, list) else png.replace("\n", "")))
    return found


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{margin-bottom:.2em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.8em 0}td,th{border:1px solid #ddd;padding:.3em .7em;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#17702f;font-weight:600}.failed{color:#b00020;font-weight:600}
pre{background:#fff4f4;border:1px solid #e8b4b4;padding:.8em;overflow-x:auto;white-space:pre-wrap}
figure{margin:1.2em 0}figcaption{font-size:.85em;color:#555;margin-bottom:.3em}img{max-width:100%}
.meta{color:#555}code{font-size:.95em}
"""


def write_report(results: dict, out_dir: str | Path) -> Path:
    """Write OUT/report.html: a self-contained page with the measurements and plots of every notebook."""
    out_dir = Path(out_dir)
    esc = html.escape
    notebooks = results.get("notebooks", {})
    total = sum(float(e.get("wall_s", 0.0)) for e in notebooks.values())
    params = results.get("parameters") or {}
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        "<title>Fit the Model: batch run report</title>", f"<style>{_CSS}</style></head><body>",
        "<h1>Fit the Model: batch run report</h1>", '<p class="meta">',
        f"Hardware: {esc(str(results.get('hardware', '?')))}<br>",
        f"torch: {esc(str(results.get('torch', '?')))}<br>",
        f"Generated (UTC): {esc(str(results.get('generated_utc', '?')))}<br>",
        f"Total wall time: {total:,.1f} s<br>",
        f"Parameters: {esc(json.dumps(params)) if params else 'none'}</p>",
        "<table><tr><th>Notebook</th><th>Status</th><th>Wall s</th><th>Measurements</th></tr>",
    ]
    for stem, entry in notebooks.items():
        status = str(entry.get("status", "?"))
        parts.append(
            f'<tr><td><a href="#{esc(stem)}">{esc(stem)}</a></td><td class="{esc(status)}">{esc(status)}</td>'
            f'<td class="num">{float(entry.get("wall_s", 0.0)):,.1f}</td>'
            f'<td class="num">{len(entry.get("measurements", {}))}</td></tr>'
        )
    parts.append("</table>")
    for stem, entry in notebooks.items():
        status = str(entry.get("status", "?"))
        parts.append(f'<section id="{esc(stem)}"><h2>{esc(stem)}</h2>')
        parts.append(
            f'<p>Status: <span class="{esc(status)}">{esc(status)}</span> &middot; '
            f'wall {float(entry.get("wall_s", 0.0)):,.1f} s &middot; '
            f'executed notebook: <code>{esc(str(entry.get("executed", "")))}</code></p>'
        )
        if entry.get("error"):
            parts.append(f"<pre>{esc(str(entry['error']))}</pre>")
        measurements = entry.get("measurements", {})
        if measurements:
            parts.append("<table><tr><th>Measurement</th><th>Value</th></tr>")
            for name, value in measurements.items():
                parts.append(f'<tr><td><code>{esc(name)}</code></td><td class="num">{esc(format_value(name, value))}</td></tr>')
            parts.append("</table>")
        else:
            parts.append("<p class=\"meta\">No measurements recorded.</p>")
        problems = entry.get("figure_problems") or []
        if problems:
            parts.append(f"<p>Figure check (<code>workbook.figcheck</code>): {len(problems)} problem(s)</p>")
            parts.append("<table><tr><th>Cell</th><th>Figure</th><th>Problem</th></tr>")
            for p in problems:
                parts.append(f'<tr><td class="num">{esc(str(p.get("cell")))}</td><td>{esc(str(p.get("figure")))}</td>'
                             f'<td>{esc(str(p.get("problem")))}</td></tr>')
            parts.append("</table>")
        if entry.get("executed"):
            for heading, png in _images(out_dir / entry["executed"]):
                caption = f"<figcaption>{esc(heading)}</figcaption>" if heading else ""
                parts.append(f'<figure>{caption}<img alt="{esc(heading or stem)}" src="data:image/png;base64,{png}"></figure>')
        parts.append("</section>")
    parts.append("</body></html>")
    target = out_dir / "report.html"
    out_dir.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return target
