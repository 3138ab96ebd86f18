"""Double of ``invokeai/app/services/invocation_cache/invocation_cache_memory.py`` (InvokeAI 6.14.2).

As the release: ``create_key(invocation)`` (a static method) hashes the node's JSON without its ``id``, so
two nodes with the same fields share an entry whatever their ids; ``get``/``save`` do nothing when the size
is 0 or the cache is disabled; ``save`` keeps an existing entry, and drops the least recently used when full;
an entry holds the output and its JSON (``CachedItem``), and ``start(invoker)`` (size above 0) has the image,
video, tensor and conditioning stores call ``_delete_by_match(name)`` when one of theirs is deleted, which
drops every entry whose output's JSON names it; hits and misses are counted; one lock guards it all;
``clear``, ``disable`` and ``enable`` do nothing at size 0.
"""
from collections import OrderedDict
from dataclasses import dataclass
from threading import Lock
from typing import Any, Optional, Union


@dataclass
class CachedItem:
    """One entry: the output handed back, and its JSON, which ``_delete_by_match`` searches for a name."""
    invocation_output: Any
    invocation_output_json: str


class MemoryInvocationCache:
    def __init__(self, max_cache_size: int = 0) -> None:
        self._cache: OrderedDict[Union[int, str], CachedItem] = OrderedDict()
        self._max_cache_size = max_cache_size
        self._disabled = False
        self._hits = 0
        self._misses = 0
        self._lock = Lock()

    def start(self, invoker: Any) -> None:
        self._invoker = invoker
        if self._max_cache_size == 0:
            return
        for store in ("images", "videos", "tensors", "conditioning"):
            getattr(invoker.services, store).on_deleted(self._delete_by_match)

    def get(self, key: Union[int, str]) -> Optional[Any]:
        with self._lock:
            if self._max_cache_size == 0 or self._disabled:
                return None
            item = self._cache.get(key)
            if item is None:
                self._misses += 1
                return None
            self._hits += 1
            self._cache.move_to_end(key)
            return item.invocation_output

    def save(self, key: Union[int, str], invocation_output: Any) -> None:
        with self._lock:
            if self._max_cache_size == 0 or self._disabled or key in self._cache:
                return
            self._delete_oldest_access(len(self._cache) + 1 - self._max_cache_size)
            self._cache[key] = CachedItem(
                invocation_output,
                invocation_output.model_dump_json(warnings=False, exclude_defaults=True, exclude_unset=True))

    def _delete_oldest_access(self, number_to_delete: int) -> None:
        for _ in range(min(number_to_delete, len(self._cache))):
            self._cache.popitem(last=False)

    def _delete(self, key: Union[int, str]) -> None:
        if self._max_cache_size != 0:
            self._cache.pop(key, None)

    def delete(self, key: Union[int, str]) -> None:
        with self._lock:
            return self._delete(key)

    def clear(self) -> None:
        with self._lock:
            if self._max_cache_size == 0:
                return
            self._cache.clear()
            self._hits = self._misses = 0

    @staticmethod
    def create_key(invocation: Any) -> int:
        return hash(invocation.model_dump_json(exclude={"id"}, warnings=False))

    def disable(self) -> None:
        with self._lock:
            if self._max_cache_size != 0:
                self._disabled = True

    def enable(self) -> None:
        with self._lock:
            if self._max_cache_size != 0:
                self._disabled = False

    def get_status(self) -> dict[str, Any]:
        with self._lock:
            return {"hits": self._hits, "misses": self._misses,
                    "enabled": not self._disabled and self._max_cache_size > 0, "size": len(self._cache),
                    "max_size": self._max_cache_size}

    def _delete_by_match(self, to_match: str) -> None:
        with self._lock:
            if self._max_cache_size == 0:
                return
            matching = [key for key, item in self._cache.items() if to_match in item.invocation_output_json]
            for key in matching:
                self._delete(key)
