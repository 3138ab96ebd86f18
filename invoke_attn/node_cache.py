"""InvokeAI's node cache as a routed node meets it.

InvokeAI answers a node from its cache (``node_cache_size``, each node's ``use_cache``) under a key made
from the node's own fields (``invocation_cache.create_key``). An Attention backend node passes its models
on unchanged, so without more a denoise or decode node routed under one configuration has the key it
had under another, or under none, and InvokeAI would hand back that run's output. A routed node sees
the services through ``keyed``: the same services, whose cache's keys add the configuration the node
runs under (``Config.token``, which equal configurations share), so equal configurations still share
outputs and no other does; and a hit is noted, so that the report can say the output came from the
cache rather than from attention that ran.
"""
from __future__ import annotations


class _KeyedCache:
    """The invocation cache with the configuration in every key; ``hit`` once it answered."""

    def __init__(self, cache, token: int):
        self._cache, self._token, self.hit = cache, token, False

    def create_key(self, invocation):
        return f"{self._cache.create_key(invocation)}|attention configuration {self._token}"

    def get(self, key):
        found = self._cache.get(key)
        self.hit = self.hit or found is not None
        return found

    def __getattr__(self, name):
        return getattr(self._cache, name)


class _Services:
    """InvokeAI's services with ``invocation_cache`` keyed: for this node's call only (sessions on other
    threads keep the services as they are)."""

    def __init__(self, services, cache: _KeyedCache):
        self._services, self.invocation_cache = services, cache

    def __getattr__(self, name):
        return getattr(self._services, name)


def keyed(services, token: int) -> tuple:
    """(the services to run a node with under the configuration ``token``, its cache: ``.hit`` after)."""
    cache = _KeyedCache(services.invocation_cache, token)
    return _Services(services, cache), cache
