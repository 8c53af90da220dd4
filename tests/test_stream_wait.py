"""The consumer's wait for data: StepWaitMeter (wall clock, CUDA events) and stats()."""

from __future__ import annotations

import time

import pytest
import torch
from servers.http_server import serve_directory, write_pt_shards
from torch.utils.data import DataLoader

from pyg_atompack.stream import RemoteSource, ShardStreamDataset
from pyg_atompack.stream.trace import StepWaitMeter, resolve_wait_clock
from pyg_atompack.transport import RetryPolicy

FAST = RetryPolicy(retries=2, backoff=0.01, timeout=10.0)


class FakeGPU:
    """A stream whose work runs after what was queued before it, on a simulated clock.

    The host's clock is ``now``; queuing work of ``seconds`` makes the stream busy until
    ``max(now, busy_until) + seconds`` and returns at once (launches are asynchronous).
    An event recorded now is reached when the stream has done everything queued before.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.busy_until = 0.0

    def launch(self, seconds: float) -> None:
        self.busy_until = max(self.now, self.busy_until) + seconds

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    """The ``torch.cuda.Event`` calls the meter makes, against a :class:`FakeGPU`."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.reached = None

    def record(self) -> None:
        self.reached = max(self.gpu.now, self.gpu.busy_until)

    def query(self) -> bool:
        return self.gpu.now >= self.reached

    def synchronize(self) -> None:
        self.gpu.now = max(self.gpu.now, self.reached)

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.reached - self.reached) * 1e3


def _run_steps(meter: StepWaitMeter, gpu: FakeGPU, *, steps: int, data_s: float,
               host_s: float, gpu_s: float) -> None:
    """``steps`` steps: wait ``data_s`` for a batch, spend ``host_s`` launching ``gpu_s``."""
    for _ in range(steps):
        meter.asked()
        gpu.now += data_s
        meter.received("shard")
        gpu.launch(gpu_s)
        gpu.now += host_s
    meter.asked()  # the consumer asks once more and learns the stream has ended


def test_cuda_clock_counts_only_the_time_the_gpu_sat_idle():
    # the batch arrives while the GPU still runs the previous step: the host waited
    # 10 ms of each 11 ms step, the GPU never did (after the first step)
    gpu = FakeGPU()
    meter = StepWaitMeter("cuda", event_factory=gpu.event)
    _run_steps(meter, gpu, steps=10, data_s=0.010, host_s=0.001, gpu_s=0.030)
    summary = meter.summary()
    assert summary["wait_clock"] == "cuda"
    assert summary["steps"] == 10
    assert summary["step_wait_s"] == pytest.approx(0.010)  # the first step only
    assert summary["step_s"] == pytest.approx(0.010 + 10 * 0.030)
    assert summary["wait_share"] == pytest.approx(0.010 / 0.310)
    assert meter.by_key["shard"][0] == 10


def test_cuda_clock_sees_a_starved_gpu():
    # data takes 3x the GPU's work: each step the GPU idles for data - (gpu - host)
    gpu = FakeGPU()
    meter = StepWaitMeter("cuda", event_factory=gpu.event)
    _run_steps(meter, gpu, steps=8, data_s=0.030, host_s=0.001, gpu_s=0.010)
    summary = meter.summary()
    idle = 0.030 + 0.001 - 0.010  # from the previous step's end to the batch's arrival
    assert summary["step_wait_s"] == pytest.approx(0.030 + 7 * idle)
    assert summary["wait_share"] == pytest.approx(summary["step_wait_s"] / summary["step_s"])
    assert summary["wait_share"] > 0.6


def test_cuda_events_are_read_as_they_complete_not_kept():
    gpu = FakeGPU()
    meter = StepWaitMeter("cuda", event_factory=gpu.event)
    _run_steps(meter, gpu, steps=50, data_s=0.002, host_s=0.004, gpu_s=0.001)
    assert meter.steps >= 49  # read while running: the GPU kept up with the host
    assert len(meter._open) <= 1


def test_wall_clock_share_of_a_slow_source():
    def slow(count: int):
        for index in range(count):
            time.sleep(0.03)  # the data takes 3x the consumer's compute
            yield index

    meter = StepWaitMeter("wall")
    for _ in meter.wrap(slow(6)):
        time.sleep(0.01)
    summary = meter.summary()
    assert summary["steps"] == 6 and summary["wait_clock"] == "wall"
    assert summary["step_s"] >= 6 * 0.04
    assert 0.5 < summary["wait_share"] < 1.0  # 0.75 if sleeps were exact


def test_a_step_left_with_break_is_not_counted():
    meter = StepWaitMeter("wall")
    for index in meter.wrap(range(5)):
        if index == 2:
            break
    assert meter.summary()["steps"] == 2


def test_wait_clock_choices():
    assert resolve_wait_clock("wall") == "wall"
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert resolve_wait_clock("auto") == "wall"
    with pytest.raises(ValueError, match="wait_clock must be one of"):
        resolve_wait_clock("gpu")


@pytest.fixture
def throttled(tmp_path):
    """4 shards of 8 samples, each request answered after 0.24 s."""
    write_pt_shards(tmp_path, [8] * 4, atoms=3)
    yield from serve_directory(tmp_path, ttfb_s=0.24)


def _consume(items, compute_s: float) -> int:
    count = 0
    for _ in items:
        time.sleep(compute_s)
        count += 1
    return count


def test_stats_share_when_downloads_are_three_times_compute(throttled):
    # prefetch=0: every download happens inside next(); downloads 0.24 s per shard,
    # compute 0.08 s per shard (4 batches of 2 samples x 20 ms)
    dataset = ShardStreamDataset(RemoteSource(throttled.url("manifest.json"), retry=FAST),
                                 prefetch=0, batch_size=2)
    assert _consume(dataset, 0.02) == 16
    stats = dataset.stats()
    assert stats["wait_clock"] == "wall"
    assert stats["steps"] == 16
    assert stats["step_wait_s"] >= stats["wait_s"] > 0  # next() also builds the batch
    assert stats["step_s"] >= 16 * 0.02 + stats["step_wait_s"] - 1e-6
    assert stats["wait_share"] > 0.5  # 0.75 if the downloads took exactly 3x compute
    per_shard = sorted(dataset.trace, key=lambda r: r["shard_index"])
    assert sum(r["steps"] for r in per_shard) == 16
    assert sum(r["step_wait_s"] for r in per_shard) == pytest.approx(stats["step_wait_s"])
    for record in per_shard:  # each shard's first step waits for its download
        assert record["step_wait_s"] / record["step_time_s"] > 0.5


def test_stats_share_falls_when_prefetch_hides_downloads(throttled):
    # compute 0.4 s per shard against 0.24 s downloads: after the first shard the next
    # one is in before it is asked for
    dataset = ShardStreamDataset(RemoteSource(throttled.url("manifest.json"), retry=FAST),
                                 prefetch=1, batch_size=2)
    _consume(dataset, 0.1)
    stats = dataset.stats()
    assert stats["steps"] == 16 and stats["wait_clock"] == "wall"
    assert stats["wait_share"] < 0.5  # the first download (~0.24 s of ~1.9 s) dominates


def test_stats_without_steps_behind_workers(throttled):
    dataset = ShardStreamDataset(RemoteSource(throttled.url("manifest.json"), retry=FAST),
                                 prefetch=2, batch_size=4)
    meter = StepWaitMeter()
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    assert _consume(meter.wrap(loader), 0.0) == 8
    stats = dataset.stats()
    assert stats["structures"] == 32
    assert stats["wait_share"] is None and stats["steps"] == 0
    assert meter.summary()["steps"] == 8  # the wrapped loader is timed instead


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_on_a_real_gpu():
    # a GPU step of ~20 ms queued asynchronously while the data takes 5 ms: the GPU
    # never idles after the first step; the wall clock sees the host waiting
    cycles = int(0.02 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    torch.cuda.init()
    meter = StepWaitMeter("cuda")
    wall = StepWaitMeter("wall")
    for _ in range(10):
        meter.asked()
        wall.asked()
        time.sleep(0.005)
        meter.received()
        wall.received()
        torch.cuda._sleep(cycles)
    meter.asked()
    wall.asked()
    torch.cuda.synchronize()
    assert meter.summary()["wait_share"] < 0.2
    assert wall.summary()["wait_share"] > 0.8
