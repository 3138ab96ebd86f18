"""InvokeAI's node cache as a routed node meets it.

InvokeAI answers a node from its cache (``node_cache_size``, each node's ``use_cache``) under a key made
from the node's own fields (``invocation_cache.create_key``). An Attention backend node passes its models
on unchanged, so without more a denoise or decode node routed under one configuration has the key it
had under another, or under none, and InvokeAI would hand back that run's output. A routed node sees
the services through ``keyed``: the same services, whose cache's keys add the configuration the node
runs under (``Config.canonical``, which equal configurations share, and the digest of the pack's code), so
equal configurations still share outputs and no other does, also after the pack's code was replaced in the
same process; and a hit is noted, so that the report can say the output came from the cache rather than from
attention that ran. The pack's own nodes are keyed by their class (``of_class``).
"""
from __future__ import annotations

import hashlib
import uuid
import weakref

from . import SOURCE


class _KeyedCache:
    """The invocation cache with the configuration in every key; ``hit`` once it answered."""

    def __init__(self, cache, configuration: str):
        self._cache, self._configuration, self.hit = cache, configuration, False

    def create_key(self, invocation):
        return f"{self._cache.create_key(invocation)}|attention {self._configuration}"

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


def configuration(config) -> str:
    """What a routed node's key adds: ``config`` (a ``lib_attn`` configuration) and the digest of the code
    that runs it (``SOURCE``: exact where two commits share a version string)."""
    return hashlib.sha256(repr((SOURCE, config.canonical)).encode()).hexdigest()[:32]


#: A name never used before for each of the pack's node classes, dropped with the class: an id() is an
#: address, which a class made after the earlier one was freed can get again.
_class_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def of_class(cls) -> str:
    """What the key of one of the pack's own nodes adds: its very class. InvokeAI's cache holds outputs as
    objects; after an update (the nodes' module run again) an output of the earlier class fails InvokeAI's
    check of the node's result, so a node of the new class never takes one."""
    name = _class_names.get(cls)
    if name is None:
        name = _class_names[cls] = uuid.uuid4().hex
    return f"class {name}"


def keyed(services, what: str) -> tuple:
    """(the services to run a node with, their keys holding ``what``; its cache: ``.hit`` after)."""
    cache = _KeyedCache(services.invocation_cache, what)
    return _Services(services, cache), cache
