"""URLs without secrets, for messages and logs.

User info (``https://user:password@host``) is dropped and the values of query parameters
that carry credentials (pre-signed URLs of S3, GCS, Azure and CDNs, ``token=`` ...) are
replaced by ``REDACTED``, so an error message can name the URL it is about and still be
pasted into an issue tracker.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_SECRET_PARAMS = ("signature", "token", "credential", "key", "sig", "policy", "auth",
                  "password", "secret", "expires", "x-amz-", "x-goog-", "se", "sp", "sv")


_USER_INFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def _is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(lowered == p or lowered.startswith(p) or p in lowered and len(p) > 3
               for p in _SECRET_PARAMS)


def redact_url(url: str) -> str:
    """``url`` with user info and credential-bearing query values removed.

    Args:
        url (str): Any URL (or a plain string, returned unchanged).

    Returns:
        The redacted URL.
    """
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a malformed host or port raises here
    except ValueError:
        # too malformed to take apart: drop whatever could be user info and the query
        return _USER_INFO.sub(r"\1", url).split("?", 1)[0].split("#", 1)[0] + (
            "?REDACTED" if "?" in url else "")
    if not parts.scheme or not parts.netloc:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "REDACTED" if _is_secret(k) else v) for k, v in pairs],
                          safe="/:")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (:func:`redact_url`).

    For messages of other libraries, which quote the URL they were given.

    Args:
        text (str): Any text.

    Returns:
        The text, URLs redacted.
    """
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)
