"""kvcr through SGLang's own HiCache storage contract: SGLang's files
(environ.py, hicache_storage.py, backend_factory.py from the 0.5.23 wheel,
unmodified), its dynamic-backend loader, and its controller's call patterns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import engine
from engine import GEOMETRY, Controller, HiCacheStorageExtraInfo, attach, extra_config, prompt_keys
from host_pool import MhaHostPool

import kvcr_hicache
from kvcr_hicache.sglang import KvcrStorage

HOST_PAGES = 160
LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]


def start(layout="page_first", interface_v1=True, **extra):
    pool = MhaHostPool(pages=HOST_PAGES, layout=layout, **GEOMETRY)
    backend = attach(extra_config(interface_v1, **extra), pool)
    return backend, pool, Controller(backend, pool, interface_v1)


def test_sglang_loader_builds_kvcr_as_a_hicache_storage():
    backend, pool, _ = start()
    assert type(backend) is KvcrStorage
    assert isinstance(backend, engine.hicache_storage.HiCacheStorage)
    assert backend.mem_pool_host is pool
    # Registering the same pool again (SGLang re-attaches) is a no-op.
    backend.register_mem_pool_host(pool)
    stats = backend.get_stats()
    assert stats["pages_committed"] == 0 and stats["faults_argument"] == 0


def test_sglang_loader_rejects_a_class_that_is_not_a_subclass():
    config = engine.storage_config(
        {"backend_name": "fake", "module_path": "not_a_backend", "class_name": "LooksLikeStorage"}
    )
    with pytest.raises(TypeError, match="must inherit from HiCacheStorage"):
        engine.StorageBackendFactory.create_backend("dynamic", config, None)


def test_sglang_loader_requires_its_fields_and_kvcr_its_settings():
    no_class = {"backend_name": "kvcr", "module_path": "kvcr_hicache.sglang"}
    with pytest.raises(ValueError, match="Missing required field 'class_name'"):
        engine.StorageBackendFactory.create_backend("dynamic", engine.storage_config(no_class), None)
    # kvcr's own validation surfaces through the loader, naming the key.
    with pytest.raises(kvcr_hicache.KvcrError, match="local_dram_bytes"):
        engine.StorageBackendFactory.create_backend(
            "dynamic", engine.storage_config(dict(engine.KVCR_LOADER_KEYS)), None
        )
    with pytest.raises(kvcr_hicache.KvcrError, match="unknown key `lcoal_dram_bytes`"):
        engine.StorageBackendFactory.create_backend(
            "dynamic",
            engine.storage_config(dict(engine.KVCR_LOADER_KEYS, lcoal_dram_bytes=1 << 20)),
            None,
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_set_exists_get_restores_every_byte(layout):
    backend, pool, ctl = start(layout)
    keys = prompt_keys(6)
    pages = list(range(10, 16))
    pool.fill_pages(pages, seed=11)
    expected = [pool.page_bytes_of(p) for p in pages]
    indices = pool.token_indices(pages)

    assert ctl.hit_query(keys) == 0
    assert ctl.backup(keys, indices) == 6
    assert ctl.hit_query(keys) == 6

    # Restore into other host pages (the engine reuses pages freely).
    targets = list(range(40, 46))
    assert ctl.prefetch(keys, pool.token_indices(targets)) == 6
    for page, want in zip(targets, expected):
        assert torch.equal(pool.page_bytes_of(page), want), f"page {page} differs"
    stats = backend.get_stats()
    assert stats["pages_committed"] == 6 and stats["pages_restored"] == 6


def test_v1_misses_and_partial_hits_have_the_right_shape():
    backend, pool, ctl = start()
    keys = prompt_keys(5)
    pool.fill_pages(range(5), seed=3)
    assert ctl.backup(keys[:3], pool.token_indices(range(3))) == 3
    # Key 3 was never stored: hits stop there even though key 4 is stored next.
    assert backend.batch_set_v1([keys[4]], pool.token_indices([4])) == [True]
    assert backend.batch_exists(keys) == 3
    assert ctl.hit_query(keys) == 3

    targets = list(range(100, 105))
    results = backend.batch_get_v1(keys, pool.token_indices(targets))
    assert results[:3] == [True, True, True]
    assert results[3] is False
    for i in range(3):
        assert torch.equal(pool.page_bytes_of(100 + i), pool.page_bytes_of(i))
    # Controller view: the leading run only.
    assert ctl.prefetch(keys, pool.token_indices(targets)) == 3
    # A prompt nobody stored.
    unknown = prompt_keys(4, salt=99)
    assert backend.batch_exists(unknown) == 0
    assert backend.batch_get_v1(unknown, pool.token_indices(range(120, 124))) == [False] * 4


def test_more_than_one_storage_batch():
    backend, pool, ctl = start()
    n = engine.STORAGE_BATCH_SIZE + 5
    keys = prompt_keys(n, salt=5)
    pool.fill_pages(range(n), seed=5)
    expected = [pool.page_bytes_of(p) for p in range(n)]
    assert ctl.backup(keys, pool.token_indices(range(n))) == n
    assert ctl.hit_query(keys) == n
    pool.clear_pages(range(n))
    assert ctl.prefetch(keys, pool.token_indices(range(n))) == n
    assert all(torch.equal(pool.page_bytes_of(p), expected[p]) for p in range(n))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_legacy_flat_pages_set_exists_get(layout):
    backend, pool, ctl = start(layout, interface_v1=False)
    n = kvcr_hicache.STAGING_PAGES * 2 + 3  # several staging chunks
    keys = prompt_keys(n, salt=2)
    pages = list(range(n))
    pool.fill_pages(pages, seed=21)
    expected = [pool.page_bytes_of(p) for p in pages]
    assert ctl.hit_query(keys) == 0
    assert ctl.backup(keys, pool.token_indices(pages)) == n
    assert ctl.hit_query(keys) == n
    pool.clear_pages(pages)
    assert ctl.prefetch(keys, pool.token_indices(pages)) == n
    for p in pages:
        assert torch.equal(pool.page_bytes_of(p), expected[p]), f"page {p} differs"

    # Single-key legacy calls, misses as None / False.
    dummy = pool.get_dummy_flat_data_page()
    assert backend.exists(keys[0]) and not backend.exists(prompt_keys(1, salt=77)[0])
    got = backend.get(keys[1], dummy)
    assert got is dummy and torch.equal(dummy.view(torch.uint8), expected[1])
    assert backend.get(prompt_keys(1, salt=77)[0], pool.get_dummy_flat_data_page()) is None
    # Flat pages of the wrong size or layout are misses, counted.
    before = backend.get_stats()["faults_argument"]
    assert backend.batch_set(keys[:1], [torch.zeros(7, dtype=torch.bfloat16)]) is False
    assert backend.get(keys[0], torch.zeros(7, dtype=torch.bfloat16)) is None
    strided = torch.zeros(pool.page_bytes, dtype=torch.bfloat16)[::2]
    assert backend.get(keys[0], strided) is None
    assert backend.get_stats()["faults_argument"] == before + 3
    # Partial: the miss and everything after it are None.
    mixed = keys[:2] + prompt_keys(1, salt=78) + keys[2:4]
    out = backend.batch_get(mixed, [pool.get_dummy_flat_data_page() for _ in mixed])
    assert [o is not None for o in out] == [True, True, False, False, False]


def test_bad_input_is_a_counted_miss_never_an_exception():
    backend, pool, ctl = start()
    keys = prompt_keys(3)
    pool.fill_pages(range(3), seed=1)
    assert backend.batch_set_v1(keys, pool.token_indices(range(3))) == [True] * 3
    # A key that is not a hex digest ends the usable run.
    assert backend.batch_exists([keys[0], "not-a-key", keys[1]]) == 1
    # Token indices that are not whole, aligned pages: every entry a miss.
    assert backend.batch_get_v1(keys[:2], torch.arange(1, 9)) == [False, False]
    # Host pages outside the registered pool.
    far = torch.arange(HOST_PAGES * 4, HOST_PAGES * 4 + 4)
    assert backend.batch_get_v1(keys[:1], far) == [False]
    # Keys and pages of different lengths.
    assert backend.batch_get_v1(keys, pool.token_indices([50])) == [False, False, False]
    # Legacy calls on a zero-copy backend, and an unserialisable hint.
    assert backend.batch_set(keys, [torch.zeros(3)] * 3) is False
    weird = HiCacheStorageExtraInfo(extra_info={"kvcr_router_hint": object()})
    assert backend.batch_exists(keys, weird) == 3
    # Arguments of the wrong type: the extension reads them without raising
    # (a key that is not a str ends the run like any key that is not a
    # digest), a miss of the right shape, counted.
    assert backend.batch_exists([keys[0], 7]) == 1
    assert backend.batch_get_v1([keys[0], None], pool.token_indices([1, 2])) == [False, False]
    assert backend.batch_get(keys[:2], None) == [None, None]
    # What fails in this class's own Python (keys that are not iterable) is
    # caught here: a miss of the right shape, counted as faults_python.
    assert backend.batch_get_v1(5, pool.token_indices([1])) == []
    assert backend.batch_exists(None) == 0
    stats = backend.get_stats()
    assert stats["faults_argument"] >= 5
    assert stats["faults_python"] == 2
    assert stats["extra_info_rejected"] == 1
    # And the backend keeps serving.
    assert ctl.prefetch(keys, pool.token_indices(range(60, 63))) == 3


def test_router_hint_intake_without_peer_mode_is_counted_and_ignored():
    backend, pool, ctl = start()
    keys = prompt_keys(2)
    info = {"kvcr_router_hint": engine.fetch_hint("tcp://127.0.0.1:9", keys), "request_id": "r1"}
    assert ctl.hit_query(keys, extra_info=info) == 0
    assert backend.get_stats()["hints_ignored"] >= 1


def test_importing_the_sglang_class_without_sglang_names_what_is_missing():
    # A fresh interpreter where SGLang's modules were never loaded.
    code = "import kvcr_hicache.sglang"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd="/")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert "missing module 'sglang'" in proc.stderr, proc.stderr
    assert "sglang.srt.mem_cache.hicache_storage" in proc.stderr


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "legacy"])
def test_prefetch_and_backup_threads_at_once(interface_v1):
    """SGLang's backup thread stores while its prefetch thread restores, on
    one backend; every byte lands where it belongs."""
    from concurrent.futures import ThreadPoolExecutor

    backend, pool, ctl = start(interface_v1=interface_v1)
    old_keys, new_keys = prompt_keys(40, salt=31), prompt_keys(40, salt=32)
    pool.fill_pages(range(80), seed=9)
    expected = {p: pool.page_bytes_of(p) for p in range(80)}
    assert ctl.backup(old_keys, pool.token_indices(range(40))) == 40

    def backup_new():
        return ctl.backup(new_keys, pool.token_indices(range(40, 80)))

    def restore_old():
        return ctl.prefetch(old_keys, pool.token_indices(range(100, 140)))

    with ThreadPoolExecutor(2) as threads:
        stored, restored = threads.submit(backup_new), threads.submit(restore_old)
        assert stored.result(timeout=120) == 40
        assert restored.result(timeout=120) == 40
    for i in range(40):
        assert torch.equal(pool.page_bytes_of(100 + i), expected[i]), f"page {i} differs"
    assert ctl.prefetch(new_keys, pool.token_indices(range(100, 140))) == 40
    for i in range(40):
        assert torch.equal(pool.page_bytes_of(100 + i), expected[40 + i])
