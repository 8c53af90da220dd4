"""An HTTP client made before DataLoader workers fork, so each worker starts with one.

Every request goes through huggingface_hub's shared client
(:mod:`pyg_atompack.transport.http`), which huggingface_hub closes in every forked
child, so that no connection crosses a ``fork``. Each DataLoader worker then builds a
new client before its first download, and that is slow: the client's TLS context
loads the system's CA bundle even for plain ``http://`` URLs. Measured behind
``DataLoader(num_workers=2)`` on 2 cores: 0.17–0.34 s per worker per epoch, the
largest part of the time to the first batch (a download of one 800 KB shard at the
benchmark's bandwidth took 0.16 s).

A process that lists remote shards therefore keeps one *spare* client, made with
huggingface_hub's current client factory (so it is configured as a user configured
the Hub client) next to that process's session and never used by it: it holds no
connection, so a forked child may take it over safely. In a child, :func:`client`
hands out the inherited spare (the same one for every thread of that child); in the
process that made it, and in a child whose parent had already taken it over (it may
hold connections there), it is huggingface_hub's session. A spare made with another
factory than the current one is not used.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["client", "keep_spare"]


@dataclass
class _Spare:
    client: Any
    factory: Any
    session: Any  # the session of the process that made it, when it was made
    made_in: int  # pid of the process that made it (never uses it)
    taken_by: int | None = None  # pid of the child that took it over


_spare: _Spare | None = None
_lock = threading.Lock()


def _hf_http() -> Any:
    from huggingface_hub.utils import _http

    return _http


def _current_factory() -> Any:
    # huggingface_hub has no public getter for the factory set_client_factory installs
    return getattr(_hf_http(), "_GLOBAL_CLIENT_FACTORY", None)


def _new_lock_in_child() -> None:
    # a thread of the parent may have held the lock when it forked
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def keep_spare() -> None:
    """Make the spare client of this process (call it where workers may fork).

    Does nothing in a process that already holds a spare made with the current factory
    alongside its current session (its own, or one inherited unused), or when
    huggingface_hub's factory cannot be found. A new session (after ``close_session`` or
    ``set_client_factory``) gets a new spare too.
    """
    global _spare
    factory = _current_factory()
    if factory is None:
        return
    session = _hf_http().get_session()
    spare = _spare
    if spare is not None and spare.factory is factory and (
            (spare.made_in == os.getpid() and spare.session is session)
            or (spare.made_in != os.getpid() and spare.taken_by is None)):
        return
    made = _Spare(factory(), factory, session, os.getpid())  # ~50 ms: outside the lock
    with _lock:
        if _spare is spare:
            _spare = made


def client() -> Any:
    """The HTTP client for a request from this process.

    Returns:
        httpx2.Client: The inherited spare in a forked child (see the module
        docstring), else huggingface_hub's shared session.
    """
    spare = _spare
    pid = os.getpid()
    if spare is not None and spare.made_in != pid:
        with _lock:
            if spare.taken_by is None and spare.factory is _current_factory():
                spare.taken_by = pid
            if spare.taken_by == pid:
                return spare.client
    return _hf_http().get_session()
