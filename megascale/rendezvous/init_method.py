"""The `redis://[[user]:password@]host[:port]/<job>[?incarnation=N]` init method for torch.distributed
(`rediss://` for TLS): a RedisStore from the URL, a join barrier of O(1) store calls per rank, and the
handler registration.

Credentials come from the URL, else from the job's secrets ($MEGASCALE_SECRETS), so the URL that
travels in commands and command lines need not carry a password. TLS options are redis-py's URL
query names: `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`, `ssl_check_hostname`.
"""
from __future__ import annotations

import importlib
import os
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

from megascale.common.auth import redis_auth
from megascale.rendezvous.redis_store import RedisStore, RendezvousError, RendezvousTimeout, _secs, _seconds

INCARNATION_ENV = "MEGASCALE_INCARNATION"
SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
JOIN_KEY, COMPLETE_KEY = "rdzv/joined", "rdzv/complete"


def store_from_url(url: str, timeout: timedelta = timedelta(seconds=300)) -> tuple[RedisStore, dict[str, str]]:
    """A RedisStore for `redis[s]://[[user]:password@]host[:port]/<job>[?incarnation=N]`, plus the query.

    The incarnation comes from the query, else $MEGASCALE_INCARNATION, else 0.
    """
    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    job = parsed.path.strip("/")
    if parsed.scheme not in ("redis", "rediss") or not job:
        raise ValueError(f"bad rendezvous URL {parsed.scheme}://{parsed.hostname}:{parsed.port}{parsed.path}: "
                         "expected redis[s]://host:port/<job>[?incarnation=N]")  # no password in the message
    incarnation = query.get("incarnation", os.environ.get(INCARNATION_ENV, "0"))
    connect = query.get("connect_timeout")
    credentials = redis_auth(url) or {"username": parsed.username or None, "password": parsed.password}
    tls = {k: v for k, v in query.items() if k in SSL_OPTIONS} if parsed.scheme == "rediss" else None
    if tls and "ssl_check_hostname" in tls:
        tls["ssl_check_hostname"] = tls["ssl_check_hostname"].lower() in ("1", "true", "yes")
    store = RedisStore(
        parsed.hostname or "127.0.0.1", parsed.port or 6379, job, incarnation, timeout, **credentials,
        connect_timeout=timedelta(seconds=float(connect)) if connect else None, tls=tls)
    return store, query


def join(store: RedisStore, world_size: int, timeout: timedelta | None = None) -> int:
    """Join barrier: O(1) store calls per rank, the last arrival wakes everyone. Returns arrival order."""
    arrived = store.add(JOIN_KEY, 1)
    if arrived > world_size:
        raise RendezvousError(
            f"more than {world_size} ranks joined job {store.job!r} incarnation {store.incarnation}: "
            f"a previous run used this incarnation; restart with a new one (?incarnation= or ${INCARNATION_ENV})")
    if arrived == world_size:
        store.set(COMPLETE_KEY, b"1")
    try:
        store.wait([COMPLETE_KEY], timeout)
    except RendezvousTimeout:
        seconds = _seconds(store.timeout if timeout is None else timeout)
        raise RendezvousError(
            f"only {int(store.add(JOIN_KEY, 0))}/{world_size} ranks joined job {store.job!r} incarnation "
            f"{store.incarnation} within {_secs(seconds)}: start the missing ranks or fix world_size") from None
    return arrived


def _redis_rendezvous_handler(url: str, timeout: timedelta = timedelta(seconds=300), **kwargs):
    store, query = store_from_url(url, timeout)
    try:
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
        world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
    except ValueError:
        raise ValueError(f"redis:// rendezvous: rank and world_size must be integers in {url!r}") from None
    if rank < 0 or world_size < 1:
        raise ValueError("redis:// rendezvous needs rank and world_size (arguments or $RANK/$WORLD_SIZE)")
    if query.get("wait_for_workers", "1") != "0":
        join(store, world_size)
    yield store, rank, world_size
    raise RuntimeError("redis:// rendezvous cannot re-rendezvous: restart the job with a new incarnation")


def register_handler() -> None:
    """Make `init_process_group(init_method="redis[s]://host:port/<job>")` work (idempotent)."""
    # importlib: `torch.distributed.rendezvous` as an attribute is the function, not the module.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    for scheme in ("redis", "rediss"):
        if scheme not in rdzv._rendezvous_handlers:
            rdzv.register_rendezvous_handler(scheme, _redis_rendezvous_handler)
