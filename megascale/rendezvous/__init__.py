"""Rendezvous on Redis and barrier-free creation of the TP/DP/PP groups.

Importing this package registers the `redis://host:port/<job>` init method with
torch.distributed, so `init_process_group(init_method="redis://...")` works after it.
"""
from megascale.rendezvous.embedded import EmbeddedRedis, start_embedded
from megascale.rendezvous.groups import (
    KINDS,
    GroupSpec,
    all_group_specs,
    create_groups,
    group_specs,
    groups_for_rank,
    rank_coords,
)
from megascale.rendezvous.redis_store import (
    RedisStore,
    RendezvousError,
    RendezvousTimeout,
    join,
    register_handler,
    store_from_url,
)

register_handler()

__all__ = [
    "KINDS", "EmbeddedRedis", "GroupSpec", "RedisStore", "RendezvousError", "RendezvousTimeout",
    "all_group_specs", "create_groups", "group_specs", "groups_for_rank", "join", "rank_coords",
    "register_handler", "start_embedded", "store_from_url",
]
