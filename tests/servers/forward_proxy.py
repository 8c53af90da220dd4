"""A real forward HTTP proxy (proxy.py, from PyPI) in a subprocess on 127.0.0.1.

:func:`serve_proxy` starts ``python -m proxy`` on a free loopback port with the
:mod:`servers.proxy_counter` plugin, waits until it accepts connections and yields a
:class:`ForwardProxy`, whose :meth:`ForwardProxy.seen` lists every request the proxy
forwarded (``(method, host:port/path)``), so a test can assert from the proxy's side
which requests went through it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ForwardProxy:
    """A running proxy.py process."""

    url: str
    log: Path

    def seen(self) -> list[tuple[str, str]]:
        """``(method, host:port/path?query)`` of every request forwarded so far."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [tuple(line.split(" ", 1)) for line in text.splitlines() if " " in line]


def serve_proxy(workdir: Path, *, startup_s: float = 60.0) -> Iterator[ForwardProxy]:
    """Generator for fixtures: yield a started :class:`ForwardProxy`, stop it afterwards.

    Args:
        workdir: Where the proxy's log file goes.
        startup_s: How long to wait for the proxy to accept connections.
    """
    port = _free_port()
    log = workdir / "proxied.txt"
    env = dict(os.environ, PYG_ATOMPACK_PROXY_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        env.pop(name, None)  # the proxy itself connects directly
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--hostname", "127.0.0.1", "--port", str(port),
         "--num-workers", "1", "--num-acceptors", "1", "--log-file", str(workdir / "proxy.log"),
         "--plugins", "servers.proxy_counter.CountingPlugin"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"proxy.py did not start (exit {process.poll()}); see "
                                   f"{workdir / 'proxy.log'}")
            time.sleep(0.1)
        yield ForwardProxy(f"http://127.0.0.1:{port}", log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
