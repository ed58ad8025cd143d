"""Kubernetes API errors, sorted into those worth retrying and those worth telling the user.

Every call the operator, its drivers and the CLI make goes through one `ApiClient` (kube.connect), whose
connection pool retries throttling (429), server errors (5xx), dropped connections and timeouts with
jittered exponential backoff, honouring Retry-After. A refusal (403 Forbidden: RBAC, a ResourceQuota, Pod
Security admission; 422 Invalid) is not retried: it is the user's to fix, and reaches the TrainingJob as a
condition and an Event.
"""
from __future__ import annotations

import json
import random
from typing import Optional

import urllib3
from kubernetes.client.exceptions import ApiException
from urllib3.util.retry import Retry

TRANSIENT = frozenset({429, 500, 502, 503, 504})
RETRIES = 6  # at most 0.5 + 1 + 2 + 4 + 8 + 10 s of backoff (half that on average), then the error
BACKOFF_S = 0.25
MAX_BACKOFF_S = 10.0
# What a call may raise once its retries are spent: an API status, or a connection that never answered.
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError)


class JitteredRetry(Retry):
    """urllib3's Retry (the client's own transport, so every call is covered without wrapping each one;
    tenacity is no dependency here) with full jitter from the first retry on: many drivers throttled
    together must not come back in step, which urllib3's default (no wait before the first retry) does."""

    def get_backoff_time(self) -> float:
        errors = len(self.history)
        return random.uniform(0.0, min(self.backoff_max, self.backoff_factor * 2 ** errors)) if errors else 0.0


def policy(total: Optional[int] = None) -> Retry:
    """`total` retries (default RETRIES; a person at a terminal wants an unreachable server's error sooner)."""
    # Every method: a create repeated after a lost answer meets 409 and is then judged by owner UID
    # (kube.create_pod), and the patches sent are merge patches, the same however often applied.
    return JitteredRetry(total=RETRIES if total is None else total, read=2, allowed_methods=None,
                         status_forcelist=TRANSIENT, backoff_factor=BACKOFF_S, backoff_max=MAX_BACKOFF_S,
                         raise_on_status=False, respect_retry_after_header=True, retry_after_max=int(MAX_BACKOFF_S))


def refused(e: BaseException) -> bool:
    """A request the API server will refuse again as it stands: forbidden, invalid, too large."""
    return isinstance(e, ApiException) and 400 <= (e.status or 0) < 500 and e.status not in (404, 408, 409, 429)


class Refused(ApiException):
    """A refusal (`refused`) of one object the operator writes, naming it: `kind` and `name`."""

    def __init__(self, kind: str, name: str, e: ApiException):
        super().__init__(status=e.status, reason=e.reason)
        self.body, self.headers, self.kind, self.name = e.body, e.headers, kind, name


def message(e: BaseException) -> str:
    """The API server's one-line message (its Status body), else what failed."""
    if isinstance(e, ApiException):
        try:
            return json.loads(e.body)["message"]
        except (TypeError, ValueError, KeyError):
            return f"{e.status} {e.reason}".strip()
    return f"{type(e).__name__}: {e}"
