"""What the rounds come to: medians and ratios per method, nprocs and
phase; the table printed and the plot drawn from them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastspawn._bench.common import BASELINE, BINARY_BASELINE, FLOOR
from fastspawn._bench.rounds import PHASE_KEYS, PHASES

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastspawn._bench.ranks import Record


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (0 < q < 1), interpolating linearly
    between ranks (statistics' "inclusive" method, R's type 7)."""
    import statistics

    if not values:
        raise ValueError("quantile of no values")
    if len(values) == 1:
        return float(values[0])  # statistics.quantiles wants two
    cuts = statistics.quantiles(values, n=1000, method="inclusive")
    return cuts[round(q * 1000) - 1]


def _over(median: float, base: float | None) -> float | None:
    return median / base if base is not None and base > 0 else None


def summarize(records: Sequence[Record], methods: Sequence[str]) -> list[Record]:
    """Median, p90 and min per method, nprocs and phase, with the ratio of
    the median to the baseline's (mp-spawn; binary-popen for binaries) and,
    for Python methods, to the floor's."""
    values: dict[tuple[str, int, str], list[float]] = {}
    for record in records:
        for phase, key, _unit in PHASE_KEYS:
            if record[key] is not None:
                values.setdefault((record["method"], record["nprocs"], phase), []).append(
                    record[key]
                )
    units = {phase: unit for phase, _, unit in PHASE_KEYS}
    medians = {group: quantile(v, 0.5) for group, v in values.items()}
    summary: list[Record] = []
    for (method, nprocs, phase), samples in values.items():
        binary = method.startswith("binary-")
        baseline = BINARY_BASELINE if binary else BASELINE
        median = medians[(method, nprocs, phase)]
        ratio = _over(median, medians.get((baseline, nprocs, phase)))
        floor = None if binary else medians.get((FLOOR, nprocs, phase))
        summary.append(
            {
                "method": method,
                "nprocs": nprocs,
                "phase": phase,
                "unit": units[phase],
                "rounds": len(samples),
                "median": median,
                "p90": quantile(samples, 0.9),
                "min": min(samples),
                "ratio": ratio,
                "baseline": baseline if ratio is not None else None,
                "floor_ratio": _over(median, floor),
            }
        )
    order = {name: i for i, name in enumerate(methods)}
    summary.sort(key=lambda s: (s["nprocs"], order.get(s["method"], 99), PHASES.index(s["phase"])))
    return summary


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    # As times are (97.3x, 1.25x) down to 0.10x, then two significant digits (0.054x).
    return f"{_number(value)}x" if round(value, 2) >= 0.1 else f"{value:.2g}x"


def _cell(stats: Record | None) -> str:
    if stats is None:
        return "-"
    scale = 1000.0 if stats["unit"] == "s" else 1.0 / 2**20  # ms, MiB
    med, low, p90 = (stats[k] * scale for k in ("median", "min", "p90"))
    return f"{_number(med)} ({_number(low)}-{_number(p90)})"


# (key, title); a key "field:phase" shows that field of the phase's summary.
# Two tables per nprocs, so that each fits 100 columns: how the ranks start,
# then how they end and what they hold.
_START_COLUMNS = [
    ("created", "created"),
    ("running", "all running"),
    ("ratio:running", f"vs {BASELINE}"),
]
_FLOOR_COLUMN = ("floor_ratio:running", f"vs {FLOOR}")  # after the baseline's, when floor ran
_END_COLUMNS = [
    ("joined", "exit->joined"),
    ("failure", "failure->reaped"),
    ("uss", "USS MiB"),
]
# Medians alone: four columns of "median (min-p90)" would not fit.
_CPU_COLUMNS = [
    ("median:cpu", "CPU ms"),
    ("median:rank_cpu", "ranks'"),
    ("per_rank:rank_cpu", "per rank"),
    ("median:helper_cpu", "helpers'"),
    ("median:caller_cpu", "caller's"),
]
_BIN_COLUMNS = [
    ("created", "created"),
    ("reaped", "all reaped"),
    ("ratio:reaped", f"vs {BINARY_BASELINE}"),
]
WIDTH = 100  # the report's lines fit this many columns


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _row(
    name: str, nprocs: int, columns: Sequence[tuple[str, str]], stats: dict[Any, Record]
) -> list[str]:
    row = [name]
    for key, _title in columns:
        field, _, phase = key.rpartition(":")
        found = stats.get((name, nprocs, phase))
        if not field:
            row.append(_cell(found))
        elif found is None:
            row.append("-")
        elif field == "median":
            row.append(_number(found["median"] * 1000.0))  # ms
        elif field == "per_rank":
            row.append(_number(found["median"] * 1000.0 / nprocs))
        else:
            row.append(_ratio(found[field]))
    return row


def _legend(
    floor_ran: bool, repeat: int, machine: Record, pause: float, cpu_ran: bool
) -> list[str]:
    lines = [
        f"fastspawn bench: {repeat} round(s) per cell; each cell is median (min-p90), times in",
        "ms from the launch call (exit->joined: from the last rank's return; failure->reaped:",
        "from the failing rank's raise); USS summed over the ranks.",
        f"vs {BASELINE} / vs {BINARY_BASELINE}: the method's median over the baseline's "
        "(below 1: faster).",
    ]
    if floor_ran:
        lines.append(
            f"vs {FLOOR}: the method's all running median over {FLOOR}'s (a bare os.fork() loop)."
        )
    if pause:
        lines.append(
            f"each launch after a pause of {pause:g} s (--pause), the bench idle meanwhile."
        )
    if cpu_ran:
        lines += [
            "CPU ms: medians of the time on a CPU from the call until the bench had every rank's",
            "entry, of the ranks (a ready or pre-forked one's from its wake; per rank: that",
            "median / nprocs), the method's helpers (zygote, forkserver, a floor's helper; a",
            "fork is its parent's) and the caller (the bench itself).",
        ]
    if machine.get("uncached_modules"):
        lines.append(
            "fastspawn's modules had no bytecode cache: each spawned rank and each zygote or"
        )
        lines.append("forkserver start compiled them, and the figures include that.")
    lines.append("machine: {cpu}, {cores} cores ({usable_cores} usable),".format(**machine))
    lines.append(
        "         Linux {kernel}, Python {python}, fastspawn {fastspawn}".format(**machine)
    )
    return lines


def format_table(
    summary: Sequence[Record],
    methods: Sequence[str],
    repeat: int,
    machine: Record,
    pause: float = 0.0,
) -> str:
    """The terminal report: per nprocs, a table of how the ranks start and
    one of how they end (a row per method each), then the binaries'."""
    stats = {(s["method"], s["nprocs"], s["phase"]): s for s in summary}
    floor_ran = any(s["method"] == FLOOR for s in summary)
    cpu_ran = any(s["phase"] == "cpu" for s in summary)
    lines = _legend(floor_ran, repeat, machine, pause, cpu_ran)
    start_columns = [*_START_COLUMNS, _FLOOR_COLUMN] if floor_ran else _START_COLUMNS
    tables = (
        ("start", False, start_columns),
        ("end", False, _END_COLUMNS),
        ("CPU", False, _CPU_COLUMNS if cpu_ran else []),
        ("binaries", True, _BIN_COLUMNS),
    )
    for nprocs in sorted({s["nprocs"] for s in summary}):
        for title, binary, columns in tables:
            names = [m for m in methods if m.startswith("binary-") == binary]
            names = [m for m in names if any((m, nprocs, p) in stats for p in PHASES)]
            if not names or not columns:
                continue
            lines.append("")
            rows = [[f"nprocs={nprocs} {title}"] + [name for _, name in columns]]
            rows.extend(_row(name, nprocs, columns, stats) for name in names)
            lines.extend(_grid(rows))
    return "\n".join(lines) + "\n"


_PANELS = [
    ("created", "call -> processes created (ms)"),
    ("running", "call -> all ranks in fn (ms)"),
    ("joined", "last exit -> join returned (ms)"),
    ("failure", "failure -> all reaped (ms)"),
    ("uss", "summed USS of the ranks (MiB)"),
    ("cpu", "CPU time until all ranks in fn (ms)"),
    ("reaped", "binaries: call -> all reaped (ms)"),
]


# One colour and one marker per method, whatever subset runs: no two series
# alike.  The headline, fastspawn's default method warm, is black, thick and
# drawn last, over the others.
HEADLINE = "fastspawn-zygote-warm"
SERIES_STYLE: dict[str, tuple[str, str]] = {
    HEADLINE: ("#000000", "o"),
    "fastspawn-zygote-ready": ("#e6beff", "H"),
    "fastspawn-zygote-refilled": ("#fabed4", "+"),
    "fastspawn-zygote-cold": ("#e6194b", "s"),
    "fastspawn-spawn": ("#4363d8", "^"),
    "fastspawn-fork": ("#3cb44b", "v"),
    "fastspawn-forkserver": ("#f58231", "D"),
    "mp-spawn": ("#911eb4", "P"),
    "mp-fork": ("#42d4f4", "X"),
    "mp-forkserver": ("#f032e6", "*"),
    "torch-spawn": ("#9a6324", "h"),
    "floor": ("#808080", "<"),
    "floor-sized": ("#469990", ">"),
    "floor-preforked": ("#a9a9a9", "1"),
    "floor-preforked-sized": ("#aaffc3", "2"),
    "binary-fastspawn": ("#000075", "p"),
    "binary-popen": ("#808000", "d"),
    "binary-popen-pdeathsig": ("#800000", "8"),
}
_LINES = {"fastspawn": "-", "mp": "--", "torch": ":", "floor": "-", "binary": "-."}


def _draw(ax: Any, summary: Sequence[Record], name: str, phase: str) -> Any:
    """One method's medians (bars: min to p90) in one panel; None if absent."""
    scale = 1000.0 if phase != "uss" else 1.0 / 2**20
    points = sorted(
        (s["nprocs"], s["median"] * scale, s["min"] * scale, s["p90"] * scale)
        for s in summary
        if s["method"] == name and s["phase"] == phase
    )
    if not points:
        return None
    xs, med, low, high = (list(column) for column in zip(*points, strict=True))
    colour, marker = SERIES_STYLE[name]
    headline = name == HEADLINE
    return ax.errorbar(
        xs,
        med,
        yerr=[
            [m - lo for m, lo in zip(med, low, strict=True)],
            [h - m for m, h in zip(med, high, strict=True)],
        ],
        marker=marker,
        # See-through and hollow on top: a method that coincides with it
        # (fastspawn-forkserver is the zygote too) still shows under it.
        alpha=0.7 if headline else 1.0,
        markerfacecolor="none" if headline else colour,
        markersize=8 if headline else 5,
        linewidth=2.6 if headline else 1.2,
        capsize=2,
        linestyle=_LINES[name.split("-", 1)[0]],
        color=colour,
        zorder=10 if headline else 2,
        label=name,
    )


def plot(summary: Sequence[Record], methods: Sequence[str], path: str, machine: str) -> None:
    """Median latency (bars: min to p90) against nprocs, log-log, a panel
    per phase; ``machine`` goes under the title."""
    import importlib

    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")  # no display needed
    plt = importlib.import_module("matplotlib.pyplot")
    ticker = importlib.import_module("matplotlib.ticker")
    panels = [(p, t) for p, t in _PANELS if any(s["phase"] == p for s in summary)]
    cols = 3 if len(panels) > 4 else 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 4.4 * rows), squeeze=False)
    ticks = sorted({s["nprocs"] for s in summary})
    # The headline last, so that nothing covers it.
    order = [m for m in methods if m != HEADLINE] + [m for m in methods if m == HEADLINE]
    handles: dict[str, Any] = {}
    for ax, (phase, panel_title) in zip(axes.flat, panels, strict=False):
        for name in order:
            drawn = _draw(ax, summary, name, phase)
            if drawn is not None:
                handles[name] = drawn
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("nprocs")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    shown = [m for m in methods if m in handles]  # the legend in the table's order
    headline = (
        f"{HEADLINE} (black, thick) against {len(shown) - 1} other method(s)"
        if HEADLINE in handles
        else f"{len(shown)} method(s)"
    )
    fig.suptitle(f"fastspawn bench: {headline}\n{machine}", fontsize=11)
    fig.legend([handles[m] for m in shown], shown, loc="lower center", ncol=4, fontsize=9)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * ((len(shown) + 3) // 4), 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
