"""kvcr's HiCache L3 storage backend for Python inference engines.

``kvcr_hicache.Backend`` (the Rust extension ``kvcr_hicache._native``) is one
engine rank's backend: a rank-local KV cache runner that keeps pages in host
DRAM it owns, restores them into the engine's host pool, and pulls pages from a
peer rank when a router hint names one.

For SGLang, load ``kvcr_hicache.sglang.KvcrStorage`` as a dynamic backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcr",
        "module_path": "kvcr_hicache.sglang", "class_name": "KvcrStorage",
        "interface_v1": 1, "local_dram_bytes": 8589934592}'
"""

try:
    from kvcr_hicache._native import (
        ROUTER_HINT_KEYS,
        STAGING_PAGES,
        Backend,
        KvcrError,
    )
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "kvcr_hicache's Rust extension (kvcr_hicache._native) is not built or "
        "does not load; build it with `maturin build --release` in "
        "kvcr-hicache-storage/python (cargo xtask test does) and install the "
        f"wheel: {e}"
    ) from e

__all__ = ["Backend", "KvcrError", "ROUTER_HINT_KEYS", "STAGING_PAGES"]
