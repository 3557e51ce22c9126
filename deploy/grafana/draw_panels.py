"""Draws the panels of deploy/grafana/rlhf_ray.json from a running Prometheus into one PNG: the same queries Grafana
runs, for one run, over a time range. For docs and reports where no Grafana is at hand (docs/img/dashboard.png
was drawn this way: Grafana is not a Debian package).

    .venv/bin/python deploy/grafana/draw_panels.py --prometheus http://127.0.0.1:9090 --run ppo-ppo \
        --since 600 --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

BOARD = Path(__file__).resolve().parent / "rlhf_ray.json"


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL with its $run variable) of every target of every panel of a dashboard."""
    return [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel["targets"]]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float, timeout: float = 30) -> list[dict]:
    """The series Prometheus' HTTP API gives for `expr` over [start, end] (a refused query raises, naming it)."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus.rstrip('/')}/api/v1/query_range?{params}", timeout=timeout) as answer:
        body = json.loads(answer.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def draw(prometheus: str, run: str, start: float, end: float, out: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = json.loads(BOARD.read_text())
    panels = board["panels"]
    columns = 3
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 2.9 * rows), squeeze=False)
    step = max(1.0, (end - start) / 400)
    empty = []
    for ax, panel in zip(axes.flat, panels):
        drawn = 0
        for target in panel["targets"]:
            legend = target.get("legendFormat", "").replace("{{run}}", "").strip()
            for series in query_range(prometheus, target["expr"].replace("$run", run), start, end, step):
                times = [(float(t) - start) / 60 for t, _ in series["values"]]
                ax.plot(times, [float(v) for _, v in series["values"]], label=legend, linewidth=1.4)
                drawn += 1
        if not drawn:
            empty.append(panel["title"])
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(panel["targets"]) > 1:
            ax.legend(fontsize=7, loc="best")
        if panel.get("fieldConfig", {}).get("defaults", {}).get("unit") == "bytes":
            ax.yaxis.set_major_formatter(matplotlib.ticker.EngFormatter(unit="B"))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("minutes", fontsize=8)
    fig.suptitle(f"{board['title']}, run={run} (the dashboard's queries, drawn from Prometheus)", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}" + (f"; no series for: {', '.join(empty)}" if empty else ""))
    return 1 if empty else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--run", required=True, help="the run label (`<job kind>-<output folder>`, e.g. ppo-grpo)")
    parser.add_argument("--since", type=float, default=3600, help="seconds back from now")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args()
    end = time.time()
    return draw(args.prometheus, args.run, end - args.since, end, args.out)


if __name__ == "__main__":
    sys.exit(main())
