"""The one retry policy of every remote read: exponential backoff with jitter.

A server's wish is honoured: ``Retry-After`` (seconds or an HTTP date) and the Hub's
``RateLimit: "resolvers";r=0;t=N`` header (IETF draft RateLimit fields), which the Hub
sends with a 429 instead of ``Retry-After``.

:func:`with_retries` is the one retry loop: the HTTP(S) transport and the object-store
backend both run their attempts through it, each turning the causes it deems transient
into :class:`TransientError` and raising everything else as it is.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from pyg_atompack.transport.errors import RemoteUnavailableError
from pyg_atompack.transport.redact import redact_url

if TYPE_CHECKING:
    from pyg_atompack.transport.http import Cancel

logger = logging.getLogger(__name__)

#: HTTP statuses worth retrying: request timeout, too many requests, every server error.
RETRYABLE_STATUSES = frozenset({408, 429, *range(500, 600)})


class TransientError(Exception):
    """A failure that a later attempt may not see (timeout, reset, 429, 5xx).

    Args:
        message (str): What happened.
        retry_after (float, optional): Seconds the server asked us to wait, if it said so.
            (default: :obj:`None`)
    """

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transfer is retried.

    The ``n``-th retry (``n = 0, 1, ...``) waits ``min(max_backoff, backoff * 2**n)``
    seconds, stretched by a random factor in ``[1, 1 + jitter]`` so that many workers
    hitting the same server do not retry in lock-step. A server's ``Retry-After`` is
    honoured: the wait is never shorter than it (capped at ``max_retry_after``).

    Args:
        retries (int, optional): Retries after the first attempt; ``0`` disables retrying.
            (default: 5)
        backoff (float, optional): First backoff in seconds. (default: 0.5)
        max_backoff (float, optional): Cap of the exponential backoff in seconds. (default: 30.0)
        jitter (float, optional): Relative random stretch of each wait. (default: 0.5)
        max_retry_after (float, optional): Cap on a server's ``Retry-After`` in seconds.
            (default: 300.0)
        timeout (float, optional): Read timeout in seconds: the longest silence tolerated while
            waiting for an answer or for the next bytes of a body. (default: 30.0)
        connect_timeout (float, optional): Seconds to establish a connection (TCP and TLS, or the
            proxy's tunnel). (default: 10.0)
        deadline (float, optional): The most seconds one transfer may spend in its attempts
            (connecting, waiting for answers, receiving), retries included and backoff waits
            excluded: a server that drips bytes just faster than ``timeout`` is cut off.
            :obj:`None` derives it per transfer (:meth:`deadline_for`). (default: :obj:`None`)
        min_speed (float, optional): The slowest average speed, in bytes per second, the derived
            deadline allows a body. (default: 131072, 128 KiB/s)
    """

    retries: int = 5
    backoff: float = 0.5
    max_backoff: float = 30.0
    jitter: float = 0.5
    max_retry_after: float = 300.0
    timeout: float = 30.0
    connect_timeout: float = 10.0
    deadline: float | None = None
    min_speed: float = 128 * 1024

    def __post_init__(self) -> None:
        if (self.retries < 0 or self.backoff < 0 or self.jitter < 0 or self.timeout <= 0
                or self.connect_timeout <= 0 or self.min_speed <= 0
                or (self.deadline is not None and self.deadline <= 0)):
            raise ValueError(f"invalid retry policy {self}")

    def deadline_for(self, size: int | None) -> float:
        """Seconds one transfer of ``size`` bytes may spend in its attempts.

        Args:
            size (int | None): The body's length, if known.

        Returns:
            ``deadline`` when set; else every attempt's connect and read timeouts plus the
            body at ``min_speed``.
        """
        if self.deadline is not None:
            return self.deadline
        attempts = (self.retries + 1) * (self.connect_timeout + self.timeout)
        return attempts + (size or 0) / self.min_speed

    def delay(self, retry_number: int, retry_after: float | None = None,
              rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry_number`` (counted from 0).

        Args:
            retry_number (int): How many retries happened before this one.
            retry_after (float, optional): The server's ``Retry-After`` in seconds, if any.
                (default: :obj:`None`)
            rng (random.Random, optional): Random generator for the jitter.
                (default: module generator)

        Returns:
            The wait in seconds.
        """
        base = min(self.max_backoff, self.backoff * (2.0**retry_number))
        wait = base * (1.0 + self.jitter * (rng or random).random())
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_retry_after))
        return wait


def parse_retry_after(value: str | None) -> float | None:
    """Parse a ``Retry-After`` header: delay seconds or an HTTP date.

    Args:
        value (str | None): The header value, or ``None``.

    Returns:
        Seconds to wait (``>= 0``), or ``None`` when absent or unreadable.
    """
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


_RATELIMIT = re.compile(r'"[^"]*"\s*;\s*r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+)')


def parse_ratelimit_reset(value: str | None) -> float | None:
    """Seconds until an exhausted rate-limit window resets, from a ``RateLimit`` header.

    The Hub answers a 429 with ``RateLimit: "resolvers";r=0;t=55`` (``r``: requests left,
    ``t``: seconds to the reset) and not necessarily with ``Retry-After``.

    Args:
        value (str | None): The header value, or ``None``.

    Returns:
        ``t`` when ``r`` is 0, else ``None`` (the limit is not what failed).
    """
    if not value:
        return None
    match = _RATELIMIT.search(value)
    if match is None or int(match.group(1)) != 0:
        return None
    return float(match.group(2))


def server_wait(headers: Mapping[str, str | None]) -> float | None:
    """The wait a server asked for: ``Retry-After``, else an exhausted ``RateLimit``.

    Args:
        headers (Mapping[str, str | None]): Response headers (a case-insensitive mapping).

    Returns:
        Seconds, or ``None``.
    """
    wait = parse_retry_after(headers.get("Retry-After"))
    return wait if wait is not None else parse_ratelimit_reset(headers.get("RateLimit"))


class TransferClock:
    """The time one transfer has spent in its attempts, against its deadline.

    Backoff waits between attempts do not count: the deadline bounds how long a server can
    hold a transfer open, not how long a user waits out a rate limit it announced.

    Args:
        url (str): For messages (redacted here).
        seconds (float): The deadline (see :meth:`RetryPolicy.deadline_for`).
    """

    def __init__(self, url: str, seconds: float) -> None:
        self.url = url
        self.seconds = seconds
        self._spent = 0.0
        self._since: float | None = None

    def start(self) -> None:
        """An attempt begins."""
        self._since = time.monotonic()

    def stop(self) -> None:
        """An attempt ended."""
        if self._since is not None:
            self._spent += time.monotonic() - self._since
            self._since = None

    def check(self, received: int | None = None) -> None:
        """Raise once the deadline has passed.

        Args:
            received (int, optional): Bytes received so far, for the message.
                (default: :obj:`None`)

        Raises:
            RemoteUnavailableError: The transfer outlived its deadline (not retried).
        """
        spent = self._spent + (time.monotonic() - self._since if self._since else 0.0)
        if spent > self.seconds:
            where = redact_url(self.url)
            got = f" after {received} bytes" if received is not None else ""
            raise RemoteUnavailableError(
                f"{where}: the transfer outlived its {self.seconds:g} s deadline{got}; the "
                f"server is too slow (raise RetryPolicy(deadline=) or lower min_speed for a "
                f"slow link)", url=where)


def with_retries(attempt: Callable[[], Any], *, url: str, policy: RetryPolicy,
                 cancel: Cancel | None = None,
                 position: Callable[[], int] | None = None) -> Any:
    """Run ``attempt`` until it succeeds, retrying :class:`TransientError` under ``policy``.

    Any other exception ends the loop at once (permanent causes are never retried).

    Args:
        attempt (Callable[[], Any]): One try; raises :class:`TransientError` for causes worth
            retrying.
        url (str): For messages (redacted here).
        policy (RetryPolicy): Retries and backoff.
        cancel (Cancel, optional): Interrupts backoff waits (its ``sleep(seconds)`` raises
            when cancelled). (default: :obj:`None`, plain sleeps)
        position (Callable[[], int], optional): Where a resumed transfer continues, for the log.
            (default: none)

    Returns:
        What ``attempt`` returned.

    Raises:
        RemoteUnavailableError: Every attempt failed for a transient cause (the message
            names the redacted URL, the attempt count and the last cause).
    """
    where = redact_url(url)
    sleep = getattr(cancel, "sleep", None) or time.sleep
    for number in range(policy.retries + 1):
        try:
            return attempt()
        except TransientError as error:
            if number == policy.retries:
                raise RemoteUnavailableError(
                    f"{where}: giving up after {number + 1} attempts: {error}", url=where
                ) from error
            wait = policy.delay(number, error.retry_after)
            resume = f" (resuming at byte {position()})" if position else ""
            logger.warning("%s: %s; retry %d/%d in %.2fs%s", where, error, number + 1,
                           policy.retries, wait, resume)
            sleep(wait)
    raise AssertionError("unreachable")
