"""Re-exports :mod:`pyg_atompack.transport.retry` for imports written before it existed."""

from pyg_atompack.transport.retry import (
    RETRYABLE_STATUSES,
    RetryPolicy,
    TransientError,
    parse_ratelimit_reset,
    parse_retry_after,
)

__all__ = ["RETRYABLE_STATUSES", "RetryPolicy", "TransientError", "parse_ratelimit_reset",
           "parse_retry_after"]
