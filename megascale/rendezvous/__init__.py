"""Rendezvous on Redis, and the store traffic of creating the TP/DP/PP groups.

Importing this package registers the `redis://host:port/<job>` init method (and `rediss://`, over
TLS) with torch.distributed, so `init_process_group(init_method="redis://...")` works after it.
"""
from megascale.common.embedded_redis import EmbeddedRedis, start_embedded
from megascale.rendezvous.groups import GroupSpec, group_specs, world_group_specs
from megascale.rendezvous.init_method import join, register_handler, store_from_url
from megascale.rendezvous.redis_store import RedisStore, RendezvousError, RendezvousTimeout

register_handler()

__all__ = [
    "EmbeddedRedis", "GroupSpec", "RedisStore", "RendezvousError", "RendezvousTimeout", "group_specs", "join",
    "register_handler", "start_embedded", "store_from_url", "world_group_specs",
]
