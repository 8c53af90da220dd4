"""Request headers whose credentials are bound to the origins they were given for.

A secret (``Authorization``, ``Cookie``, ``Proxy-Authorization``) is given for one server:
the Hub token for the Hub's endpoint, a user's ``headers=`` for the URL the user typed.
Whatever a server answers afterwards — a manifest entry naming another host, a redirect to
a CDN, a ``Link: rel="next"`` to elsewhere, a part of a split download — the secret must
reach no other origin, and never travel over plain ``http://`` when it was given for
``https://``.

The rule is enforced by type rather than at each call site: every request of the transport
takes a :class:`RequestHeaders`, whose credentials carry the set of origins (scheme, host,
port) they may go to, fixed when the user's URL was known. A plain mapping holding a
credential header is refused (:func:`request_headers`), so no code path can send one without
saying where it belongs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["CREDENTIAL_HEADERS", "Origin", "RequestHeaders", "bind_headers", "origin",
           "request_headers"]

#: Headers that authenticate the sender (compared lower-case).
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})

_DEFAULT_PORTS = {"http": 80, "https": 443}

Origin = tuple[str, str, int]


def origin(url: str) -> Origin:
    """``(scheme, host, port)`` of a URL, with the scheme's default port filled in.

    Args:
        url (str): An absolute URL.

    Returns:
        The origin triple (lower-case scheme and host; port 0 when unknown).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # a malformed port: an origin nothing is bound to
        port = -1
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme, 0)


@dataclass(frozen=True, repr=False)
class RequestHeaders:
    """Headers for every request of one remote location, credentials bound to origins.

    Args:
        plain (Mapping[str, str], optional): Headers sent to every hop. (default: none)
        secret (Mapping[str, str], optional): Credential headers. (default: none)
        origins (frozenset[Origin], optional): Where ``secret`` may be sent.
            (default: nowhere)
    """

    plain: Mapping[str, str] = field(default_factory=dict)
    secret: Mapping[str, str] = field(default_factory=dict)
    origins: frozenset[Origin] = frozenset()

    def for_url(self, url: str) -> dict[str, str]:
        """The headers to send with a request to ``url``.

        Args:
            url (str): The address of this hop (after redirects).

        Returns:
            The plain headers, plus the credentials when ``url``'s origin is one they
            were given for.
        """
        headers = dict(self.plain)
        if self.secret and origin(url) in self.origins:
            headers.update(self.secret)
        return headers

    def carries_credentials(self) -> bool:
        """Whether any credential header is held."""
        return bool(self.secret)

    def __repr__(self) -> str:
        # names only: a repr ends up in logs and bug reports
        names = sorted({*self.plain, *self.secret})
        hosts = sorted(f"{s}://{h}:{p}" for s, h, p in self.origins)
        return f"RequestHeaders({names}, credentials for {hosts})"


NO_HEADERS = RequestHeaders()


def bind_headers(headers: Mapping[str, str] | RequestHeaders | None,
                 urls: str | Iterable[str]) -> RequestHeaders:
    """Bind the credentials in ``headers`` to the origins of ``urls``.

    Call it where the user's own URL is known (the manifest or shard URL typed, the Hub
    endpoint), never with an address a server chose.

    Args:
        headers (Mapping[str, str] | RequestHeaders | None): The user's headers; a
            :class:`RequestHeaders` is returned as it is (already bound).
        urls (str | Iterable[str]): The URL(s) the credentials were given for.

    Returns:
        The bound headers.
    """
    if isinstance(headers, RequestHeaders):
        return headers
    if not headers:
        return NO_HEADERS
    plain, secret = {}, {}
    for name, value in headers.items():
        (secret if name.lower() in CREDENTIAL_HEADERS else plain)[name] = value
    urls = [urls] if isinstance(urls, str) else list(urls)
    return RequestHeaders(plain, secret, frozenset(origin(url) for url in urls) if secret
                          else frozenset())


def request_headers(headers: Mapping[str, str] | RequestHeaders | None) -> RequestHeaders:
    """``headers`` as :class:`RequestHeaders`, refusing unbound credentials.

    Args:
        headers (Mapping[str, str] | RequestHeaders | None): What a transport call was given.

    Returns:
        The headers; a mapping without credential headers becomes plain headers.

    Raises:
        TypeError: A plain mapping holds a credential header: bind it to the user's URL
            with :func:`bind_headers` first (a programming error, not a remote one).
    """
    if isinstance(headers, RequestHeaders):
        return headers
    if not headers:
        return NO_HEADERS
    secret = sorted(name for name in headers if name.lower() in CREDENTIAL_HEADERS)
    if secret:
        raise TypeError(f"credential headers {secret} must be bound to the origin they were "
                        f"given for: pass transport.bind_headers(headers, url)")
    return RequestHeaders(dict(headers))
