"""How an object store's failures become the project's errors (torch-free).

The stores' clients (botocore for S3, gcsfs for GCS, azure-core for Azure) raise their
own exceptions, often chained. This module reads the store's answer behind one (error
code, HTTP status, ``Retry-After``), says whether it is transient
(:func:`is_transient`: retried by :class:`~pyg_atompack.remote.objectstore.ObjectStore`
under the transport's one retry loop) and turns a permanent one into the transport's
error family (:func:`translate`), naming the object URL and never a credential.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pyg_atompack.remote.objectstore_backends import BACKENDS, StoreHTTPError
from pyg_atompack.transport.errors import (
    RemoteAuthError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    TransportError,
)
from pyg_atompack.transport.retry import RETRYABLE_STATUSES, server_wait

__all__ = ["TRANSIENT_CODES", "Truncated", "causes", "client_error_info", "describe_transient",
           "first_line", "is_transient", "redact_endpoint", "requested_wait", "translate"]

# the stores' throttling / transient error codes (S3, then Azure; GCS says it with the
# status alone); the statuses are the transport's RETRYABLE_STATUSES (408, 429, 5xx)
TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError",
                              "ServiceUnavailable", "Throttling", "ThrottlingException",
                              "RequestLimitExceeded", "TooManyRequestsException",
                              "ServerBusy", "OperationTimedOut"})



def causes(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def client_error_info(error: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of the store's answer behind ``error``, if any.

    botocore's ``ClientError`` (S3), azure-core's ``HttpResponseError`` (Azure), gcsfs's
    ``HttpError`` and the statuses it turns into built-in exceptions (GCS listings), and
    :class:`~pyg_atompack.remote.objectstore_backends.StoreHTTPError` (GCS reads).
    """
    for cause in causes(error):
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and "Error" in response:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return response["Error"].get("Code"), status
        if isinstance(cause, StoreHTTPError):
            return cause.code, cause.status
        status = getattr(cause, "status_code", None)  # azure-core
        if isinstance(status, int):
            code = getattr(cause, "error_code", None)
            return (str(getattr(code, "value", code)) if code else None), status
        module = type(cause).__module__ or ""
        if module.startswith("gcsfs"):
            code = getattr(cause, "code", None)
            if isinstance(code, int):
                return None, code
        if module == "builtins" and isinstance(cause, OSError) and not isinstance(
                cause, FileNotFoundError) and str(cause).startswith("Forbidden"):
            return None, 403  # gcsfs: a 403 answer becomes OSError("Forbidden: ...")
    return None, None


def is_transient(error: BaseException) -> bool:
    code, status = client_error_info(error)
    if code is not None or status is not None:
        return code in TRANSIENT_CODES or status in RETRYABLE_STATUSES
    names = {type(cause).__name__ for cause in causes(error)}
    transient_names = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                       "ConnectionClosedError", "ClientPayloadError",
                       "ServerDisconnectedError", "ClientConnectorError", "ClientOSError",
                       "IncompleteRead", "ResponseStreamingError", "FSTimeoutError",
                       "TimeoutError", "ConnectionResetError", "ConnectionRefusedError",
                       "BrokenPipeError", "ProxyConnectionError", "Truncated",
                       "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError",
                       "ServiceRequestError", "ServiceResponseError", "IncompleteReadError",
                       "ServiceRequestTimeoutError", "ServiceResponseTimeoutError",
                       "ProxyError"}
    return bool(names & transient_names)


def requested_wait(error: BaseException) -> float | None:
    """The wait the store asked for (``Retry-After``), from its answer if any."""
    for cause in causes(error):
        if isinstance(cause, StoreHTTPError):
            return server_wait({"Retry-After": cause.retry_after})
        headers = getattr(getattr(cause, "response", None), "headers", None)
        if headers is not None and hasattr(headers, "get"):  # azure-core's response
            return server_wait({"Retry-After": headers.get("Retry-After")})
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and "Error" in response:
            headers = response.get("ResponseMetadata", {}).get("HTTPHeaders") or {}
            lowered = {str(k).lower(): v for k, v in headers.items()}
            return server_wait({"Retry-After": lowered.get("retry-after"),
                                "RateLimit": lowered.get("ratelimit")})
    return None


class Truncated(Exception):
    """The body ended before the requested range did."""


def translate(error: BaseException, url: str, *, scheme: str, bucket: str,
              secrets_dropped: bool = False) -> TransportError:
    """One :class:`TransportError` subclass for a permanent ``error`` met at ``url``.

    Args:
        error (BaseException): What the store's client raised.
        url (str): The object's URL (no credential in it).
        scheme (str): The store's scheme (``"s3"``, ``"gs"``, ``"az"``).
        bucket (str): The bucket (or container).
        secrets_dropped (bool, optional): Whether credentials given as options were
            left behind when the handle was pickled (the message says so).
            (default: :obj:`False`)

    Returns:
        The error to raise: :class:`RemoteAuthError`, :class:`RemoteNotFoundError`,
        :class:`RemoteIntegrityError` or :class:`TransportError`, naming ``url``.
    """
    if isinstance(error, TransportError):
        return error
    code, status = client_error_info(error)
    names = {type(cause).__name__ for cause in causes(error)}
    backend = BACKENDS[scheme]
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        hint = (" (credentials given as options are not pickled: in spawned workers "
                "use the environment or a profile)" if secrets_dropped else "")
        return RemoteAuthError(
            f"{url}: no credentials found: {backend.credentials_hint}{hint}", url=url)
    if code in ("NoSuchBucket", "ContainerNotFound"):
        return RemoteNotFoundError(f"{url}: bucket {bucket!r} does not exist",
                                   url=url, status=status)
    if code in ("NoSuchKey", "404", "NotFound", "BlobNotFound") or status == 404 or (
            code is None and isinstance(error, FileNotFoundError)):
        return RemoteNotFoundError(f"{url}: no such object", url=url, status=status)
    if code in ("PreconditionFailed", "412", "ConditionNotMet") or status == 412:
        return RemoteIntegrityError(
            f"{url}: the object changed since it was listed (ETag differs)",
            url=url, status=status)
    if status in (401, 403) or isinstance(error, PermissionError) or code in (
            "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
            "ExpiredToken", "InvalidToken"):
        return RemoteAuthError(
            f"{url}: access denied ({code or status or 'forbidden'}): check the "
            f"credentials ({backend.credentials_hint}) and the bucket policy",
            url=url, status=status)
    return TransportError(f"{url}: {code or type(error).__name__}: {first_line(error)}",
                          url=url, status=status)


def describe_transient(error: BaseException, endpoint: str | None) -> str:
    """How a retried failure is described: the store's code, the endpoint, the cause.

    Args:
        error (BaseException): What the store's client raised.
        endpoint (str | None): The store's endpoint URL (:obj:`None`: the default one).

    Returns:
        One line without credentials.
    """
    code, _ = client_error_info(error)
    where = redact_endpoint(endpoint) if endpoint else "the default endpoint"
    return f"{code or type(error).__name__} from {where}: {first_line(error)}"


def redact_endpoint(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}" if parts.scheme else endpoint


def first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
