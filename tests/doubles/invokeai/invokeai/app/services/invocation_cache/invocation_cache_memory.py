"""Double of ``invokeai/app/services/invocation_cache/invocation_cache_memory.py`` (InvokeAI 6.14.2).

As the release: ``create_key(invocation)`` hashes the node's JSON without its ``id`` (so two nodes with the
same inputs share an entry); ``get``/``save`` do nothing when the size is 0 or the cache is disabled; the
least recently used entry goes first when full; hits and misses are counted; one lock guards it all.
"""
from collections import OrderedDict
from threading import Lock
from typing import Any, Optional, Union


class MemoryInvocationCache:
    def __init__(self, max_cache_size: int = 0) -> None:
        self._cache: OrderedDict[Union[int, str], Any] = OrderedDict()
        self._max_cache_size = max_cache_size
        self._disabled = False
        self._hits = 0
        self._misses = 0
        self._lock = Lock()

    @staticmethod
    def create_key(invocation: Any) -> int:
        return hash(invocation.model_dump_json(exclude={"id"}, warnings=False))

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
            return item

    def save(self, key: Union[int, str], invocation_output: Any) -> None:
        with self._lock:
            if self._max_cache_size == 0 or self._disabled or key in self._cache:
                return
            while self._cache and len(self._cache) + 1 > self._max_cache_size:
                self._cache.popitem(last=False)
            self._cache[key] = invocation_output

    def disable(self) -> None:
        with self._lock:
            self._disabled = True

    def enable(self) -> None:
        with self._lock:
            self._disabled = False

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._hits = self._misses = 0

    def get_status(self) -> dict[str, Any]:
        with self._lock:
            return {"size": len(self._cache), "hits": self._hits, "misses": self._misses,
                    "enabled": not self._disabled and self._max_cache_size > 0, "max_size": self._max_cache_size}
