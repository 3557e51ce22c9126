"""A run's report: its summary numbers in a table and its metrics per step as plots, written as PNG files and one
self-contained HTML page (the plots embedded), for one run or several side by side (one line per run in every
plot). Written at the end of every job into its output_dir, and by `rlhf-ray report RUN_DIR [RUN_DIR ...]` for
finished or running jobs (what metrics.jsonl holds so far)."""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path

from rlhf_ray.jobs.metrics import METRICS_FILE

REPORT_FILE = "report.html"
PLOTS_DIR = "report"
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("held-out reward", ("eval/reward", "eval/sampled_reward")),
    ("held-out check", ("eval/task_accuracy", "eval/sampled_task_accuracy")),
    ("KL to the reference", ("kl/mean",)),
    ("entropy", ("policy/entropy",)),
    ("answer length (tokens)", ("answer/length",)),
    ("time per iteration (s)", ("time/generate_wait", "time/experience", "time/train", "time/sync")),
    ("training loss", ("train/loss",)),
    ("held-out loss", ("eval_loss",)),
    ("held-out perplexity", ("eval_perplexity",)),
    ("held-out accuracy", ("eval_accuracy", "eval/accuracy")),
)
"""Each plot: its title and the metrics it draws (a plot appears when some run logged one of them)."""


@dataclass
class Run:
    name: str
    folder: Path
    summary: dict
    rows: list[dict]

    @classmethod
    def read(cls, folder: Path) -> Run:
        """A run folder's summary.json (absent while it runs) and metrics.jsonl (a line being written is skipped)."""
        folder = Path(folder)
        metrics = folder / METRICS_FILE
        if not metrics.is_file():
            raise FileNotFoundError(f"{folder} has no {METRICS_FILE}: not a run folder (a job's output_dir)")
        rows = []
        for line in metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        summary_file = folder / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        return cls(folder.resolve().name, folder, summary, rows)

    def series(self, key: str) -> tuple[list[float], list[float]]:
        points = [(r["step"], r[key]) for r in self.rows if key in r and "step" in r]
        return [p[0] for p in points], [p[1] for p in points]

    def errors(self, key: str) -> list[float] | None:
        """The standard errors logged beside `key` (`KEY_se`, e.g. a held-out accuracy's), one per point, or None."""
        steps, _ = self.series(key)
        error_steps, errors = self.series(f"{key}_se")
        return errors if error_steps == steps and steps else None


def summary_rows(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """(key, one cell per run) for every number in the runs' summaries, in first-seen order."""
    keys: dict[str, None] = {}
    for run in runs:
        keys.update({k: None for k, v in run.summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return [(key, [_cell(run.summary.get(key)) for run in runs]) for key in keys]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def draw(ax, run: Run, key: str, label: str | None) -> None:
    """One metric of one run as a line, with error bars of one standard error where the run logged them."""
    steps, values = run.series(key)
    marker = "o" if len(steps) < 30 else None
    errors = run.errors(key)
    if errors is None:
        ax.plot(steps, values, marker=marker, markersize=3, label=label)
    else:
        ax.errorbar(steps, values, yerr=errors, marker=marker, markersize=3, capsize=3, label=label)


def plots(runs: list[Run]) -> list[tuple[str, bytes]]:
    """(title, PNG bytes) of each panel some run has data for."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = []
    for title, keys in PANELS:
        lines = [(run, key) for run in runs for key in keys if run.series(key)[0]]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for run, key in lines:
            label = " ".join(part for part in (run.name if len(runs) > 1 else "", key if len(keys) > 1 else "")
                             if part)
            draw(ax, run, key, label or None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if any(ax.get_legend_handles_labels()[1]):
            ax.legend(fontsize=7)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        plt.close(fig)
        out.append((title, buffer.getvalue()))
    return out


def run_folders(folder: Path) -> list[Path]:
    """The run folders a job's output_dir holds: itself when it has metrics, else its stages' (a pipeline)."""
    folder = Path(folder)
    if (folder / METRICS_FILE).is_file():
        return [folder]
    return sorted(f for f in folder.iterdir() if (f / METRICS_FILE).is_file()) if folder.is_dir() else []


def write_report(folders: list[Path], out: Path) -> Path:
    """The report of the runs in `folders` into `out`: report/<plot>.png and report.html. Returns the page."""
    runs = [Run.read(f) for f in folders]
    out = Path(out)
    (out / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
    figures = plots(runs)
    for title, png in figures:
        (out / PLOTS_DIR / f"{_slug(title)}.png").write_bytes(png)
    page = out / REPORT_FILE
    page.write_text(render_html(runs, figures))
    return page


def _slug(title: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in title).strip("_")


def render_html(runs: list[Run], figures: list[tuple[str, bytes]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(run.name)}</th>" for run in runs)
    body = "".join(f"<tr><td>{e(key)}</td>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>"
                   for key, cells in summary_rows(runs))
    images = "".join(f'<img alt="{e(title)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
                     for title, png in figures)
    steps = ", ".join(f"{e(run.name)}: {max((r.get('step', 0) for r in run.rows), default=0)} steps logged"
                      f"{'' if run.summary else ' (running)'}" for run in runs)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>rlhf_ray report: {e(", ".join(run.name for run in runs))}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:2px 8px;text-align:right}}td:first-child{{text-align:left}}#plots{{display:grid;gap:8px;
grid-template-columns:repeat(auto-fill,minmax(400px,1fr))}}#plots img{{width:100%}}</style>
</head><body>
<h1>rlhf_ray report</h1>
<p>{steps}</p>
<h2>Summary</h2>
<table id="summary"><tr><th></th>{head}</tr>{body}</table>
<h2>Per step</h2>
<div id="plots">{images}</div>
<script>window.addEventListener("load", () => {{
  document.body.dataset.imagesShown = [...document.images].filter(i => i.complete && i.naturalWidth > 0).length;
}});</script>
</body></html>
"""
