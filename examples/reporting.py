"""Per-shard tables, run summaries and the Gantt-like timeline of a streamed training run.

Every figure is derived from the per-shard trace of
:class:`pyg_atompack.ShardStreamDataset` (times in seconds from the start of iteration):
``download_start_s``, ``download_finish_s``, ``deserialize_finish_s``,
``consume_start_s``, ``consume_finish_s``, ``bytes`` and ``structures``.

Overlap follows ``benchmarks/paired_stats.py`` (the one definition in the project): the
sum over (download, consume) interval pairs of their intersection. A shard's overlap is
its download interval intersected with every consume interval, so the per-shard values
add up to the run's overlap.

The wait share of a shard is the share of the training steps attributed to it (those
whose batch ended with one of its samples) spent waiting for data: from asking the
stream for a batch to receiving it, over the whole step (wait + training). The stream
times it with CUDA events when the model is on a GPU (the time the GPU sat idle), on
the wall clock otherwise (``ShardStreamDataset.stats()``, ``wait_share``).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

_PAIRED_STATS_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "paired_stats.py"


def load_paired_stats():
    """Import ``benchmarks/paired_stats.py`` (a numpy-only script, not a package).

    Returns:
        The module object.
    """
    if "paired_stats" in sys.modules:
        return sys.modules["paired_stats"]
    spec = importlib.util.spec_from_file_location("paired_stats", _PAIRED_STATS_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["paired_stats"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _interval(record: Mapping, start: str, finish: str) -> tuple[float, float] | None:
    begin, end = record.get(start), record.get(finish)
    if begin is None or end is None:
        return None
    return float(begin), float(end)


def shard_rows(trace: Sequence[Mapping]) -> list[dict]:
    """One row per consumed shard: durations, wait before it and overlap with compute.

    Args:
        trace: Per-shard trace records (mappings), in any order.

    Returns:
        Rows sorted by consume start, with ``shard``, ``name``, ``download_s``,
        ``deserialize_s``, ``train_s``, ``wait_s``, ``overlap_s``, ``structures``,
        ``bytes``, and the steps' ``step_wait_s``, ``step_s`` and ``wait_share``
        (:obj:`None` where no step was timed).
    """
    paired_stats = load_paired_stats()
    consumed = [r for r in trace if _interval(r, "consume_start_s", "consume_finish_s")]
    consumed.sort(key=lambda r: r["consume_start_s"])
    consumes = [_interval(r, "consume_start_s", "consume_finish_s") for r in consumed]
    rows = []
    cursor = 0.0
    for record, (consume_start, consume_finish) in zip(consumed, consumes):
        download = _interval(record, "download_start_s", "download_finish_s")
        decoded = record.get("deserialize_finish_s")
        rows.append(
            {
                "epoch": record.get("epoch"),
                "shard": record.get("shard_index"),
                "name": record.get("identifier"),
                "download_s": download[1] - download[0] if download else None,
                "deserialize_s": decoded - download[1] if download and decoded else None,
                "train_s": consume_finish - consume_start,
                "wait_s": max(0.0, consume_start - cursor),
                "overlap_s": paired_stats.interval_overlap([download], consumes)
                if download
                else 0.0,
                "structures": record.get("structures"),
                "bytes": record.get("bytes"),
                **_step_share(record.get("step_wait_s"), record.get("step_time_s")),
            }
        )
        cursor = max(cursor, consume_finish)
    return rows


def _step_share(wait: float | None, step: float | None) -> dict:
    share = wait / step if wait is not None and step else None
    return {"step_wait_s": wait, "step_s": step, "wait_share": share}


def _cell(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_shard_table(rows: Sequence[Mapping]) -> str:
    """Plain-text table of :func:`shard_rows` with a totals line.

    Args:
        rows: Output of :func:`shard_rows`.

    Returns:
        The table as a string (no trailing newline).
    """
    columns = [
        ("epoch", "epoch"),
        ("shard", "shard"),
        ("download s", "download_s"),
        ("deserialise s", "deserialize_s"),
        ("train s", "train_s"),
        ("wait s", "wait_s"),
        ("overlap s", "overlap_s"),
        ("structures", "structures"),
        ("wait share", "wait_share"),
    ]
    body = [[_cell(row.get(key)) for _, key in columns] for row in rows]
    totals = ["total", ""]
    for _, key in columns[2:-1]:
        values = [row[key] for row in rows if row[key] is not None]
        totals.append(_cell(sum(values) if values else None))
    # the run's share: all steps' waits over all steps' time (not a sum of shares)
    waits = [row.get("step_wait_s") for row in rows if row.get("step_s")]
    steps = [row["step_s"] for row in rows if row.get("step_s")]
    totals.append(_cell(sum(waits) / sum(steps) if steps else None))
    widths = [
        max(len(title), *(len(line[i]) for line in [*body, totals]))
        for i, (title, _) in enumerate(columns)
    ]
    header = "  ".join(title.rjust(width) for (title, _), width in zip(columns, widths))
    rule = "-" * len(header)
    lines = [header, rule]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in body]
    lines += [rule, "  ".join(c.rjust(w) for c, w in zip(totals, widths))]
    return "\n".join(lines)


def plot_timeline(trace: Sequence[Mapping], path: str | Path, *, title: str = "") -> bool:
    """Draw download / deserialise / train bars per shard on a time axis (a Gantt chart).

    Args:
        trace: Per-shard trace records.
        path: Output PNG path.
        title: Figure title. (default: empty)

    Returns:
        :obj:`True` when the PNG was written, :obj:`False` when matplotlib is missing
        (a one-line notice is printed then).
    """
    try:
        # the object-oriented API draws off-screen without touching pyplot's global
        # backend, so calling this from a notebook leaves inline figures working
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: skipping timeline.png (pip install matplotlib)")
        return False
    # stream order (first download on top) reads like a Gantt chart
    records = sorted(trace, key=lambda r: r.get("download_start_s") or 0.0)
    figure = Figure(figsize=(9, 0.45 * len(records) + 1.6))
    axes = figure.subplots()
    phases = [
        ("download", "download_start_s", "download_finish_s", "tab:blue"),
        ("deserialise", "download_finish_s", "deserialize_finish_s", "tab:orange"),
        ("train", "consume_start_s", "consume_finish_s", "tab:green"),
    ]
    for row, record in enumerate(records):
        for label, start, finish, colour in phases:
            interval = _interval(record, start, finish)
            if interval is None:
                continue
            offset = {"download": -0.22, "deserialise": -0.22, "train": 0.22}[label]
            axes.barh(
                row + offset,
                interval[1] - interval[0],
                left=interval[0],
                height=0.4,
                color=colour,
                label=label if row == 0 else None,
            )
    axes.set_yticks(range(len(records)))
    axes.set_yticklabels([str(r.get("identifier") or r.get("shard_index")) for r in records])
    axes.invert_yaxis()
    axes.set_xlabel("seconds since the start of the pass")
    axes.set_title(title or "per-shard download and training")
    axes.legend(loc="upper right", fontsize="small")  # early shards sit top left
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True
