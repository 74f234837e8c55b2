# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The cache salts of a KV cache core (module lifecycle._saltmap).

A request with a cache salt gets a cache key of its own: its adapter's key (0 for none) mixed with
the salt (``lifecycle.cache_keys.salted_key``). The core's map remembers, for each salted key
handed to a record, the key it was salted from and the salt, so that a KV event names a block's
adapter and salt, and a reloaded adapter's salted keys are retired with it. Bounded: past
``capacity`` entries the least recently used goes (a key handed to a record again, or read for an
event, is used; keys of long-gone salts name no adapter any more). Called with the GIL held; each
method is one or a few operations of an ``OrderedDict`` (O(1)), ``derived`` a pass over it.
"""

cimport cython
from libc.stdint cimport int64_t

from collections import OrderedDict

from lifecycle.cache_keys import salted_key
from lifecycle.errors import ConfigError


@cython.final
@cython.auto_pickle(False)
cdef class SaltMap:
    """Salted cache key -> (the key it was salted from, the salt). A ``KVCacheCore`` owns one
    (``core.salts``); ``capacity`` bounds it."""

    def __init__(self, Py_ssize_t capacity=65536):
        """An empty map of at most ``capacity`` salted keys."""
        if capacity < 1:
            raise ConfigError(f"SaltMap: capacity={capacity} must be >= 1")
        self._entries = OrderedDict()
        self.capacity = capacity

    cpdef int64_t salted(self, int64_t base, object salt) except? -1:
        """The cache key of requests under key ``base`` with cache salt ``salt`` (not recorded)."""
        return salted_key(base, salt)

    cpdef add(self, int64_t key, int64_t base, object salt):
        """Record that ``key`` is ``base`` salted with ``salt``, as its most recent use."""
        entries = self._entries
        entries[key] = (base, salt)
        entries.move_to_end(key)
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    cdef object _used(self, int64_t key):
        """The entry of ``key`` (None: none), made the most recently used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    cpdef int64_t base_of(self, int64_t key) except? -1:
        """The key ``key`` was salted from; ``key`` itself when it is no salted key."""
        entry = self._used(key)
        return key if entry is None else (<tuple>entry)[0]

    cpdef object salt_of(self, int64_t key):
        """The salt of salted key ``key``; None for another key."""
        entry = self._used(key)
        return None if entry is None else (<tuple>entry)[1]

    cpdef frozenset derived(self, int64_t base):
        """Every recorded key salted from ``base`` (what retires with an adapter generation)."""
        return frozenset([key for key, entry in self._entries.items() if (<tuple>entry)[0] == base])

    def __len__(self):
        return len(self._entries)
