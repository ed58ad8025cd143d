"""The Redis key space of a job's rendezvous stores (megascale.rendezvous), here without torch: the driver
tidies it and must start fast."""
from __future__ import annotations


def namespace(job: str, incarnation: str | int) -> str:
    """Prefix of every Redis key of one job incarnation; the braces keep them in one Cluster slot."""
    return f"megascale:{{{job}/{incarnation}}}:"


def drop_incarnations(client, job: str, before: int) -> int:
    """Deletes the keys of the job's incarnations before `before` (no rank of theirs runs any more), so a job
    restarted hundreds of times keeps two incarnations' keys, not all of them. Returns how many were deleted."""
    stale = [key for key in client.scan_iter(match=namespace(job, "*") + "*", count=1000)
             if (n := key.decode(errors="replace").split("/", 1)[1].split("}", 1)[0]).isdigit() and int(n) < before]
    for i in range(0, len(stale), 500):
        client.delete(*stale[i:i + 500])
    return len(stale)
