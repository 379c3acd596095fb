"""The picture of one or more runs (trainer.run_summary histories): a PNG, or HTML embedding it.

Shared by `dflash-train report` and `dflash-ops report`; matplotlib is imported only when a picture
is drawn, as the trainer itself never needs it.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import html
import io
import math

from trainer.progress import format_duration
from trainer.run_summary import RunHistory

WIDTH_IN, PANEL_HEIGHT_IN, DPI = 14.0, 3.6, 100
MARKER_STYLE = {
    "relaunch": ("tab:green", "--"),
    "stop": ("tab:red", "-"),
    "error": ("black", ":"),
    "ended": ("tab:orange", "-."),
}
# panel -> (title, x label, y label), in drawing order; GPU memory only when recorded
PANELS = {
    "loss": ("training loss (trailing mean over 2% of the steps)", "step", "loss"),
    "tau": ("τ (acceptance length)", "step", "tokens per target forward"),
    "acceptance": ("acceptance per block position", "block position", "share of rounds accepted to here"),
    "tokens_per_s": ("throughput (relaunch --, stop |)", "step", "tokens/s"),
    "gpu_memory": ("GPU memory (peak per step)", "step", "GiB"),
}


class NoMetrics(Exception):
    """Nothing to draw: no run holds a step record yet."""


# what a report file can be, by its name's suffix
FORMATS = {".png": "png", ".html": "html", ".htm": "html"}


class UnknownFormat(ValueError):
    """The output name is neither .png nor .html: a report is never written under the wrong name."""


def format_of(path: str) -> str:
    """ "png" or "html" from `path`'s suffix; UnknownFormat (its message names the fix) otherwise."""
    suffix = path[path.rfind(".") :].lower() if "." in path.rsplit("/", 1)[-1] else ""
    if suffix not in FORMATS:
        raise UnknownFormat(
            f"{path}: a report is a .png picture or a .html page (it embeds the picture); "
            "name the file report.png or report.html"
        )
    return FORMATS[suffix]


@dataclasses.dataclass(frozen=True)
class Picture:
    png: bytes
    width: int
    height: int
    panels: dict  # panel name -> (left, top, right, bottom) in pixels of the PNG


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "drawing a report needs matplotlib: pip install matplotlib (or the dflash-ops[report] extra)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _smooth(values, window):
    """A trailing mean over `window` points (NaNs skipped): per-step accuracy is noisy."""
    out, run = [], collections.deque(maxlen=window)
    for value in values:
        run.append(value)
        finite = [v for v in run if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def draw(histories: list[RunHistory], title: str = "") -> Picture:
    """The figure of `histories` (overlaid, one colour each) as a PNG."""
    runs = [h for h in histories if h.steps]
    if not runs:
        raise NoMetrics("no step records yet")
    plt = _matplotlib()
    fig, panel = _panels(plt, with_memory=any(h.gpu_memory_gib for h in runs))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    overlay = len(runs) > 1
    for index, run in enumerate(runs):
        _plot_run(panel, run, colours[index % len(colours)], overlay)
    _titles(panel, runs)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    picture = _picture(fig, panel)
    plt.close(fig)
    return picture


def _panels(plt, with_memory: bool):
    """(figure, panel name -> axes): two panels a row."""
    names = [name for name in PANELS if with_memory or name != "gpu_memory"]
    rows = (len(names) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(WIDTH_IN, PANEL_HEIGHT_IN * rows), dpi=DPI, squeeze=False)
    panel = dict(zip(names, axes.flat, strict=False))
    for extra in list(axes.flat)[len(names) :]:
        extra.remove()
    return fig, panel


def _plot_run(panel, run: RunHistory, colour, overlay: bool) -> None:
    label = run.name if overlay else None
    window = max(1, len(run.steps) // 50)
    if window > 1:  # the raw per-step loss is noisy: faint, under its trailing mean
        panel["loss"].plot(run.steps, run.loss, color=colour, lw=0.6, alpha=0.3)
    panel["loss"].plot(run.steps, _smooth(run.loss, window), color=colour, lw=1.4, label=label)
    _tau(panel["tau"], run, colour, overlay, window)
    _acceptance(panel["acceptance"], run, colour, overlay)
    panel["tokens_per_s"].plot(run.steps, run.tokens_per_s, color=colour, lw=1.0, label=label)
    for marker in run.markers:
        line_colour, style = MARKER_STYLE.get(marker.kind, ("gray", ":"))
        panel["tokens_per_s"].axvline(marker.step, color=line_colour, ls=style, lw=1.2, alpha=0.8)
    if run.gpu_memory_gib:
        panel["gpu_memory"].plot(run.steps, run.gpu_memory_gib, color=colour, lw=1.2, label=label)


def _tau(ax, run: RunHistory, colour, overlay: bool, window: int) -> None:
    """tau expected from accuracy, and measured: pooled and as the mean of per-prompt means."""
    prefix = run.name + ": " if overlay else ""
    expected = _smooth(run.tau_expected, window)
    ax.plot(run.steps, expected, color=colour, lw=1.0, ls="--", label=f"{prefix}expected from accuracy")
    if run.evals:
        _main_line(
            ax, [e.step for e in run.evals], [e.tau for e in run.evals], colour, f"{prefix}measured (pooled)"
        )
    per_prompt = [(e.step, e.tau_per_prompt_mean) for e in run.evals if e.tau_per_prompt_mean is not None]
    if per_prompt:
        steps, taus = [step for step, _ in per_prompt], [tau for _, tau in per_prompt]
        ax.plot(steps, taus, ":s", color=colour, lw=1.0, ms=4, label=f"{prefix}measured (mean of per-prompt)")


def _main_line(ax, xs, ys, colour, label: str) -> None:  # a measured series
    ax.plot(xs, ys, color=colour, lw=1.8, marker="o", ms=5, label=label)


def _picture(fig, panel) -> Picture:
    """The PNG of `fig` and where each panel lies in it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    width, height = (int(round(v)) for v in fig.get_size_inches() * DPI)
    boxes = {}
    for name, ax in panel.items():
        x0, y0, x1, y1 = ax.get_position().extents
        boxes[name] = (int(x0 * width), int((1 - y1) * height), int(x1 * width), int((1 - y0) * height))
    return Picture(buffer.getvalue(), width, height, boxes)


def _acceptance(ax, run: RunHistory, colour, overlay: bool) -> None:
    with_acceptance = [e for e in run.evals if e.acceptance]
    if not with_acceptance:
        return
    prefix = run.name + ": " if overlay else ""
    earliest, latest = with_acceptance[0], with_acceptance[-1]
    positions = range(1, len(latest.acceptance) + 1)
    _main_line(ax, positions, latest.acceptance, colour, f"{prefix}latest (step {latest.step})")
    if earliest is not latest:
        positions = range(1, len(earliest.acceptance) + 1)
        label = f"{prefix}earliest (step {earliest.step})"
        ax.plot(positions, earliest.acceptance, "--x", color=colour, lw=1.0, ms=5, label=label)


def _titles(panel, runs: list[RunHistory]) -> None:
    style = _legend_style(overlay=len(runs) > 1)
    for name, ax in panel.items():
        title, xlabel, ylabel = PANELS[name]
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(**style)
    if not any(r.evals for r in runs):
        ax = panel["acceptance"]
        centred = {"ha": "center", "va": "center", "transform": ax.transAxes}
        ax.text(0.5, 0.5, "no eval record yet (eval.every)", color="gray", **centred)
    from matplotlib.lines import Line2D

    if kinds := sorted({m.kind for r in runs for m in r.markers}):
        handles = [
            Line2D([], [], color=MARKER_STYLE[k][0], ls=MARKER_STYLE[k][1], label=k)
            for k in kinds
            if k in MARKER_STYLE
        ]
        existing, _ = panel["tokens_per_s"].get_legend_handles_labels()
        panel["tokens_per_s"].legend(handles=existing + handles, **style)


def _legend_style(overlay: bool) -> dict:
    """Small; inside the panel for one run, beside it for several (their legends would cover the data)."""
    place = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0} if overlay else {}
    return {**place, "fontsize": 7, "handlelength": 1.5, "framealpha": 0.6}


def html_page(histories: list[RunHistory], picture: Picture, title: str) -> str:
    """A self-contained page: the summary table and the PNG embedded (base64)."""
    rows = []
    for h in histories:
        row = h.summary_row()
        best = "—" if row["best_tau"] is None else f"{row['best_tau']:.3f} (step {row['best_tau_step']})"
        total = f"/{row['total_steps']}" if row["total_steps"] else ""
        state = "finished" if row["finished"] else "not finished"
        rows.append(
            f"<tr><td>{html.escape(row['run'])}</td><td>{best}</td><td>{row['steps']}{total}</td>"
            f"<td>{format_duration(row['wall_s'])}</td><td>{row['launches']}</td><td>{state}</td></tr>"
        )
    image = base64.b64encode(picture.png).decode()
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(title) + "</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
        "td,th{border:1px solid #999;padding:4px 10px;text-align:right}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><table><tr><th>run</th><th>best τ</th><th>steps</th>"
        "<th>wall time</th><th>launches</th><th>state</th></tr>" + "".join(rows) + "</table>"
        f"<p><img alt='run report' width='{picture.width}' src='data:image/png;base64,{image}'></p>"
        "</body></html>\n"
    )


def write(histories: list[RunHistory], path: str, title: str) -> Picture:
    """Draw `histories` into `path`: HTML for a .html/.htm name, PNG for a .png one."""
    kind = format_of(path)
    picture = draw(histories, title)
    data = html_page(histories, picture, title).encode() if kind == "html" else picture.png
    with open(path, "wb") as f:
        f.write(data)
    return picture
