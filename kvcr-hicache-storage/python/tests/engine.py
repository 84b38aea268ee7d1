"""What SGLang's cache controller does around a storage backend, written from
its 0.5.23 call patterns (``managers/cache_controller.py``): page keys chained
per page, hit queries in batches of ``STORAGE_BATCH_SIZE`` through
``batch_exists``, backups and prefetches batch by batch through the zero-copy
(``interface_v1``) or the legacy flat-page calls, each batch stopping at the
first miss. The backend is built by SGLang's own ``StorageBackendFactory``.
"""

from __future__ import annotations

import hashlib
import socket
import struct

import sglang_files
from host_pool import MhaHostPool

hicache_storage, backend_factory = sglang_files.load()
HiCacheStorageConfig = hicache_storage.HiCacheStorageConfig
HiCacheStorageExtraInfo = hicache_storage.HiCacheStorageExtraInfo
STORAGE_BATCH_SIZE = hicache_storage.STORAGE_BATCH_SIZE
StorageBackendFactory = backend_factory.StorageBackendFactory

KVCR_LOADER_KEYS = {
    "backend_name": "kvcr",
    "module_path": "kvcr_hicache.sglang",
    "class_name": "KvcrStorage",
}

# A small model geometry (1 KiB pages) keeps the suite fast; the benchmark
# uses Qwen3-0.6B's.
GEOMETRY = dict(page_size=4, layer_num=2, head_num=2, head_dim=8)


def extra_config(interface_v1, kvcr_pages=400, **more):
    """The extra config an operator passes on the command line."""
    page_bytes = MhaHostPool(pages=1, **GEOMETRY).page_bytes
    extra = dict(
        KVCR_LOADER_KEYS,
        local_dram_bytes=kvcr_pages * page_bytes,
        operation_timeout_ms=5000,
        get_timeout_s=10,
        prefault=False,
    )
    extra.update(more)
    if interface_v1:
        extra["interface_v1"] = 1
    return extra


def peer_extra_config(port, tls, **more):
    """Peer mode on loopback: serve peers at ``port`` and follow hints."""
    return extra_config(
        True,
        enable_remote_hint=True,
        control_host="127.0.0.1",
        control_port=port,
        control_advertise_host="127.0.0.1",
        single_host=True,
        ucx_tls=tls,
        **more,
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_keys(n_pages, salt=0):
    """The storage keys of a synthetic prompt of ``n_pages`` pages."""
    size = GEOMETRY["page_size"]
    tokens = [(salt * 7919 + i) % 151_000 for i in range(n_pages * size)]
    return page_keys(tokens, size)


def fetch_hint(source_endpoint, keys):
    """A router's kv.fetch@1.0 hint naming ``source_endpoint`` for ``keys``
    (root-aligned page hashes: the first 16 hex digits of each key, as
    SGLang's KV events publish them)."""
    return {
        "protocol_version": "0.1",
        "message_id": "m-1",
        "actions": [{
            "action_id": "a-1",
            "action_type": "kv.fetch",
            "action_version": "1.0",
            "payload": {
                "source_control_endpoint": source_endpoint,
                "block_hashes": [int(k[:16], 16) for k in keys],
                "mode": "copy",
            },
        }],
    }


def page_keys(tokens, page_size, prior_hex=None):
    """SGLang's storage keys: SHA-256 over the prior page's digest, then the
    page's tokens as little-endian u32, as 64 lowercase hex digits."""
    keys = []
    prior = bytes.fromhex(prior_hex) if prior_hex else b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256(prior)
        h.update(struct.pack(f"<{page_size}I", *tokens[start : start + page_size]))
        prior = h.digest()
        keys.append(h.hexdigest())
    return keys


def storage_config(extra_config, *, model_name="Qwen/Qwen3-0.6B", tp_rank=0, tp_size=1):
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model_name,
        extra_config=extra_config,
    )


def attach(extra_config, host_pool, **config):
    """SGLang's attach: the factory's dynamic loader builds the backend, then
    the controller registers its host pool and ends the registration burst."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config, **config), host_pool
    )
    backend.register_mem_pool_host(host_pool)
    backend.on_host_pools_registered()
    return backend


class Controller:
    """The controller's storage calls for one backend and host pool."""

    def __init__(self, backend, host_pool, interface_v1):
        self.backend = backend
        self.pool = host_pool
        self.page_size = host_pool.page_size
        self.interface_v1 = interface_v1

    def _batch_indices(self, host_indices, start, count):
        return host_indices[start * self.page_size : (start + count) * self.page_size]

    def backup(self, keys, host_indices, prefix_keys=None):
        """``_page_backup``: pages committed, stopping at the first failed batch."""
        done = 0
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[start : start + STORAGE_BATCH_SIZE]
            indices = self._batch_indices(host_indices, start, len(batch))
            extra = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
            if self.interface_v1:
                ok = all(self.backend.batch_set_v1(batch, indices, extra))
            else:
                pages = [
                    self.pool.get_data_page(indices[i * self.page_size])
                    for i in range(len(batch))
                ]
                ok = self.backend.batch_set(batch, pages)
            if not ok:
                break
            prefix_keys = (prefix_keys or []) + batch
            done += len(batch)
        return done

    def hit_query(self, keys, extra_info=None, prefix_keys=None):
        """``_storage_hit_query``: leading hits, batch by batch."""
        hits = 0
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[start : start + STORAGE_BATCH_SIZE]
            extra = HiCacheStorageExtraInfo(prefix_keys=prefix_keys, extra_info=extra_info)
            n = self.backend.batch_exists(batch, extra)
            hits += n
            if n < len(batch):
                break
            prefix_keys = (prefix_keys or []) + batch
        return hits

    def prefetch(self, keys, host_indices, extra_info=None, prefix_keys=None):
        """``_page_transfer``: pages restored into the host pool, batch by
        batch, each batch counting its leading successes."""
        done = 0
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[start : start + STORAGE_BATCH_SIZE]
            indices = self._batch_indices(host_indices, start, len(batch))
            extra = HiCacheStorageExtraInfo(prefix_keys=prefix_keys, extra_info=extra_info)
            if self.interface_v1:
                results = self.backend.batch_get_v1(batch, indices, extra)
                n = next((i for i, ok in enumerate(results) if not ok), len(batch))
            else:
                dummies = [self.pool.get_dummy_flat_data_page() for _ in batch]
                pages = self.backend.batch_get(batch, dummies)
                n = 0
                for i, page in enumerate(pages):
                    if page is None:
                        break
                    self.pool.set_from_flat_data_page(indices[i * self.page_size], page)
                    n += 1
            done += n
            if n < len(batch):
                break
            prefix_keys = (prefix_keys or []) + batch
        return done
