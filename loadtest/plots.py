"""PNG charts of a sweep versus concurrency, every server on the same axes.

`sweep.png` has the four panels (output tokens/s, TPOT p50/p99, TTFT p50/p99, τ); each panel
is also saved alone (`throughput.png`, `tpot.png`, `ttft.png`, `tau.png`). Uses matplotlib's
object API (no pyplot, no global backend): safe in a headless process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .report import LevelRow

Panel = Callable[[Axes, list[LevelRow]], None]


def _series(rows: list[LevelRow], server: str, value: Callable[[LevelRow], float | None]):
    points = [(r.concurrency, value(r)) for r in rows if r.server == server]
    return [c for c, v in points if v is not None], [v for _, v in points if v is not None]


def _servers(rows: list[LevelRow]) -> list[str]:
    return list(dict.fromkeys(r.server for r in rows))


def _axes(ax: Axes, rows: list[LevelRow], title: str, ylabel: str, ymin: float = 0) -> None:
    levels = sorted({r.concurrency for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (users)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.set_ylim(bottom=ymin)
        ax.legend(fontsize="small")


def throughput(ax: Axes, rows: list[LevelRow]) -> None:
    for server in _servers(rows):
        ax.plot(*_series(rows, server, lambda r: r.stats.output_tok_s), "o-", label=server)
    _axes(ax, rows, "Output throughput", "output tokens / s")


def _percentiles(ax: Axes, rows: list[LevelRow], metric: str) -> None:
    for i, server in enumerate(_servers(rows)):
        color = f"C{i}"
        for q, style in (("p50", "o-"), ("p99", "s--")):
            xs, ys = _series(rows, server, lambda r, q=q: getattr(r.stats, f"{metric}_{q}_ms"))
            ax.plot(xs, ys, style, color=color, label=f"{server} {q}")


def tpot(ax: Axes, rows: list[LevelRow]) -> None:
    _percentiles(ax, rows, "tpot")
    _axes(ax, rows, "Time per output token", "TPOT (ms)")


def ttft(ax: Axes, rows: list[LevelRow]) -> None:
    _percentiles(ax, rows, "ttft")
    _axes(ax, rows, "Time to first token", "TTFT (ms)")


def tau(ax: Axes, rows: list[LevelRow]) -> None:
    for i, server in enumerate(_servers(rows)):
        xs, ys = _series(rows, server, lambda r: r.tau)
        if xs:
            ax.plot(xs, ys, "o-", color=f"C{i}", label=server)
    if not ax.lines:
        ax.text(0.5, 0.5, "no DFlash counters", ha="center", va="center", transform=ax.transAxes)
    _axes(ax, rows, "Mean acceptance length τ", "τ (tokens per step)", ymin=1)


PANELS: dict[str, Panel] = {"throughput": throughput, "tpot": tpot, "ttft": ttft, "tau": tau}


def write_plots(rows: list[LevelRow], out_dir: Path) -> list[Path]:
    paths = []
    combined = Figure(figsize=(12, 9), layout="constrained")
    for ax, panel in zip(combined.subplots(2, 2).flat, PANELS.values(), strict=True):
        panel(ax, rows)
    paths.append(out_dir / "sweep.png")
    combined.savefig(paths[-1], dpi=100)
    for name, panel in PANELS.items():
        fig = Figure(figsize=(6, 4.5), layout="constrained")
        panel(fig.subplots(), rows)
        paths.append(out_dir / f"{name}.png")
        fig.savefig(paths[-1], dpi=100)
    return paths
