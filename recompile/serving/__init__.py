"""Serving: the paged user KV cache for HSTU ranking (``kv_cache``); export and AOTInductor packages are
``recompile.export`` / ``recompile.package``."""
from recompile.serving.kv_cache import CacheStats, PagedKVCache

__all__ = ["CacheStats", "PagedKVCache"]
