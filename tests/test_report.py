"""Every run's report (jobs/report.py, `rlhf-ray report`): a summary table and plots per step as PNG files and one
self-contained HTML page, several runs side by side; the page checked in a real headless browser."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rlhf_ray.cli import main


def chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def rendered(page: Path) -> str:
    """The page's DOM after a headless Chromium loaded it and ran its scripts."""
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium here (CI installs it: scripts/test.sh)")
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def fake_run(folder: Path, rewards: list[float], finished: bool = True) -> Path:
    """A PPO run folder as a job writes it: metrics.jsonl (the evaluation at step 0 and the end) and summary.json."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "eval/reward": 0.1, "eval/task_accuracy": 0.2}]
    rows += [{"step": i + 1, "reward/mean": r, "kl/mean": 0.01 * i, "policy/entropy": 1.0 - 0.1 * i,
              "answer/length": 20 + i, "time/generate_wait": 2.0, "time/experience": 0.5, "time/train": 3.0,
              "time/sync": 0.2} for i, r in enumerate(rewards)]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if finished:
        rows.append({"step": len(rewards), "eval/reward": 0.4, "eval/task_accuracy": 0.35})
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
        (folder / "summary.json").write_text(json.dumps({"iterations": len(rewards), "task_accuracy_before": 0.2,
                                                         "task_accuracy_after": 0.35, "seconds": 61.5}))
    else:
        text += '{"step": 9, "reward/me'  # a line being written
    (folder / "metrics.jsonl").write_text(text)
    return folder


def test_several_runs_side_by_side_in_one_page_and_its_plots(tmp_path, capsys):
    a = fake_run(tmp_path / "sync", [0.1, 0.3, 0.5])
    b = fake_run(tmp_path / "partial", [0.2, 0.25], finished=False)  # still running
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "both")]) == 0
    assert "wrote" in capsys.readouterr().out
    pngs = sorted(p.name for p in (tmp_path / "both" / "report").glob("*.png"))
    assert pngs == ["KL_to_the_reference.png", "answer_length__tokens.png", "entropy.png",
                    "held_out_check.png", "held_out_reward.png", "reward.png", "time_per_iteration__s.png"]
    page = (tmp_path / "both" / "report.html").read_text()
    assert "<th>sync</th><th>partial</th>" in page and "(running)" in page
    assert "<td>task_accuracy_after</td><td>0.35</td><td>-</td>" in page
    assert page.count("data:image/png;base64,") == 7  # self-contained: the plots are in the page
    dom = rendered(tmp_path / "both" / "report.html")
    assert 'data-images-shown="7"' in dom  # the browser decoded and laid out every plot
    assert "task_accuracy_after" in dom and "61.5" in dom


def test_a_folder_without_metrics_is_refused_by_name(tmp_path, capsys):
    assert main(["report", str(tmp_path / "empty")]) != 0
    assert f"no metrics.jsonl in {tmp_path / 'empty'}" in " ".join(capsys.readouterr().err.split())


def test_an_accuracy_logged_with_its_standard_error_is_drawn_with_error_bars(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from rlhf_ray.jobs.report import Run, draw

    folder = fake_run(tmp_path / "run", [0.1, 0.3])
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for row, error in zip((r for r in rows if "eval/task_accuracy" in r), (0.04, 0.05)):
        row["eval/task_accuracy_se"] = error
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = Run.read(folder)
    assert run.errors("eval/task_accuracy") == [0.04, 0.05] and run.errors("reward/mean") is None
    fig, ax = plt.subplots()
    draw(ax, run, "eval/task_accuracy", None)
    draw(ax, run, "reward/mean", None)
    (bars,) = ax.containers  # the accuracy with its error bars, the reward a plain line
    (segments,) = bars.lines[2]
    spans = [tuple(s[:, 1]) for s in segments.get_segments()]
    assert spans == [pytest.approx((0.16, 0.24)), pytest.approx((0.30, 0.40))]
    plt.close(fig)
