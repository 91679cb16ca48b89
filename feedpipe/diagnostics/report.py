"""Report: a `Diagnosis` as an HTML page with plots, viewable offline.

Data flows one way: `feedpipe.diagnostics.diagnosis` measures and returns a `Diagnosis`; this
module only reads it (the `feedpipe diagnose --report` command calls it). The page and its PNGs
live in one directory and reference nothing outside it: the per-step wait against compute, the
staged batches over time (for a `Feeder` input), the three rates side by side, what the feeder
is (its `describe()`, for a `Feeder` input), a glossary line per figure, and what produced the
page (the command, when it was measured, the schema version).
matplotlib draws the plots with its file-only Agg backend, imported here alone, so diagnosing
without a report never needs it.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

from feedpipe._version import __version__
from feedpipe.core.description import FeederDescription
from feedpipe.diagnostics.verdict import SCHEMA_VERSION, Diagnosis

GLOSSARY = {
    "verdict": "the TensorFlow profiler's bands for the input-bound fraction: under 5 % not "
    "input-bound, 5-20 % moderately, 20 % or more highly; cannot tell when the fraction's "
    "bound spans two bands",
    "input-bound fraction": "the share of the together time the step waited for its batch",
    "bound": "the least and most the fraction may be, as the step alone ranged over the "
    "measurements before and after together (derived waits only)",
    "producer alone": "batches per second the input makes when nothing else runs",
    "consumer alone (synthetic)": "steps per second of the step on a batch already on its "
    "devices: the most any input could reach",
    "together": "steps per second of real training, input and step at once",
    "overlap efficiency": "together / the slower of producer alone and consumer alone: 1.0 "
    "when the input is fully hidden behind the step or the step behind the input",
    "real / synthetic": "together / consumer alone: 1.0 when the input costs the step nothing",
    "batches staged": "batches already on the devices when the step asked (device-buffer "
    "occupancy): 0 means the step had to wait",
}
"""One line per figure on the page: what it means and how to read it."""


def require_matplotlib():
    """matplotlib, or an ImportError naming the `[report]` extra; `feedpipe diagnose --report`
    asks first, so that a missing matplotlib is told before a minute of measuring."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            f"needs matplotlib to draw its plots, and it cannot be imported here ({error}); "
            'install it: pip install "feedpipe[report]".'
        ) from error
    return matplotlib


def _pyplot():
    matplotlib = require_matplotlib()
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _timeline(plt, diagnosis: Diagnosis, path: Path) -> None:
    steps = range(1, len(diagnosis.together) + 1)
    compute_ms = [s.compute_s * 1e3 for s in diagnosis.together]
    wait_ms = [s.wait_s * 1e3 for s in diagnosis.together]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar(steps, compute_ms, width=1.0, color="#4c72b0", label="step (compute)")
    ax.bar(steps, wait_ms, width=1.0, bottom=compute_ms, color="#dd8452", label="wait for input")
    ax.set_xlabel("step (together)")
    ax.set_ylabel("ms")
    title = "Per-step wait for input vs compute"
    if diagnosis.waits_derived:
        title += " (waits derived from the consumer-alone time)"
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _occupancy(plt, diagnosis: Diagnosis, path: Path) -> bool:
    staged = [s.staged for s in diagnosis.together]
    if any(value is None for value in staged):
        return False
    fig, ax = plt.subplots(figsize=(9, 2.8))
    ax.step(range(1, len(staged) + 1), staged, where="mid", color="#55a868")
    ax.set_xlabel("step (together)")
    ax.set_ylabel("batches staged")
    ax.set_ylim(bottom=0)
    ax.set_title("Device-buffer occupancy when the step asked (0: the step is starved)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _rates(plt, diagnosis: Diagnosis, path: Path) -> None:
    names = ["producer alone", "consumer alone\n(synthetic)", "together"]
    rates = [
        diagnosis.producer_steps_per_s,
        diagnosis.consumer_steps_per_s,
        diagnosis.together_steps_per_s,
    ]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = ax.bar(names, rates, color=["#dd8452", "#4c72b0", "#8172b3"])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("steps/s")
    ax.set_title("Rates")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _described(feeder: FeederDescription) -> str:
    """The feeder's description as table rows, one a field; nested ones as `source.kind`."""
    rows = []
    for name, value in feeder.to_dict().items():
        inner = value if isinstance(value, dict) else {"": value}
        for key, item in inner.items():
            label = f"{name}.{key}" if key else name
            shown = ", ".join(map(str, item)) if isinstance(item, list) else str(item)
            rows.append(f"<tr><th>{html.escape(label)}</th><td>{html.escape(shown)}</td></tr>")
    return "\n".join(rows)


def write_report(
    diagnosis: Diagnosis, directory: str | os.PathLike, *, command: str | None = None
) -> Path:
    """Writes `index.html` and its plots into `directory` (made if missing); returns the page.

    `command` is the command line that measured it, shown at the top of the page.
    """
    plt = _pyplot()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _timeline(plt, diagnosis, out / "timeline.png")
    has_occupancy = _occupancy(plt, diagnosis, out / "occupancy.png")
    if not has_occupancy:
        (out / "occupancy.png").unlink(missing_ok=True)  # a stale plot of an earlier report
    _rates(plt, diagnosis, out / "rates.png")

    e = html.escape
    low, high = diagnosis.input_bound_range
    rows = [
        ("verdict", diagnosis.verdict),
        ("input-bound fraction", f"{diagnosis.input_bound_fraction:.1%}"),
    ]
    if diagnosis.step_alone_range_s is not None:
        rows.append(("bound", f"{low:.1%} to {high:.1%}"))
    rows += [
        ("producer alone", f"{diagnosis.producer_steps_per_s:,.1f} steps/s"),
        ("consumer alone (synthetic)", f"{diagnosis.consumer_steps_per_s:,.1f} steps/s"),
        ("together", f"{diagnosis.together_steps_per_s:,.1f} steps/s"),
        ("overlap efficiency", f"{diagnosis.overlap_efficiency:.2f}"),
        ("real / synthetic", f"{diagnosis.real_over_synthetic:.2f}"),
        ("input", diagnosis.input_kind),
        ("step", diagnosis.step_kind),
        ("batch", f"{diagnosis.batch_bytes / 2**20:,.2f} MiB"),
    ]
    table = "\n".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows)
    remedies = "\n".join(
        f"<li><b>{e(r.action)}</b>: up to {r.expected_steps_per_s:,.1f} steps/s "
        f"({r.gain:.2f}x)<br>{e(r.why)}</li>"
        for r in diagnosis.remedies
    )
    occupancy = (
        '<img src="occupancy.png" alt="device-buffer occupancy">'
        if has_occupancy
        else f"<p>Not measured: device-buffer occupancy is read from an fp.Feeder, and this "
        f"input is {e(diagnosis.input_kind)}.</p>"
    )
    feeder = (
        ""
        if diagnosis.feeder is None
        else f"<h2>The feeder</h2>\n<table>\n{_described(diagnosis.feeder)}\n</table>"
    )
    glossary = "\n".join(
        f"<dt>{e(name)}</dt><dd>{e(meaning)}</dd>" for name, meaning in GLOSSARY.items()
    )
    made = [
        ("command", command or "feedpipe.diagnose(...) from Python"),
        ("measured", diagnosis.measured_at or "unknown"),
        ("feedpipe", __version__),
        ("schema version", str(SCHEMA_VERSION)),
    ]
    provenance = "\n".join(f"<tr><th>{e(k)}</th><td><code>{e(v)}</code></td></tr>" for k, v in made)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>feedpipe diagnose: {e(diagnosis.verdict)}</title>
<meta name="feedpipe-schema-version" content="{SCHEMA_VERSION}">
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}
th{{text-align:left;padding-right:2em}}img{{max-width:100%}}dt{{font-weight:bold}}</style></head>
<body>
<h1>{e(diagnosis.verdict)}</h1>
<table>
{provenance}
</table>
<h2>Figures</h2>
<table>
{table}
</table>
<h2>Remedies, by the rate each could reach</h2>
<ol>
{remedies}
</ol>
<h2>Wait vs compute, step by step</h2>
<img src="timeline.png" alt="per-step wait and compute">
<h2>Device-buffer occupancy</h2>
{occupancy}
<h2>Rates</h2>
<img src="rates.png" alt="producer, consumer and together rates">
{feeder}
<h2>Glossary</h2>
<dl>
{glossary}
</dl>
</body></html>
"""
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index
