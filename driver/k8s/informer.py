"""An informer: a cache of one kind of object, kept by paged list + watch, as client-go's informers keep theirs
(the operator's TrainingJobs, pods and machines)."""
from __future__ import annotations

import json
import threading
from typing import Callable, Optional

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from .. import log
from .kube import PAGE, REQUEST_TIMEOUT_S, reason


class Informer:
    """A cache of one kind of object, kept by list + watch; `on_change(type, obj)` after every change.

    Lists in pages, then watches from the list's resourceVersion. A watch that ends or breaks (a dropped
    connection) is resumed from the last resourceVersion it delivered; only 410 Gone (that version, or a
    list's continue token, expired) relists, so a missed event is repaired by the list. `synced` is set
    after the first list. `transform` trims each object before it is stored (caches.py).
    """

    def __init__(self, what: str, list_call: Callable, on_change: Callable[[str, dict], None],
                 watch_timeout_s: int = 300, transform: Callable[[dict], dict] = lambda obj: obj, **kwargs):
        self.what, self.list_call, self.on_change, self.kwargs = what, list_call, on_change, kwargs
        self.watch_timeout_s, self.transform = watch_timeout_s, transform
        self.version: Optional[str] = None  # the last resourceVersion seen; None: list first
        self.items: dict[tuple[str, str], dict] = {}
        self.synced = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch_stream: Optional[watch.Watch] = None
        self._thread = threading.Thread(target=self._run, name=f"informer-{what}", daemon=True)

    def start(self) -> "Informer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch_stream is not None:
            self._watch_stream.stop()
        self._thread.join(timeout=5)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.items.values())

    @staticmethod
    def key(obj: dict) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        return meta.get("namespace", ""), meta.get("name", "")

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self.version is None:
                    self._list()
                while not self._stop.is_set():
                    self._watch()
                    failures = 0
            except Exception as e:  # noqa: BLE001 - any failure: resume after a pause, as client-go does
                if self._stop.is_set():
                    return
                if isinstance(e, ApiException) and e.status == 410:
                    self.version = None  # compacted away: relist at once, nothing is wrong
                    continue
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning("watch of %s failed (%s); %s", self.what,
                                reason(e) if isinstance(e, ApiException) else type(e).__name__,
                                "relisting" if self.version is None else f"watching again from {self.version}")
                self._stop.wait(min(10.0, 0.5 * failures))

    def _list(self) -> None:
        items, token, version = [], None, ""
        while True:  # a 410 on a continue token (the list's snapshot compacted away) starts over, in _run
            page = json.loads(self.list_call(**self.kwargs, limit=PAGE, **({"_continue": token} if token else {}),
                                             _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S).data)
            items += page.get("items") or []
            if token is None:
                version = page["metadata"]["resourceVersion"]  # the first page's: the snapshot all pages are of
            token = page["metadata"].get("continue")
            if not token:
                break
        fresh = {self.key(obj): self.transform(obj) for obj in items}
        with self._lock:
            gone = [obj for key, obj in self.items.items() if key not in fresh]
            self.items = fresh
        for obj in gone:
            self.on_change("DELETED", obj)
        for obj in fresh.values():
            self.on_change("MODIFIED", obj)
        self.version = version
        self.synced.set()

    def _watch(self) -> None:
        """Watches from `version` until the server ends the stream (its timeout), keeping `version` current."""
        self._watch_stream = watch.Watch()
        # Bookmarks keep `version` fresh on quiet collections, so a re-watch rarely meets 410 Gone.
        for event in self._watch_stream.stream(self.list_call, **self.kwargs, resource_version=self.version,
                                        allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                                        _request_timeout=self.watch_timeout_s + REQUEST_TIMEOUT_S):
            if self._stop.is_set():
                break
            kind, obj = event["type"], event["raw_object"]
            if kind == "BOOKMARK":
                self.version = obj["metadata"]["resourceVersion"]
                continue
            obj = self.transform(obj)
            with self._lock:
                if kind == "DELETED":
                    self.items.pop(self.key(obj), None)
                else:
                    self.items[self.key(obj)] = obj
            self.version = obj["metadata"]["resourceVersion"]
            self.on_change(kind, obj)
