"""The KV cache core's calls off the request path (compiled from pyx/coreviews.pyx): C functions the
``KVCacheCore`` methods of the same names hand their work to (nothing to call from Python)."""
