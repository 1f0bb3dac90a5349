"""Errors raised by fleet_store, and the pure mapping from S3 error codes to them."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every object-storage failure."""


class StoreUnavailable(StoreError):
    """The endpoint cannot be reached, or does not answer like an S3 server."""


class StoreAuthError(StoreError):
    """The server rejected the credentials (or they lack permission)."""


class ObjectNotFound(StoreError, LookupError):
    """The object (or its bucket) does not exist."""

    # LookupError rather than KeyError: KeyError's str() is the repr of its argument.
    def __init__(self, bucket: str, key: str, detail: str = "") -> None:
        self.bucket = bucket
        self.key = key
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"object {bucket}/{key} not found{suffix}")


class IntegrityError(StoreError):
    """Bytes whose sha256 differs from the one recorded for them."""

    def __init__(self, bucket: str, key: str, expected: str, actual: str, context: str = "") -> None:
        self.bucket = bucket
        self.key = key
        self.expected = expected
        self.actual = actual
        where = f" {context}" if context else ""
        super().__init__(f"sha256 mismatch for {bucket}/{key}{where}: expected {expected}, got {actual}")


AUTH_ERROR_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "MissingSecurityHeader",
    }
)
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchObject"})


def error_for_s3_code(
    code: str | None,
    message: str | None,
    *,
    endpoint: str,
    access_key: str,
    bucket: str | None,
    key: str | None,
) -> StoreError:
    """The StoreError that an S3 error response with this code means; never mentions the secret."""
    code = code or "UnknownError"
    if code in AUTH_ERROR_CODES:
        who = f"access key {access_key!r}" if access_key else "no credentials"
        return StoreAuthError(
            f"S3 at {endpoint} rejected {who} ({code}: {message}): "
            "wrong access key / secret key, or missing permission"
        )
    if code in NOT_FOUND_CODES and bucket is not None and key is not None:
        detail = "bucket does not exist" if code == "NoSuchBucket" else ""
        return ObjectNotFound(bucket, key, detail)
    target = "/".join(part for part in (bucket, key) if part) or endpoint
    return StoreError(f"S3 request on {target} failed: {code}: {message}")
