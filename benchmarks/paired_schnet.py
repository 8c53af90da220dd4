"""Paired benchmark: SchNet training passes with sequential vs prefetching shard streaming.

Protocol (one *pair* = one pass of each arm over the same training shards):

* the *sequential* arm streams with ``prefetch=0`` (each shard is downloaded when the
  trainer asks for it), the *prefetch* arm with ``prefetch=1`` (or ``--prefetch``);
* both arms start from the same initial weights and the same Adam state, and read the
  shards and samples in the same order (same seed and epoch);
* the arm that runs first alternates from pair to pair, so drift on a shared machine hits
  both arms alike; one untimed warm-up batch runs before the first pair;
* on a GPU the device is synchronised at every step (the loss is read back) and at the
  end of every pass.

Reported: per-pair times, the geometric-mean speed-up with a deterministic percentile
bootstrap 95% interval (20,000 resamples), mean and median time saved with intervals,
I/O, compute, overlap and consumer wait per pass (from the stream trace) and peak RSS.
An optional third arm (``--foldpipe``) runs FoldPipe's ``AsyncFoldPipeLoader`` over the
same shards and source. Statistics come from ``benchmarks/paired_stats.py``.

The default data are the embedded aspirin EMT shards served by the throttled loopback
server; choose ``--bandwidth`` so that downloading a shard takes about as long as
training on it (D/C ~ 1), where prefetching can at best halve the pass time.

``--consumer gil`` measures the GPU's regime on a CPU. A training loop that drives a GPU
is a Python thread launching kernels: it holds the GIL nearly all the time while the
GPU does the arithmetic, so the stream's threads have the cores but not the GIL. A CPU
training step is the opposite (its big kernels release the GIL and take every core).
So each training step is replaced by ``harness.hold_gil`` for the same time: the
median of real steps on this machine (timed on the first shard before the pairs), or
``--step-seconds`` (e.g. a GPU's measured step). The batch is still built, handed
over and moved to ``--device``; the model's weights are not updated.

Run::

    python benchmarks/paired_schnet.py --pairs 20 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import aspirin  # noqa: E402
import paired_stats  # noqa: E402
import sources  # noqa: E402
import training  # noqa: E402
from harness import hold_gil  # noqa: E402
from loopback import LoopbackServer  # noqa: E402
from torch_geometric.data import Batch  # noqa: E402

from pyg_atompack import ShardStreamDataset, graph, stream  # noqa: E402


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Trainer:
    """Runs timed training passes that all start from the same weights and optimizer state.

    Args:
        model: The SchNet (already normalised and on its device).
        device: Torch device.
        lr: Adam learning rate.
        gil_step_s: When set, every step holds the GIL for this many seconds
            (``harness.hold_gil``) instead of training: the GPU's regime on a CPU.
    """

    def __init__(self, model, device: torch.device, lr: float,
                 gil_step_s: float | None = None):
        self.model = model
        self.device = device
        self.lr = lr
        self.gil_step_s = gil_step_s
        self.initial_weights = copy.deepcopy(model.state_dict())

    def _reset(self) -> torch.optim.Optimizer:
        self.model.load_state_dict(self.initial_weights)
        return torch.optim.Adam(self.model.parameters(), lr=self.lr)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_up(self, batch) -> None:
        """One untimed step (allocations, lazy initialisation), then restore the weights."""
        optimizer = self._reset()
        training.train_step(self.model, optimizer, batch.to(self.device))
        self._sync()

    def timed_pass(self, batches) -> tuple[float, int]:
        """Train on every batch of ``batches`` from the initial state.

        Returns:
            ``(seconds, steps)``.
        """
        optimizer = self._reset()
        self._sync()
        started = time.perf_counter()
        steps = 0
        for batch in batches:
            batch = batch.to(self.device)
            if self.gil_step_s is None:
                training.train_step(self.model, optimizer, batch)
            else:
                hold_gil(self.gil_step_s)
            steps += 1
        self._sync()
        return time.perf_counter() - started, steps

    def median_step(self, batches, steps: int = 5) -> float:
        """Median seconds of ``steps`` real training steps (weights restored afterwards)."""
        optimizer = self._reset()
        times = []
        for batch, _ in zip(batches, range(steps)):
            batch = batch.to(self.device)
            self._sync()
            started = time.perf_counter()
            training.train_step(self.model, optimizer, batch)
            self._sync()
            times.append(time.perf_counter() - started)
        self._reset()
        return float(np.median(times))


def stream_pass(trainer: Trainer, source, *, prefetch: int, concurrency: int,
                batch_size: int, seed: int) -> dict:
    """One training pass through :class:`ShardStreamDataset`; time plus trace figures."""
    dataset = ShardStreamDataset(source, prefetch=prefetch, concurrency=concurrency,
                                 shuffle=True, seed=seed, batch_size=batch_size)
    dataset.set_epoch(0)
    seconds, steps = trainer.timed_pass(dataset)
    overlap = paired_stats.trace_overlap(dataset.trace)
    stats = dataset.stats()
    return {"seconds": seconds, "steps": steps, **overlap.to_dict(),
            "stream_wait_s": stats["wait_s"], "wait_share": stats["wait_share"],
            "wait_clock": stats["wait_clock"], "peak_rss_mib": peak_rss_mib()}


class _FoldPipeShards:
    """FoldPipe ``Source`` protocol (``iter_files`` / ``download_chunk``) over our source."""

    def __init__(self, source, order, seed: int):
        self.source = source
        self.order = list(order)
        self.seed = seed

    def iter_files(self):
        return iter(self.order)

    def download_chunk(self, info):
        samples = stream.decode_shard(self.source.fetch(info, stream.CancelToken()), info.name)
        permutation = np.random.default_rng([self.seed, len(info.name)]).permutation(len(samples))
        return [samples[i] for i in permutation]


def foldpipe_pass(trainer: Trainer, source, *, batch_size: int, seed: int) -> dict:
    """One training pass through FoldPipe's ``AsyncFoldPipeLoader`` (one shard ahead)."""
    from foldpipe import AsyncFoldPipeLoader

    def batches(chunk):
        for start in range(0, len(chunk), batch_size):
            yield Batch.from_data_list(chunk[start:start + batch_size])

    listing = list(source.list_shards())
    loader = AsyncFoldPipeLoader(_FoldPipeShards(source, listing, seed), batch_size=batch_size,
                                 batch_fn=batches)
    seconds, steps = trainer.timed_pass(loader)
    return {"seconds": seconds, "steps": steps, "peak_rss_mib": peak_rss_mib()}


def _interval(values) -> str:
    return f"[{values[0]:.3f}, {values[1]:.3f}]"


def markdown_report(result: dict) -> str:
    """The results table (markdown) of one benchmark run."""
    summary = result["summary"]
    setup = result["setup"]
    lines = [
        "# Paired SchNet streaming benchmark",
        "",
        f"Generated by `benchmarks/paired_schnet.py` on {result['machine']}.",
        f"Data: {setup['data']}; {setup['train_shards']} training shards of "
        f"{setup['shard_size']} structures ({setup['shard_bytes']} bytes each), "
        f"loopback latency {setup['latency_s']} s, bandwidth {setup['bandwidth_bps']:.0f} B/s.",
        f"Model: SchNet {setup['model']}, batch {setup['batch_size']}, device {setup['device']}.",
        f"Consumer: {setup['consumer']}.",
        f"D/C (download time / training time per shard, sequential arm): "
        f"{result['d_over_c']:.2f}.",
        "",
        "| pair | first | sequential s | prefetch s | speed-up | seq. wait s | pref. wait s "
        "| pref. overlap s |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for pair in result["pairs"]:
        seq, pre = pair["sequential"], pair["prefetch"]
        lines.append(
            f"| {pair['pair']} | {pair['first']} | {seq['seconds']:.2f} | {pre['seconds']:.2f} "
            f"| {seq['seconds'] / pre['seconds']:.3f} | {seq['wait']:.2f} | {pre['wait']:.2f} "
            f"| {pre['overlap']:.2f} |"
        )
    lines += [
        "",
        f"- pairs: {summary['pairs']}",
        f"- geometric-mean speed-up (sequential / prefetch): **{summary['speedup_geomean']:.3f}** "
        f"(95% bootstrap CI {_interval(summary['speedup_ci'])}, "
        f"{result['resamples']} resamples)",
        f"- mean time saved per pass: {summary['saved_mean']:.2f} s "
        f"(95% CI {_interval(summary['saved_mean_ci'])})",
        f"- median time saved per pass: {summary['saved_median']:.2f} s "
        f"(95% CI {_interval(summary['saved_median_ci'])})",
        f"- median pass: sequential {summary['baseline_median']:.2f} s, "
        f"prefetch {summary['candidate_median']:.2f} s",
        f"- mean per pass, sequential: I/O {result['means']['sequential']['io']:.2f} s, "
        f"compute {result['means']['sequential']['compute']:.2f} s, "
        f"overlap {result['means']['sequential']['overlap']:.2f} s, "
        f"wait {result['means']['sequential']['wait']:.2f} s",
        f"- mean per pass, prefetch: I/O {result['means']['prefetch']['io']:.2f} s, "
        f"compute {result['means']['prefetch']['compute']:.2f} s, "
        f"overlap {result['means']['prefetch']['overlap']:.2f} s, "
        f"wait {result['means']['prefetch']['wait']:.2f} s",
        f"- share of each step spent waiting for data (`stats()['wait_share']`, "
        f"{result['pairs'][0]['prefetch']['wait_clock']} clock; mean): sequential "
        f"{result['means']['sequential']['wait_share']:.2f}, "
        f"prefetch {result['means']['prefetch']['wait_share']:.2f}",
        f"- peak RSS: {result['peak_rss_mib']:.0f} MiB",
    ]
    if result.get("foldpipe"):
        fold = result["foldpipe"]
        lines.append(
            f"- FoldPipe arm: median {fold['median_s']:.2f} s, geometric-mean speed-up vs "
            f"sequential {fold['speedup_geomean']:.3f} (95% CI {_interval(fold['speedup_ci'])})"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    """Per-pair times of both arms and the speed-up interval, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the figure")
        return False
    pairs = [p["pair"] for p in result["pairs"]]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, colour in (("sequential", "tab:red"), ("prefetch", "tab:green")):
        left.plot(pairs, [p[arm]["seconds"] for p in result["pairs"]], "o-", color=colour,
                  label=arm)
    left.set_xlabel("pair")
    left.set_ylabel("pass time (s)")
    left.legend()
    speedups = [p["sequential"]["seconds"] / p["prefetch"]["seconds"] for p in result["pairs"]]
    right.plot(pairs, speedups, "o", color="tab:blue", label="per pair")
    summary = result["summary"]
    right.axhline(summary["speedup_geomean"], color="black", label="geometric mean")
    right.axhspan(*summary["speedup_ci"], color="grey", alpha=0.3, label="95% CI")
    right.axhline(1.0, color="tab:red", linestyle=":")
    right.set_xlabel("pair")
    right.set_ylabel("speed-up (sequential / prefetch)")
    right.legend(fontsize="small")
    figure.suptitle(f"SchNet streaming, D/C = {result['d_over_c']:.2f}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _arm_means(pairs: list[dict], arm: str) -> dict:
    keys = ("io", "compute", "overlap", "wait", "wait_share")
    return {key: float(np.mean([p[arm][key] for p in pairs])) for key in keys}


def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the paired protocol as configured by the parsed flags; return the results."""
    device = torch.device(args.device)
    trajectory = aspirin.TrajectoryConfig(frames=args.frames, shard_size=args.shard_size)
    root = aspirin.prepare_aspirin_shards(args.data_dir, trajectory)
    directory = root / args.format
    model_config = training.ModelConfig(hidden_channels=args.hidden_channels,
                                        num_filters=args.hidden_channels,
                                        num_interactions=args.num_interactions)
    with LoopbackServer(directory, latency_s=args.latency,
                        bandwidth_bps=args.bandwidth or None) as server:
        source = stream.RemoteSource(server.url("manifest.json"))
        listing = list(source.list_shards())
        count = len(listing) - 1 if args.max_shards is None else min(args.max_shards,
                                                                        len(listing) - 1)
        train = sources.ShardSubset(source, listing, range(count))
        first = stream.decode_shard(source.fetch(listing[0], stream.CancelToken()),
                                    listing[0].name)
        model = training.build_model(model_config, graph.InteractionGraph(model_config.cutoff),
                                     seed=args.seed)
        training.set_energy_normalisation(model, *training.energy_statistics(first))
        trainer = Trainer(model.to(device), device, args.lr)
        first_batches = [Batch.from_data_list(list(first[i:i + args.batch_size]))
                         for i in range(0, len(first), args.batch_size)]
        trainer.warm_up(first_batches[0])
        if args.consumer == "gil":  # the GIL held for as long as a training step takes
            trainer.gil_step_s = args.step_seconds or trainer.median_step(first_batches)
            print(f"GIL-holding consumer: {trainer.gil_step_s * 1e3:.1f} ms per step",
                  flush=True)
        options = dict(batch_size=args.batch_size, seed=args.seed)
        pairs = []
        for pair in range(args.pairs):
            order = ["sequential", "prefetch"] if pair % 2 == 0 else ["prefetch", "sequential"]
            record = {"pair": pair, "first": order[0]}
            for arm in order:
                # the sequential baseline downloads one shard at a time over one connection
                prefetch, concurrency = ((0, 1) if arm == "sequential"
                                         else (args.prefetch, args.concurrency))
                record[arm] = stream_pass(trainer, train, prefetch=prefetch,
                                          concurrency=concurrency, **options)
            if args.foldpipe:
                record["foldpipe"] = foldpipe_pass(trainer, train, batch_size=args.batch_size,
                                                   seed=args.seed)
            pairs.append(record)
            print(f"pair {pair}: sequential {record['sequential']['seconds']:.2f} s, "
                  f"prefetch {record['prefetch']['seconds']:.2f} s", flush=True)
    sequential = [p["sequential"]["seconds"] for p in pairs]
    prefetched = [p["prefetch"]["seconds"] for p in pairs]
    summary = paired_stats.summarize_pairs(sequential, prefetched, resamples=args.resamples)
    seq_means = _arm_means(pairs, "sequential")
    result = {
        "machine": f"{platform.node() or 'host'} ({platform.processor() or platform.machine()},"
                   f" {torch.get_num_threads()} torch threads)",
        "setup": {
            "data": f"embedded aspirin EMT ({args.format} shards)",
            "train_shards": count,
            "shard_size": args.shard_size,
            "shard_bytes": listing[0].size,
            "latency_s": args.latency,
            "bandwidth_bps": args.bandwidth or 0.0,
            "model": model_config.__dict__,
            "batch_size": args.batch_size,
            "device": str(device),
            "prefetch": args.prefetch,
            "concurrency": args.concurrency,
            "consumer": ("training steps" if trainer.gil_step_s is None else
                         f"the GIL held for {trainer.gil_step_s * 1e3:.1f} ms per step "
                         "(harness.hold_gil) instead of training"),
        },
        "resamples": args.resamples,
        "pairs": pairs,
        "summary": summary.to_dict(),
        "means": {"sequential": seq_means, "prefetch": _arm_means(pairs, "prefetch")},
        "d_over_c": seq_means["io"] / max(seq_means["compute"], 1e-9),
        "peak_rss_mib": peak_rss_mib(),
    }
    if args.foldpipe:
        folded = [p["foldpipe"]["seconds"] for p in pairs]
        fold = paired_stats.summarize_pairs(sequential, folded, resamples=args.resamples)
        result["foldpipe"] = {"median_s": float(np.median(folded)),
                              "speedup_geomean": fold.speedup_geomean,
                              "speedup_ci": fold.speedup_ci}
    return result


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--frames", type=int, default=1792)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--max-shards", type=int, default=None)
    parser.add_argument("--format", choices=("pt", "atp"), default="pt")
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--bandwidth", type=float, default=0.1e6,
                        help="bytes/s per connection; tune for D/C ~ 1")
    parser.add_argument("--hidden-channels", type=int, default=128)
    parser.add_argument("--num-interactions", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resamples", type=int, default=paired_stats.DEFAULT_RESAMPLES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--foldpipe", action="store_true", help="add the FoldPipe arm")
    parser.add_argument("--consumer", choices=("train", "gil"), default="train",
                        help="train, or hold the GIL for a step's time (the GPU's regime)")
    parser.add_argument("--step-seconds", type=float, default=None,
                        help="with --consumer gil: seconds per step (default: the median "
                             "of real training steps here)")
    parser.add_argument("--data-dir", default=str(Path.home() / ".cache" / "pyg_atompack"
                                                  / "examples"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                        help="folder for schnet.json and schnet.md")
    parser.add_argument("--figure", default=str(ROOT / "benchmarks" / "figures"
                                                / "schnet_paired.png"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write JSON, markdown and the figure."""
    args = build_parser().parse_args(argv)
    if args.pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    result = run_benchmark(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "schnet.json").write_text(json.dumps(result, indent=1, default=str),
                                     encoding="utf-8")
    report = markdown_report(result)
    (out / "schnet.md").write_text(report, encoding="utf-8")
    Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
    plot(result, Path(args.figure))
    print(report)
    print(f"results written to {out / 'schnet.json'}, {out / 'schnet.md'} and {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
