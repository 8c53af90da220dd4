"""Train SchNet on energies and forces streamed from shards, and show the I/O overlap per shard.

The reference workload (MD17 aspirin) trained from remote shards with
:class:`pyg_atompack.ShardStreamDataset`: while the model trains on shard ``i``, shard
``i + 1`` is downloaded and decoded in the background. At the end a table shows, shard
by shard, how much of the retrieval was hidden behind computation and the share of the
training steps spent waiting for data (GPU time from CUDA events when the model is on
a GPU, the wall clock otherwise; see ``ShardStreamDataset.stats()``).

Run it::

    python examples/schnet_md17.py                       # embedded aspirin, simulated remote
    python examples/schnet_md17.py --source hf://datasets/org/md17@main/aspirin
    python examples/schnet_md17.py --md17 data/MD17      # PyG's MD17 (downloads once)

Without a data flag the example generates a short Langevin trajectory of aspirin with
ASE's EMT potential (not quantum chemistry), writes ``.pt`` and ``.atp`` shards, and
serves them from a throttled HTTP server on 127.0.0.1 so the run really streams. The
last shard of every source is held out and used only for the final energy / force MAE.

Also importable: ``run(RunConfig(...))`` returns the metrics, ``main(argv)`` is the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helper modules

import aspirin  # noqa: E402
import reporting  # noqa: E402
import sources  # noqa: E402
import training  # noqa: E402

from pyg_atompack import ShardStreamDataset, graph, stream  # noqa: E402

DEFAULT_DATA_DIR = Path.home() / ".cache" / "pyg_atompack" / "examples"


@dataclass
class RunConfig:
    """Everything one run needs (the CLI flags map onto these fields).

    Attributes:
        source: Local directory, ``http(s)://`` manifest URL or ``hf://`` URI of shards.
        md17: Root of PyG's MD17 dataset to convert into shards.
        md17_name: MD17 molecule.
        data_dir: Cache of the embedded aspirin shards.
        shard_format: Format of generated shards, ``"pt"`` or ``"atp"``.
        trajectory: Embedded-trajectory settings (frames, shard size, temperature, ...).
        simulate_remote: Serve local shards over throttled loopback HTTP
            (:obj:`None`: only for the embedded data).
        latency_s: Simulated latency per request.
        bandwidth_bps: Simulated bandwidth per connection, bytes/s.
        model: SchNet size.
        device: Torch device.
        epochs: Passes over the training shards.
        max_shards: Training shards used (the held-out shard is never trained on).
        prefetch: Shards loaded ahead of the one being trained on.
        concurrency: Connections in flight; ``None`` lets the stream choose them by
            measurement (its default), more while downloads are the bottleneck.
        batch_size: Structures per optimisation step.
        lr: Adam learning rate.
        force_weight: Weight of the force MSE in the loss.
        energy_mean_per_atom: Override of the energy shift (with ``energy_std``).
        energy_std: Override of the energy scale.
        seed: Seed of the weights and of the shard / sample order.
        out: Folder for ``trace.json``, ``metrics.json`` and ``timeline.png``.
        progress: Show a live progress bar.
    """

    source: str | None = None
    md17: str | None = None
    md17_name: str = "aspirin"
    data_dir: str = str(DEFAULT_DATA_DIR)
    shard_format: str = "pt"
    trajectory: aspirin.TrajectoryConfig = field(default_factory=aspirin.TrajectoryConfig)
    simulate_remote: bool | None = None
    latency_s: float = 0.05
    bandwidth_bps: float | None = 0.5e6
    model: training.ModelConfig = field(default_factory=training.ModelConfig)
    device: str = "cpu"
    epochs: int = 6
    max_shards: int | None = None
    prefetch: int = 1
    concurrency: int | None = None
    batch_size: int = 32
    lr: float = 1e-3
    force_weight: float = training.FORCE_WEIGHT
    energy_mean_per_atom: float | None = None
    energy_std: float | None = None
    seed: int = 0
    out: str | None = "runs/schnet_md17"
    progress: bool = True


def first_shard_statistics(source, listing) -> tuple[float, float]:
    """Energy normalisation from the first training shard, fetched once before training.

    Args:
        source: The shard source.
        listing: Its shard listing.

    Returns:
        ``(mean_per_atom, std)``.
    """
    first = listing[0]
    payload = source.fetch(first, stream.CancelToken())
    return training.energy_statistics(stream.decode_shard(payload, first.name))


def _progress_bar(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a core dependency; keep the example usable regardless
        enabled = False
    if not enabled:
        return None
    return tqdm(total=total, unit="struct", dynamic_ncols=True, leave=True)


def train_epoch(dataset, model, optimizer, device, *, epoch: int, force_weight: float,
                show_progress: bool) -> dict:
    """Train one pass over the streamed shards.

    Args:
        dataset: A :class:`ShardStreamDataset` yielding batches.
        model: The SchNet.
        optimizer: Its optimizer.
        device: Torch device of the model.
        epoch: Epoch number (seeds the shard order).
        force_weight: Weight of the force term.
        show_progress: Draw a tqdm bar.

    Returns:
        ``epoch``, ``seconds``, ``steps``, ``structures``, ``mean_loss``, the per-shard
        ``trace`` and the stream's ``stats``.
    """
    dataset.set_epoch(epoch)
    plan = [dataset.shards[i] for i in dataset.plan().shards]
    boundaries, names, total = [], [], 0
    for info in plan:
        total += info.records or 0
        boundaries.append(total)
        names.append(info.name)
    bar = _progress_bar(total, show_progress)
    started = time.perf_counter()
    losses, seen = [], 0
    for batch in dataset:
        batch = batch.to(device)
        # train_step reads the loss back, which also synchronises a GPU at every step
        losses.append(training.train_step(model, optimizer, batch, force_weight=force_weight))
        seen += batch.num_graphs
        if bar is not None:
            shard = next((k for k, end in enumerate(boundaries) if seen <= end), len(plan) - 1)
            rate = seen / max(time.perf_counter() - started, 1e-9)
            bar.set_postfix_str(
                f"epoch {epoch} shard {shard + 1}/{len(plan)} ({names[shard]}) "
                f"loss {losses[-1]:.4f} {rate:.0f} struct/s"
            )
            bar.update(batch.num_graphs)
    if bar is not None:
        bar.close()
    return {
        "epoch": epoch,
        "seconds": time.perf_counter() - started,
        "steps": len(losses),
        "structures": seen,
        "mean_loss": sum(losses) / max(len(losses), 1),
        "last_loss": losses[-1] if losses else None,
        "trace": dataset.trace,
        "stats": dataset.stats(),
    }


def _summary_lines(metrics: dict) -> list[str]:
    energy_unit, force_unit = metrics["units"]
    evaluation = metrics["held_out"]
    stats = metrics["stream_totals"]
    return [
        f"total time {metrics['total_s']:.1f} s (training passes {metrics['train_s']:.1f} s)",
        f"retrieval {stats['io_s']:.1f} s, of which hidden behind training "
        f"{stats['overlap_s']:.1f} s; consumer waited {stats['wait_s']:.1f} s",
        _wait_share_line(stats),
        f"held-out shard {metrics['held_out_shard']} ({evaluation['structures']} structures): "
        f"energy MAE {evaluation['energy_mae']:.4f} {energy_unit}, "
        f"force MAE {evaluation['force_mae']:.4f} {force_unit} "
        f"(zero-force baseline {evaluation['zero_force_mae']:.4f} {force_unit})",
    ]


def _wait_share_line(stats: dict) -> str:
    if stats.get("wait_share") is None:
        return "waiting share of the training steps: not timed"
    what = "GPU time, CUDA events" if stats["wait_clock"] == "cuda" else "wall clock"
    return (f"training steps spent {100 * stats['wait_share']:.1f}% of their time waiting "
            f"for data ({stats['step_wait_s']:.1f} s of {stats['step_s']:.1f} s, {what})")


def run(config: RunConfig, *, log=print) -> dict:
    """Train and evaluate as configured; write outputs under ``config.out``.

    Args:
        config: The run configuration.
        log: Callable for progress messages. (default: :func:`print`)

    Returns:
        The metrics (also written to ``metrics.json``), including the per-epoch traces,
        plus the trained SchNet under ``"model"`` (not written to disk).
    """
    started = time.perf_counter()
    device = torch.device(config.device)
    with sources.open_data(
        source=config.source,
        md17=config.md17,
        md17_name=config.md17_name,
        data_dir=config.data_dir,
        shard_format=config.shard_format,
        trajectory=config.trajectory,
        simulate_remote=config.simulate_remote,
        latency_s=config.latency_s,
        bandwidth_bps=config.bandwidth_bps,
        log=log,
    ) as data:
        listing = list(data.source.list_shards())
        if len(listing) < 2:
            raise ValueError(f"{data.description}: need at least 2 shards (one is held out)")
        train_count = len(listing) - 1
        if config.max_shards is not None:
            train_count = max(1, min(train_count, config.max_shards))
        train_source = sources.ShardSubset(data.source, listing, range(train_count))
        held_out_source = sources.ShardSubset(data.source, listing, [len(listing) - 1])
        log(f"data: {data.description}; training on {train_count} shard(s), "
            f"holding out {listing[-1].name}")

        model = training.build_model(
            config.model, graph.InteractionGraph(cutoff=config.model.cutoff), seed=config.seed
        )
        if config.energy_mean_per_atom is not None and config.energy_std is not None:
            mean_per_atom, std = config.energy_mean_per_atom, config.energy_std
        else:
            mean_per_atom, std = first_shard_statistics(data.source, listing)
        training.set_energy_normalisation(model, mean_per_atom, std)
        model.to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        dataset = ShardStreamDataset(
            train_source,
            prefetch=config.prefetch,
            concurrency=config.concurrency,
            shuffle=True,
            seed=config.seed,
            batch_size=config.batch_size,
        )
        epochs = []
        for epoch in range(config.epochs):
            epochs.append(
                train_epoch(dataset, model, optimizer, device, epoch=epoch,
                            force_weight=config.force_weight, show_progress=config.progress)
            )
        held_out = ShardStreamDataset(held_out_source, prefetch=0, batch_size=config.batch_size)
        evaluation = training.evaluate(model, held_out, device)

    rows = [
        {**row, "epoch": epoch["epoch"]}
        for epoch in epochs
        for row in reporting.shard_rows(epoch["trace"])
    ]
    totals = {
        key: sum(epoch["stats"][key] for epoch in epochs)
        for key in ("io_s", "deserialize_s", "consume_s", "overlap_s", "wait_s",
                    "step_wait_s", "step_s")
    }
    # the share of every training step spent waiting for data, over all epochs
    totals["wait_share"] = totals["step_wait_s"] / totals["step_s"] if totals["step_s"] else None
    totals["wait_clock"] = epochs[-1]["stats"]["wait_clock"] if epochs else None
    metrics = {
        "config": _jsonable(asdict(config)),
        "data": data.description,
        "units": list(data.units),
        "energy_normalisation": {"mean_per_atom": mean_per_atom, "std": std},
        "held_out_shard": listing[-1].name,
        "held_out": evaluation,
        "epochs": [{k: v for k, v in e.items() if k != "trace"} for e in epochs],
        "shards": rows,
        "stream_totals": totals,
        "train_s": sum(epoch["seconds"] for epoch in epochs),
        "total_s": time.perf_counter() - started,
    }
    log("")
    log(reporting.format_shard_table(rows))
    for line in _summary_lines(metrics):
        log(line)
    if config.out:
        _write_outputs(Path(config.out), metrics, epochs, log)
    # the trained model travels with the metrics (not into metrics.json) for notebooks
    return {**metrics, "model": model}


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def _write_outputs(out: Path, metrics: dict, epochs: list[dict], log) -> None:
    out.mkdir(parents=True, exist_ok=True)
    trace = [{"epoch": e["epoch"], "records": e["trace"], "stats": e["stats"]} for e in epochs]
    (out / "trace.json").write_text(json.dumps(trace, indent=1), encoding="utf-8")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
    wrote_png = reporting.plot_timeline(
        epochs[-1]["trace"], out / "timeline.png",
        title=f"epoch {epochs[-1]['epoch']}: per-shard download and training",
    )
    names = "trace.json, metrics.json" + (", timeline.png" if wrote_png else "")
    log(f"outputs written to {out.resolve()} ({names})")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    defaults = RunConfig()
    parser = argparse.ArgumentParser(
        description="SchNet energy+force training streamed from shards, with per-shard "
        "I/O overlap.",
    )
    data = parser.add_argument_group("data (default: embedded aspirin EMT trajectory)")
    data.add_argument("--source", help="local dir, http(s):// manifest URL or hf:// URI")
    data.add_argument("--md17", metavar="ROOT", help="build shards from PyG's MD17 at ROOT")
    data.add_argument("--md17-name", default=defaults.md17_name,
                      help="MD17 molecule, e.g. 'aspirin' or 'revised aspirin'")
    data.add_argument("--data-dir", default=defaults.data_dir, help="cache of embedded data")
    data.add_argument("--format", dest="shard_format", choices=("pt", "atp"),
                      default=defaults.shard_format, help="format of generated shards")
    data.add_argument("--frames", type=int, default=defaults.trajectory.frames,
                      help="embedded trajectory length (frames)")
    data.add_argument("--shard-size", type=int, default=defaults.trajectory.shard_size)
    data.add_argument("--simulate-remote", action=argparse.BooleanOptionalAction, default=None,
                      help="serve local shards over throttled loopback HTTP "
                      "(default: on for embedded data only)")
    data.add_argument("--latency", type=float, default=defaults.latency_s,
                      help="simulated latency per request, seconds")
    data.add_argument("--bandwidth", type=float, default=defaults.bandwidth_bps,
                      help="simulated bandwidth per connection, bytes/s (0: unlimited)")
    train = parser.add_argument_group("training")
    train.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    train.add_argument("--epochs", type=int, default=defaults.epochs)
    train.add_argument("--max-shards", type=int, default=None)
    train.add_argument("--prefetch", type=int, default=defaults.prefetch)
    train.add_argument("--concurrency", type=int, default=defaults.concurrency,
                       help="connections in flight (default: chosen by measurement)")
    train.add_argument("--batch-size", type=int, default=defaults.batch_size)
    train.add_argument("--lr", type=float, default=defaults.lr)
    train.add_argument("--hidden-channels", type=int, default=defaults.model.hidden_channels,
                       help="SchNet width (hidden channels and filters)")
    train.add_argument("--num-interactions", type=int, default=defaults.model.num_interactions)
    train.add_argument("--energy-mean-per-atom", type=float, default=None,
                       help="energy shift per atom (with --energy-std; default: first shard)")
    train.add_argument("--energy-std", type=float, default=None)
    train.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default=defaults.out, help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Map parsed flags onto a :class:`RunConfig`."""
    defaults = RunConfig()
    return RunConfig(
        source=args.source,
        md17=args.md17,
        md17_name=args.md17_name,
        data_dir=args.data_dir,
        shard_format=args.shard_format,
        trajectory=replace(defaults.trajectory, frames=args.frames, shard_size=args.shard_size),
        simulate_remote=args.simulate_remote,
        latency_s=args.latency,
        bandwidth_bps=args.bandwidth or None,
        model=replace(defaults.model, hidden_channels=args.hidden_channels,
                      num_filters=args.hidden_channels, num_interactions=args.num_interactions),
        device=args.device,
        epochs=args.epochs,
        max_shards=args.max_shards,
        prefetch=args.prefetch,
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        lr=args.lr,
        energy_mean_per_atom=args.energy_mean_per_atom,
        energy_std=args.energy_std,
        seed=args.seed,
        out=args.out,
        progress=not args.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The process exit status.
    """
    args = build_parser().parse_args(argv)
    try:
        run(config_from_args(args))
    except (ValueError, OSError, stream.StreamError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
