"""A job's secrets and the two things they protect: who may talk to its Redis, and which Kafka
records came from one of its own components.

The secrets are one JSON file, mode 0600, per job:

    {"hmac_key": "<64 hex>", "redis_username": "megascale", "redis_password": "<random>"}

Every component finds it through `$MEGASCALE_SECRETS` (its path, never a secret): `megascale run`
creates it beside the job's state file and sets the variable for the driver, whose executors and
ranks inherit it; CLI commands read the path from the job's state file; on Kubernetes a mounted
Secret holds the same file. The Redis fields are absent when the job uses a Redis of its own
(credentials then travel in its URL, if any).

Signed records (heartbeats, metrics, events on Kafka) stay one JSON object: the sender appends
`"mac"` as the last field, an HMAC-SHA256 over the bytes before it, so the reader checks the exact
bytes that were sent without re-encoding anything.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import urlparse, urlunparse

SECRETS_ENV = "MEGASCALE_SECRETS"
REDIS_USER = "megascale"
_MAC_FIELD = b',"mac":"'
_MAC_HEX = 64
_TAIL = len(_MAC_FIELD) + _MAC_HEX + 2  # ,"mac":"<hex>"}


class SecretsError(RuntimeError):
    """The secrets file is missing or unreadable; the text says which file, in one line."""


class BadRecord(ValueError):
    """A record that fails authentication; `reason` is one of a few fixed words, fit for a counter."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class JobSecrets:
    hmac_key: str  # hex
    redis_username: Optional[str] = None
    redis_password: Optional[str] = None

    def __repr__(self) -> str:  # a stray log line of this object must not carry the secrets
        return f"JobSecrets(redis_username={self.redis_username!r}, <hidden>)"

    @classmethod
    def generate(cls, redis_url: Optional[str] = None) -> JobSecrets:
        """A new HMAC key, and a new Redis login unless the job has a Redis of its own (`redis_url`),
        whose login, if the URL carries one, is kept here instead."""
        if not redis_url:
            return cls(secrets.token_hex(32), REDIS_USER, secrets.token_urlsafe(32))
        _, username, password = split_login(redis_url)
        return cls(secrets.token_hex(32), username, password)

    def write(self, path: Path) -> None:
        """Creates `path` with mode 0600 from the start (never readable by others, not even briefly)."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: v for k, v in dataclasses.asdict(self).items() if v is not None}, f)
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str | Path) -> JobSecrets:
        try:
            data = json.loads(Path(path).read_text())
            return cls(str(data["hmac_key"]), data.get("redis_username"), data.get("redis_password"))
        except OSError as e:
            raise SecretsError(f"cannot read the job's secrets file {path}: {e.strerror}") from None
        except (ValueError, KeyError, TypeError):
            raise SecretsError(f"the job's secrets file {path} is not a JSON object with an hmac_key") from None

    def signer(self) -> Signer:
        return Signer(bytes.fromhex(self.hmac_key))

    def redis_auth(self, url: str) -> dict:
        """username/password for a redis-py client of `url`: the URL's own credentials win."""
        if urlparse(url).password or not self.redis_password:
            return {}
        return {"username": self.redis_username, "password": self.redis_password}


def from_env() -> Optional[JobSecrets]:
    """The secrets named by $MEGASCALE_SECRETS; None when it is unset (a bare test or benchmark).
    Read anew each time (at start-ups, not per message): a job run again under its name has new ones."""
    path = os.environ.get(SECRETS_ENV)
    return JobSecrets.read(path) if path else None


@contextlib.contextmanager
def restoring_secrets_env() -> Iterator[None]:
    """$MEGASCALE_SECRETS as it was once the block ends. A job's supervisor (or its clean-up) sets it for its
    own clients and the children it starts; an in-process caller (the CLI's tests, a notebook running several
    jobs) must not carry one job's key into the next."""
    before = os.environ.get(SECRETS_ENV)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SECRETS_ENV, None)
        else:
            os.environ[SECRETS_ENV] = before


def env_signer() -> Optional[Signer]:
    """The signer of this job's records, from $MEGASCALE_SECRETS; None when it is unset."""
    found = from_env()
    return found.signer() if found else None


def redis_auth(url: str, job_secrets: Optional[JobSecrets] = None) -> dict:
    """Credentials for a redis-py client of `url`, from `job_secrets` or else $MEGASCALE_SECRETS."""
    found = job_secrets or from_env()
    return found.redis_auth(url) if found else {}


def split_login(url: str) -> tuple[str, Optional[str], Optional[str]]:
    """`url` without its user and password (so it may go on command lines), and those two."""
    parsed = urlparse(url)
    if not parsed.username and not parsed.password:
        return url, None, None
    host = (parsed.hostname or "") + (f":{parsed.port}" if parsed.port else "")
    return urlunparse(parsed._replace(netloc=host)), parsed.username or None, parsed.password


def redacted(url: str) -> str:
    """`url` fit to print: a password in it becomes ***."""
    parsed = urlparse(url)
    if not parsed.password:
        return url
    user = parsed.username or ""
    host = parsed.hostname or ""
    return urlunparse(parsed._replace(netloc=f"{user}:***@{host}" + (f":{parsed.port}" if parsed.port else "")))


class Signer:
    """Signs and checks records under one job's HMAC key."""

    def __init__(self, key: bytes):
        self._key = key

    def mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).hexdigest().encode()

    def sign(self, body: bytes) -> bytes:
        """`body` (a JSON object's bytes) with the "mac" field appended."""
        return body[:-1] + _MAC_FIELD + self.mac(body) + b'"}'

    def open(self, record: bytes) -> bytes:
        """The signed body of `record` (without its "mac"); BadRecord("unsigned" | "bad mac") otherwise."""
        if len(record) <= _TAIL + 1 or record[-2:] != b'"}' or record[-_TAIL:-_TAIL + len(_MAC_FIELD)] != _MAC_FIELD:
            raise BadRecord("unsigned")
        body = record[:-_TAIL] + b"}"
        if not hmac.compare_digest(self.mac(body), record[-_MAC_HEX - 2:-2]):
            raise BadRecord("bad mac")
        return body
