"""kvcr as SGLang's HiCache L3 storage backend (``--hicache-storage-backend dynamic``).

SGLang's dynamic loader imports ``module_path``, takes ``class_name`` and
requires it to subclass its ``HiCacheStorage`` ABC, then builds it as
``cls(storage_config, kwargs)``. A Rust (PyO3) class cannot subclass a Python
ABC, so :class:`KvcrStorage` is a thin Python subclass that delegates every call
to ``kvcr_hicache.Backend``; bytes never pass through Python objects.

Which I/O path SGLang uses is its controller's choice: with ``interface_v1`` in
the extra config it calls ``batch_get_v1`` / ``batch_set_v1`` with host-pool
indices (the zero-copy path: the runner copies between the registered host
pool and KVCR DRAM); without it, the legacy ``batch_get`` / ``batch_set`` with
flat page tensors (one copy through a staging pool the extension owns).

Router hints arrive per request in ``HiCacheStorageExtraInfo.extra_info`` under
``kvcr_router_hint`` (or the older ``kvcc_router_hint``), with the request
scope under ``request_id`` / ``rid``.

Nothing here raises into SGLang's I/O threads: a miss is ``False`` / ``None`` /
a short count, and faults are counted in :meth:`KvcrStorage.get_stats`. The
extension itself never raises on a data-path argument (a wrong type, a negative
index, a host page named twice, a flat page that is not a usable tensor are
misses it counts); what this class adds is a guard around its own Python
(``faults_python``).
Construction and host-pool registration do raise (``KvcrError``), so a bad
configuration fails the attach, visibly.
"""

from __future__ import annotations

import functools
import json
import logging

_CONTRACT = "sglang.srt.mem_cache.hicache_storage"

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
except ImportError as e:
    _missing = getattr(e, "name", None) or str(e)
    raise ImportError(
        "kvcr_hicache.sglang subclasses SGLang's HiCacheStorage and cannot be "
        f"imported without it: missing module {_missing!r}. It needs SGLang "
        f"(sglang>=0.5.23, which provides {_CONTRACT}) and torch. Engines "
        "other than SGLang can use kvcr_hicache.Backend directly."
    ) from e

from kvcr_hicache import ROUTER_HINT_KEYS, Backend

__all__ = ["KvcrStorage"]

logger = logging.getLogger(__name__)

# The HiCacheStorageConfig fields the backend reads.
_CONFIG_FIELDS = (
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "attn_cp_rank",
    "attn_cp_size",
    "dp_rank",
    "dp_size",
    "is_mla_model",
    "should_split_heads",
    "model_name",
)
# extra_info keys the backend reads: the hint and its request scope, and what
# publishing a backup's pages needs (their real tokens and the namespace a
# router indexes them under).
_EXTRA_INFO_KEYS = frozenset(ROUTER_HINT_KEYS) | {
    "request_id",
    "rid",
    "token_ids",
    "cache_salt",
    "lora_name",
    "lora_id",
}


def _extra_info_json(extra_info):
    """The part of SGLang's extra info the backend reads, as JSON (or None):
    the picked ``extra_info`` keys, and the last of ``prefix_keys`` (the
    parent of the call's first page, for the published chain)."""
    info = getattr(extra_info, "extra_info", None)
    picked = {}
    if isinstance(info, dict):
        picked = {k: v for k, v in info.items() if k in _EXTRA_INFO_KEYS}
    prefix = getattr(extra_info, "prefix_keys", None)
    if picked.get("token_ids") is not None and prefix:
        try:
            picked["prefix_keys"] = [prefix[-1]]
        except (TypeError, IndexError, KeyError):
            picked["prefix_keys"] = None
    if not picked:
        return None
    try:
        return json.dumps(picked)
    except (TypeError, ValueError):
        # Not JSON-serialisable: the backend counts it and serves without a hint.
        return "null"


def _token_indices(host_indices) -> list:
    return torch.as_tensor(host_indices).reshape(-1).tolist()


def _count(keys):
    try:
        return len(keys)
    except TypeError:
        return 0


def _fail_closed(miss):
    """An exception in a data-path call (say, a key that is not a str) becomes
    ``miss(keys)`` and is counted: SGLang's I/O threads catch little, and one
    exception there can stop L3 (or L2) for the life of the process."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, keys, *args, **kwargs):
            try:
                return method(self, keys, *args, **kwargs)
            except Exception:
                self._python_faults += 1
                logger.exception("kvcr: %s failed; served as a miss", method.__name__)
                return miss(keys)

        return guarded

    return wrap


def _no_pages(keys):
    return [False] * _count(keys)


def _no_tensors(keys):
    return [None] * _count(keys)


class KvcrStorage(HiCacheStorage):
    """One SGLang rank's kvcr backend.

    ``storage_config`` is SGLang's ``HiCacheStorageConfig``; its
    ``extra_config`` holds the backend's settings (``local_dram_bytes`` is
    required; see kvcr-hicache-storage's ``BackendConfig``). ``kwargs`` is
    what the loader passes (``{}``); for TP > 1 the engine passes its
    collective there: ``rank_group`` (``rank``, ``size``,
    ``all_reduce_min(list)``, ``all_gather(list)``), used by the prefetch
    thread's calls, and ``backup_group``, the backup thread's (without it,
    ``rank_group`` serves both and the two threads must not overlap).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs=None):
        kwargs = kwargs or {}
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.interface_v1 = bool(extra.get("interface_v1"))
        config = {field: getattr(storage_config, field, None) for field in _CONFIG_FIELDS}
        config["extra_config"] = extra
        self._backend = Backend(
            json.dumps(config),
            kwargs.get("rank_group"),
            kwargs.get("backup_group"),
        )
        self.mem_pool_host = None
        self._python_faults = 0

    # -- registration ------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        """Registers SGLang's host KV pool (zero-copy path) or, for the legacy
        path, a staging pool of its page geometry; starts the runner.

        The pool's ``kv_buffer`` must stay allocated for the life of this
        backend (it does in SGLang: the pool lives as long as the engine).
        """
        if self.mem_pool_host is mem_pool_host:
            return
        if self.mem_pool_host is not None:
            raise ValueError("kvcr: a different host pool is already registered")
        geometry = dict(
            layers=int(mem_pool_host.layer_num),
            kv_heads=int(mem_pool_host.head_num),
            head_dim=int(mem_pool_host.head_dim),
            dtype_bytes=int(mem_pool_host.dtype.itemsize),
            page_size=int(mem_pool_host.page_size),
        )
        if self.interface_v1:
            buffer = getattr(mem_pool_host, "kv_buffer", None)
            if not isinstance(buffer, torch.Tensor):
                raise ValueError(
                    "kvcr: the host pool has no single kv_buffer tensor (hybrid and "
                    "split K/V host pools are not supported)"
                )
            if buffer.device.type != "cpu" or not buffer.is_contiguous():
                raise ValueError("kvcr: the host pool's kv_buffer must be one contiguous CPU buffer")
            self._backend.register_host_pool(
                layout=str(mem_pool_host.layout),
                base=buffer.data_ptr(),
                nbytes=buffer.numel() * buffer.element_size(),
                pages=int(mem_pool_host.size) // geometry["page_size"],
                **geometry,
            )
        else:
            self._backend.register_staging_pool(**geometry)
        super().register_mem_pool_host(mem_pool_host)

    # -- the zero-copy path (interface_v1) ---------------------------------

    @_fail_closed(lambda keys: 0)
    def batch_exists(self, keys, extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._backend.batch_exists(list(keys), _extra_info_json(extra_info))

    @_fail_closed(_no_pages)
    def batch_get_v1(self, keys, host_indices, extra_info: HiCacheStorageExtraInfo | None = None):
        return self._backend.batch_get_v1(
            list(keys), _token_indices(host_indices), _extra_info_json(extra_info)
        )

    @_fail_closed(_no_pages)
    def batch_set_v1(self, keys, host_indices, extra_info: HiCacheStorageExtraInfo | None = None):
        return self._backend.batch_set_v1(
            list(keys), _token_indices(host_indices), _extra_info_json(extra_info)
        )

    # -- the legacy byte-copy path -----------------------------------------

    @_fail_closed(_no_tensors)
    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Fills each flat page tensor in ``target_locations``; returns it, or
        None for a miss (SGLang reads the leading run). The tensors go to the
        extension as they are: it reads each one's memory from the tensor and
        refuses (as a miss) anything but a contiguous CPU tensor of one page."""
        keys = list(keys)
        targets = list(target_locations or [])
        # Every key reaches the extension (a bad target is its miss), so
        # every rank makes the same storage calls.
        restored = self._backend.batch_get_flat(keys, targets)
        out = [t if ok else None for t, ok in zip(targets, restored)]
        return out + [None] * (len(keys) - len(out))

    @_fail_closed(lambda keys: False)
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        keys = list(keys)
        # The contiguous copies live in this list for the whole call.
        values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in (values or [])]
        return all(self._backend.batch_set_flat(keys, values))

    @_fail_closed(lambda key: None)
    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    @_fail_closed(lambda key: False)
    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    @_fail_closed(lambda key: False)
    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    # -- the runner's handle -----------------------------------------------

    @property
    def endpoint(self):
        """The control endpoint peers and routers name in hints (peer mode)."""
        return self._backend.endpoint

    @property
    def spans_per_page(self):
        """Contiguous host ranges per page of the registered pool (K and V of
        every layer for ``layer_first``, 2 for the page-major layouts); None
        before registration."""
        return self._backend.spans_per_page

    # -- inventory publishing (``publish_inventory``) ------------------------

    @property
    def kv_events_endpoint(self):
        """The ZMQ PUB endpoint of this DP group's KVCR inventory (on the DP
        owner rank, once the host pool is registered; else None)."""
        return self._backend.kv_events_endpoint

    @property
    def kv_events_replay_endpoint(self):
        """The replay endpoint of the same stream (or None)."""
        return self._backend.kv_events_replay_endpoint

    @property
    def registration_metadata(self):
        """What the engine forwards to its router, as ``(key, value)`` pairs in
        publish order: the KV-event endpoints, then (peer mode)
        ``router_hint_source_control_endpoints``, ``router_hint_worker_type``
        and ``router_hint`` last. Empty on ranks that do not own their DP group."""
        return self._backend.registration_metadata()

    def sync_inventory(self) -> None:
        """Withdraws pages any rank evicted since the last backup (a
        collective: call it on every rank; ``batch_set_v1`` does it too)."""
        self._backend.sync_inventory()

    def close(self) -> None:
        """Detaches from the routers: the inventory stream ends with
        ``AllBlocksCleared``. Pages stay in KVCR DRAM until the backend is
        dropped."""
        self._backend.close_inventory()

    def discard_request(self, request_id: str) -> None:
        """Ends a request's hint scope."""
        self._backend.discard_request(request_id)

    def get_stats(self):
        """The backend's counters, this layer's ``faults_argument`` and
        ``extra_info_rejected``, and ``faults_python`` (calls that raised in
        this class and were served as misses)."""
        stats = self._backend.stats()
        stats["faults_python"] = self._python_faults
        return stats

    def clear(self) -> None:
        # KVCR DRAM is the runner's: its pages leave by eviction, and
        # published pages are withdrawn by their Removed events. SGLang's
        # clear() is a cache-reset hint; nothing here may drop pages a peer
        # may be reading.
        return None
