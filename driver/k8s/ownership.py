"""What belongs to a TrainingJob: objects whose controller ownerReference carries its UID, nothing else.

Names and labels are not enough: a job deleted and created again under the same name gets a new UID
while its predecessor's pods may still be terminating and its ConfigMap still waiting for the garbage
collector. Those carry the old UID, and are never adopted.
"""
from __future__ import annotations

from typing import Optional


class NotOwned(Exception):
    """An object of the name exists but another owner's; the message says whose and what to do."""


class Leftover(NotOwned):
    """A deleted predecessor's object of the same name: the garbage collector takes it; try again later."""


def controller_uid(obj: Optional[dict]) -> Optional[str]:
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def owned_by(obj: Optional[dict], uid: str) -> bool:
    return bool(uid) and controller_uid(obj) == uid
