"""The report is written as what its name says (a .png or a .html page, else one line, exit 2), and
with several runs overlaid no legend covers the data it explains."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import report_plot
from trainer.run_summary import EvalPoint, RunHistory

REPO = Path(__file__).resolve().parents[2]


def run_history(name: str, offset: float) -> RunHistory:
    steps = tuple(range(0, 400, 4))
    evals = tuple(EvalPoint(s, 1.5 + offset + s / 400, (0.8, 0.6, 0.4), 1.4 + offset + s / 400)
                  for s in range(0, 400, 40))
    return RunHistory(name=name, steps=steps, loss=tuple(3.0 - s / 400 for s in steps),
                      tau_expected=tuple(1.6 + offset + s / 380 for s in steps), tokens_per_s=(9000.0,) * len(steps),
                      gpu_memory_gib=(), evals=evals, markers=(), total_steps=400, finished=True, wall_s=60.0,
                      launches=1)


@pytest.mark.parametrize("name", ["report.txt", "report.pdf", "report"])
def test_a_report_named_neither_png_nor_html_is_refused_in_one_line(tmp_path, name):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "trainer", "report", str(metrics), "-o", str(tmp_path / name)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc
    assert proc.stderr.strip().splitlines() == [
        f"dflash-train report: -o {tmp_path / name}: a report is a .png picture or a .html page (it embeds the "
        "picture); name the file report.png or report.html"]
    assert not (tmp_path / name).exists()
    with pytest.raises(report_plot.UnknownFormat):
        report_plot.write([run_history("0001", 0.0)], str(tmp_path / name), "t")
    assert not (tmp_path / name).exists()


def test_overlaid_runs_keep_their_legends_off_the_data():
    plt = report_plot._matplotlib()
    runs = [run_history(f"{i:04d}", 0.3 * i) for i in range(1, 5)]
    fig, panel = report_plot._panels(plt, with_memory=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, run in enumerate(runs):
        report_plot._plot_run(panel, run, colours[index], overlay=True)
    report_plot._titles(panel, runs)
    fig.tight_layout()
    fig.canvas.draw()
    try:
        for name in ("tau", "acceptance", "loss"):
            ax = panel[name]
            box = ax.get_legend().get_window_extent()
            covered = [line.get_label() for line in ax.get_lines()
                       for x, y in ax.transData.transform(line.get_xydata()) if box.contains(x, y)]
            assert not covered, f"the {name} legend covers {sorted(set(covered))}"
    finally:
        plt.close(fig)


@pytest.mark.parametrize("name, kind", [("r.png", "png"), ("R.PNG", "png"), ("a/b.html", "html"),
                                        ("page.HTM", "html"), ("dir.png/report", None), (".png.txt", None)])
def test_the_format_is_the_names_suffix_whatever_its_case(name, kind):
    if kind is None:
        with pytest.raises(report_plot.UnknownFormat, match="name the file report.png or report.html"):
            report_plot.format_of(name)
    else:
        assert report_plot.format_of(name) == kind


def test_the_html_page_escapes_what_it_did_not_write_and_embeds_the_very_png():
    import base64
    import dataclasses
    import re

    hostile = dataclasses.replace(run_history("<script>x</script>", 0.0), evals=(), finished=False)
    picture = report_plot.Picture(b"\x89PNG fake", 640, 480, {})
    page = report_plot.html_page([run_history("0001", 0.0), hostile], picture, 'runs & "more" <b>')
    assert "<script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    assert "<title>runs &amp; &quot;more&quot; &lt;b&gt;</title>" in page
    (embedded,) = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert base64.b64decode(embedded) == picture.png and "width='640'" in page
    rows = re.findall(r"<tr><td>(.*?)</td></tr>", page)
    assert len(rows) == 2
    assert rows[0].split("</td><td>")[1:] == ["2.400 (step 360)", "396/400", "1m00s", "1", "finished"]
    assert rows[1].split("</td><td>")[1:] == ["—", "396/400", "1m00s", "1", "not finished"]


def test_smoothing_is_a_trailing_mean_that_skips_gaps():
    nan = float("nan")
    smoothed = report_plot._smooth([1.0, 3.0, nan, 5.0, 7.0], window=2)
    assert smoothed == [1.0, 2.0, 3.0, 5.0, 6.0]
    assert all(v != v for v in report_plot._smooth([nan, nan], window=3)), "no number yet: a gap"
