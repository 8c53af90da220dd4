"""What the streaming benchmarks share around their arms: loopback servers in child
processes, a sampler of peak memory (and local disk) and a consumer that holds the GIL.

A server runs in a forked child so that its pacing threads never compete for the
benchmark's GIL; the child reports what its clients need (a port, or a pair of ports)
through a queue. Used by ``stream_overlap.py``, ``stream_blocks.py``, ``peers.py`` and,
inside the MosaicML venv, ``peer_mosaic.py``: importing this module needs only the
standard library (the server targets import the test servers when they run).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
_TESTS = str(Path(__file__).resolve().parent.parent / "tests")


def rss_bytes() -> int:
    """Resident set size of this process, from ``/proc/self/statm``.

    Returns:
        The size in bytes.
    """
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


def dir_bytes(directory: str | os.PathLike) -> int:
    """Bytes of every file below ``directory`` (files removed meanwhile count as 0).

    Args:
        directory (str | os.PathLike): The folder to walk.

    Returns:
        The total size in bytes.
    """
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we looked
                total += os.stat(os.path.join(root, name)).st_size
    return total


class PeakSampler:
    """Peak RSS of this process and peak bytes under a directory, sampled on a thread.

    Use as a context manager around one run; the disk is sampled once more on exit.

    Args:
        directory (str | os.PathLike, optional): Folder whose size is tracked.
            (default: :obj:`None`, no disk)
        interval (float, optional): Seconds between samples. (default: :obj:`0.01`)
    """

    def __init__(self, directory: str | os.PathLike | None = None,
                 interval: float = 0.01) -> None:
        self.directory = directory
        self.interval = interval
        self.baseline = rss_bytes()
        self.peak_rss = self.baseline
        self.peak_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, rss_bytes())
        if self.directory is not None:
            self.peak_disk = max(self.peak_disk, dir_bytes(self.directory))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    @property
    def growth(self) -> int:
        """Peak RSS minus the RSS at construction, in bytes."""
        return self.peak_rss - self.baseline

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ------------------------------------------------------------------ the GIL-bound consumer
#: Seconds one block of :func:`hold_gil`'s loop is calibrated to last: the clock is read
#: once per block, so the hold overshoots its deadline by at most about this much.
GIL_BLOCK_S = 2e-4


def _spin(iterations: int) -> int:
    value = 0
    for step in range(iterations):
        value = (value * 31 + step) & 0xFFFF  # integer arithmetic: bytecodes, no C call
    return value


@functools.lru_cache(maxsize=1)
def gil_block_iterations() -> int:
    """Iterations of :func:`hold_gil`'s loop that take about :data:`GIL_BLOCK_S` here.

    Measured once per process (the fastest of five timings of 20,000 iterations).

    Returns:
        The block size, at least 16.
    """
    probe = 20_000
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        _spin(probe)
        best = min(best, time.perf_counter() - started)
    return max(16, int(probe * GIL_BLOCK_S / max(best, 1e-9)))


def hold_gil(seconds: float) -> float:
    """Run pure Python for ``seconds``: the stand-in for a GPU training step.

    A training loop that drives a GPU is a Python thread launching kernels: it holds
    the GIL nearly all the time and gives it up only when the interpreter forces a
    switch (every ``sys.getswitchinterval()``, 5 ms by default). This loop of integer
    arithmetic does the same: it reads the clock once per block of
    :func:`gil_block_iterations` iterations, never sleeps and calls nothing that
    releases the GIL. A thread that releases the GIL between small pieces of work (a
    download around each ``recv``, a decoder around each read) then waits for it at
    every turn; :func:`gil_probe` measures how much.

    Args:
        seconds (float): How long to hold the GIL.

    Returns:
        The seconds actually spent (at least ``seconds``).
    """
    block = gil_block_iterations()
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        _spin(block)
    return time.perf_counter() - started


def _probe_units(stop: threading.Event, counts: list[int]) -> None:
    # what a retrieval thread does: a little Python, then a call that releases the GIL
    units = 0
    while not stop.is_set():
        _spin(50)
        time.sleep(0)
        units += 1
    counts.append(units)


def gil_probe(seconds: float = 0.2) -> dict:
    """How much a thread that gives the GIL up between small steps gets done beside a consumer.

    A probe thread repeats a unit of work (a little pure Python, then ``time.sleep(0)``,
    which releases the GIL like a socket read) while the calling thread first sleeps for
    ``seconds`` (a GIL-free consumer), then holds the GIL for ``seconds`` with
    :func:`hold_gil`. The ratio of units done is near 1 when the consumer lets the
    thread run and near 0 when it starves it (0.06 measured on the 2-core VM).

    Args:
        seconds (float, optional): Length of each of the two windows. (default: :obj:`0.2`)

    Returns:
        ``{"units_sleep", "units_gil", "ratio"}`` (``ratio = units_gil / units_sleep``).
    """
    units = {}
    for consumer, run in (("sleep", time.sleep), ("gil", hold_gil)):
        stop, counts = threading.Event(), []
        thread = threading.Thread(target=_probe_units, args=(stop, counts), daemon=True)
        thread.start()
        run(seconds)
        stop.set()
        thread.join()
        units[consumer] = counts[0]
    return {"units_sleep": units["sleep"], "units_gil": units["gil"],
            "ratio": units["gil"] / max(units["sleep"], 1)}


# ------------------------------------------------------------------ server targets
def _test_servers() -> None:
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)


def serve_http(root: str, bandwidth: float | None, queue: Any) -> None:
    """Child target: the throttled loopback file server over ``root``; reports its port.

    Args:
        root (str): Directory served (``/name`` -> ``root/name``).
        bandwidth (float | None): Bytes per second per connection (:obj:`None`:
            unthrottled).
        queue (Any): Receives the port.
    """
    _test_servers()
    from servers.http_server import ShardServer

    server = ShardServer(root, bandwidth=bandwidth)
    queue.put(server.server_address[1])
    server.serve_forever(poll_interval=0.05)


def serve_relay(upstream_port: int, bandwidth: float, queue: Any) -> None:
    """Child target: a paced TCP relay in front of ``upstream_port``; reports its port.

    Args:
        upstream_port (int): Loopback port relayed to.
        bandwidth (float): Bytes per second per connection.
        queue (Any): Receives the relay's port.
    """
    _test_servers()
    from servers.tcp_proxy import ThrottlingProxy

    proxy = ThrottlingProxy(upstream_port, bandwidth=bandwidth).start()
    queue.put(proxy.port)
    threading.Event().wait()


def serve_s3_relay(bandwidth: float, queue: Any) -> None:
    """Child target: a moto S3 server and a paced relay in front of it, in one process.

    Args:
        bandwidth (float): Bytes per second per connection through the relay.
        queue (Any): Receives ``(moto port, relay port)``.
    """
    import logging

    _test_servers()
    from moto.server import ThreadedMotoServer
    from servers.tcp_proxy import ThrottlingProxy

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    _, port = moto.get_host_and_port()
    proxy = ThrottlingProxy(port, bandwidth=bandwidth).start()
    queue.put((port, proxy.port))
    threading.Event().wait()


class ServerProcess:
    """A server target running in a forked child process until :meth:`stop`.

    Args:
        target (Callable[..., None]): ``target(*args, queue)``, e.g. :func:`serve_http`;
            it puts what clients need on ``queue`` once it listens, then serves forever.
        *args (Any): The target's arguments before the queue.
        timeout (float, optional): Seconds to wait for the target's answer.
            (default: :obj:`60`)
    """

    def __init__(self, target: Callable[..., None], *args: Any, timeout: float = 60) -> None:
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        self.process = context.Process(target=target, args=(*args, queue), daemon=True)
        self.process.start()
        self.answer = queue.get(timeout=timeout)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` for a target that answered with one port."""
        return f"http://127.0.0.1:{self.answer}"

    def stop(self) -> None:
        """Terminate the child and wait for it (up to 5 s)."""
        self.process.terminate()
        self.process.join(5)
