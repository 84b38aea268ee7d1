"""Hostile and malformed input to the extension (``kvcr_hicache.Backend``,
called directly as well as through SGLang's class): a host pool whose memory
is not mapped, flat pages that would run past their tensor, two keys naming
one host page, indices that are not non-negative integers, and the cluster
secret's configuration. The data path answers misses (never raises, never
writes outside what it was given); construction and registration refuse with
``KvcrError`` and never echo the secret."""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import subprocess
import sys

import pytest
import torch

import engine
from engine import Controller, attach, extra_config, fetch_hint, free_port, prompt_keys
from host_pool import MhaHostPool

import kvcr_hicache
from kvcr_hicache import Backend, KvcrError

HERE = os.path.dirname(os.path.abspath(__file__))
POOL_GEOMETRY = dict(layers=2, kv_heads=2, head_dim=8, dtype_bytes=2, page_size=4)
PAGE_BYTES = MhaHostPool(pages=1, **engine.GEOMETRY).page_bytes  # 1 KiB
OS_PAGE = mmap.PAGESIZE


def native_backend(**extra):
    """A bare extension backend (no SGLang class), as another engine builds it."""
    config = {"model_name": "Qwen/Qwen3-0.6B", "extra_config": extra_config(True, **extra)}
    return Backend(json.dumps(config))


def register(backend, base, nbytes, pages):
    backend.register_host_pool(layout="page_first", base=base, nbytes=nbytes, pages=pages,
                               **POOL_GEOMETRY)


# -- 1. a host pool whose memory is not mapped -----------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


@contextlib.contextmanager
def anonymous_mapping(os_pages, prot):
    length = os_pages * OS_PAGE
    addr = _libc.mmap(None, length, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, _MAP_FAILED), ctypes.get_errno()
    try:
        yield addr
    finally:
        _libc.munmap(addr, length)


@contextlib.contextmanager
def pool_memory(kind):
    """(base, nbytes) of three OS pages of memory that must be refused."""
    length = 3 * OS_PAGE
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    if kind == "never_mapped":
        yield 0x1000, length  # below every mapping of the process
    elif kind == "kernel_half":
        yield 0xFFFF_8000_0000_0000, length
    elif kind == "hole":
        with anonymous_mapping(3, rw) as addr:
            assert _libc.munmap(addr + OS_PAGE, OS_PAGE) == 0
            yield addr, length
    elif kind == "unmapped_after_use":
        with anonymous_mapping(3, rw) as addr:
            pass
        yield addr, length
    elif kind == "read_only":
        with anonymous_mapping(3, mmap.PROT_READ) as addr:
            yield addr, length
    elif kind == "no_access":
        with anonymous_mapping(3, 0) as addr:  # PROT_NONE
            yield addr, length
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind,why",
    [
        ("never_mapped", "is not mapped"),
        ("kernel_half", "is not mapped"),
        ("hole", "is not mapped"),
        ("unmapped_after_use", "is not mapped"),
        ("read_only", "without read and write"),
        ("no_access", "without read and write"),
    ],
)
def test_a_pool_that_is_not_mapped_is_refused_and_the_data_path_stays_safe(kind, why):
    backend = native_backend()
    keys = prompt_keys(2, salt=70)
    with pool_memory(kind) as (base, nbytes):
        with pytest.raises(KvcrError, match=why):
            register(backend, base, nbytes, nbytes // PAGE_BYTES)
        # Before the fix this call copied from the unmapped base: SIGSEGV.
        indices = list(range(2 * POOL_GEOMETRY["page_size"]))
        assert backend.batch_set_v1(keys, indices) == [False, False]
        assert backend.batch_get_v1(keys, indices) == [False, False]
        assert backend.batch_exists(keys) == 0
    assert backend.page_bytes is None  # nothing registered
    # The refusal latched nothing: a real pool registers and serves.
    pool = torch.zeros(12 * PAGE_BYTES, dtype=torch.uint8)
    register(backend, pool.data_ptr(), pool.numel(), 12)
    pool[:PAGE_BYTES // 2] = 7
    assert backend.batch_set_v1(keys[:1], list(range(4))) == [True]
    del backend  # (its runner goes before the memory it registered)


@pytest.mark.parametrize(
    "base,nbytes,pages,why",
    [
        (0, 12 * PAGE_BYTES, 12, "null"),
        (1 << 20, 0, 12, "zero"),
        (1 << 20, 12 * PAGE_BYTES - 1, 12, "need"),
        ((1 << 64) - 4 * PAGE_BYTES, 12 * PAGE_BYTES, 12, "wraps"),
        (1 << 20, 0, 0, "pages"),
    ],
    ids=["null_base", "zero_size", "size_not_the_geometry", "wraps", "no_pages"],
)
def test_an_implausible_pool_description_is_refused(base, nbytes, pages, why):
    backend = native_backend()
    with pytest.raises(KvcrError, match=why):
        register(backend, base, nbytes, pages)
    assert backend.batch_get_v1(prompt_keys(1), list(range(4))) == [False]


# -- 2. flat pages never run past their tensor -------------------------------

def legacy_backend():
    pool = MhaHostPool(pages=8, **engine.GEOMETRY)
    backend = attach(extra_config(False), pool)
    return backend, pool, backend._backend


def test_a_flat_page_is_read_from_the_tensor_never_from_an_address():
    backend, pool, native = legacy_backend()
    key, other = prompt_keys(2, salt=80)
    pool.fill_pages([0], seed=80)
    stored = pool.get_data_page(0).view(torch.uint8)
    assert native.batch_set_flat([key], [pool.get_data_page(0)]) == [True]
    guard = torch.zeros(PAGE_BYTES + 64, dtype=torch.uint8)
    view = guard[:PAGE_BYTES]

    # The finding: an address one byte into the tensor, with a page's length,
    # wrote one byte past the tensor and reported True. An (address, nbytes)
    # pair is no longer a flat page at all.
    before = native.stats()["faults_argument"]
    assert native.batch_get_flat([key], [(view.data_ptr() + 1, PAGE_BYTES)]) == [False]
    assert native.batch_get_flat([key], [(view.data_ptr(), PAGE_BYTES)]) == [False]
    assert not guard.any(), "nothing was written"
    assert native.stats()["faults_argument"] == before + 2
    assert native.batch_set_flat([other], [(view.data_ptr(), PAGE_BYTES)]) == [False]
    assert native.batch_exists([other]) == 0

    # The tensor itself: exactly its bytes are written.
    assert native.batch_get_flat([key], [view]) == [True]
    assert torch.equal(view, stored) and not guard[PAGE_BYTES:].any()
    # A view one byte into a larger storage is a tensor of its own: its
    # bytes, and not one past them.
    guard.zero_()
    shifted = guard[1 : 1 + PAGE_BYTES]
    assert native.batch_get_flat([key], [shifted]) == [True]
    assert torch.equal(shifted, stored)
    assert guard[0] == 0 and not guard[1 + PAGE_BYTES :].any()


class _LyingTensor(torch.Tensor):
    """A subclass that lies about its address (one byte further)."""

    def data_ptr(self):
        return super().data_ptr() + 1


def _unusable_pages():
    contiguous = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    return {
        "address_pair": (contiguous.data_ptr(), PAGE_BYTES),
        "int": contiguous.data_ptr(),
        "none": None,
        "bytearray": bytearray(PAGE_BYTES),
        "one_byte_short": torch.zeros(PAGE_BYTES - 1, dtype=torch.uint8),
        "one_byte_long": torch.zeros(PAGE_BYTES + 1, dtype=torch.uint8),
        "strided": torch.zeros(2 * PAGE_BYTES, dtype=torch.uint8)[::2],
        "meta": torch.empty(PAGE_BYTES, dtype=torch.uint8, device="meta"),
        "sparse": torch.zeros(PAGE_BYTES, dtype=torch.uint8).to_sparse(),
        "parameter": torch.nn.Parameter(torch.zeros(PAGE_BYTES, dtype=torch.uint8),
                                        requires_grad=False),
        "lying_subclass": torch.zeros(PAGE_BYTES, dtype=torch.uint8).as_subclass(_LyingTensor),
    }


@pytest.mark.parametrize("name", sorted(_unusable_pages()))
def test_anything_but_a_contiguous_cpu_tensor_of_one_page_is_a_miss(name):
    backend, pool, native = legacy_backend()
    key, fresh = prompt_keys(2, salt=81)
    pool.fill_pages([0], seed=81)
    assert native.batch_set_flat([key], [pool.get_data_page(0)]) == [True]
    page = _unusable_pages()[name]
    assert native.batch_get_flat([key], [page]) == [False]
    assert native.batch_set_flat([fresh], [page]) == [False]
    assert native.batch_exists([fresh]) == 0
    if isinstance(page, torch.Tensor) and page.device.type == "cpu" and not page.is_sparse:
        assert not page.any(), "nothing was written"
    # Through SGLang's class: None / False, never an exception (its
    # batch_set makes a strided tensor contiguous first, a legitimate copy).
    assert backend.batch_get([key], [page]) == [None]
    assert backend.batch_set([fresh], [page]) is (name == "strided")


# -- 3. two keys naming one host page --------------------------------------

def test_one_host_page_named_twice_in_a_v1_call_is_refused():
    pool = MhaHostPool(pages=16, **engine.GEOMETRY)
    backend = attach(extra_config(True), pool)
    keys = prompt_keys(2, salt=90)
    pool.fill_pages([0, 1], seed=90)
    # Set: two keys from one source page stores nothing.
    assert backend.batch_set_v1(keys, pool.token_indices([0, 0])) == [False, False]
    assert backend.batch_exists(keys) == 0
    stats = backend.get_stats()
    assert stats["faults_batch_set"] == 1
    assert "host page 0 is named more than once" in stats["last_error"]

    assert backend.batch_set_v1(keys, pool.token_indices([0, 1])) == [True, True]
    # Get: two keys into one destination page writes nothing.
    pool.clear_pages([5])
    assert backend.batch_get_v1(keys, pool.token_indices([5, 5])) == [False, False]
    assert backend.batch_get_v1([keys[0], keys[0]], pool.token_indices([5, 5])) == [False, False]
    assert not pool.page_bytes_of(5).any()
    stats = backend.get_stats()
    assert stats["faults_batch_get"] == 2
    assert "host page 5 is named more than once" in stats["last_error"]
    # One key into two pages is fine (SGLang restores a prefix twice), and so
    # is every page once.
    assert backend.batch_get_v1([keys[0], keys[0]], pool.token_indices([5, 6])) == [True, True]
    assert backend.batch_get_v1(keys, pool.token_indices([7, 8])) == [True, True]
    assert torch.equal(pool.page_bytes_of(8), pool.page_bytes_of(1))


def test_one_flat_tensor_named_twice_is_refused():
    backend, pool, native = legacy_backend()
    keys = prompt_keys(3, salt=91)
    pool.fill_pages([0, 1], seed=91)
    assert native.batch_set_flat(keys[:2], [pool.get_data_page(0), pool.get_data_page(4)]) == [True] * 2
    target = pool.get_dummy_flat_data_page()
    assert native.batch_get_flat(keys[:2], [target, target]) == [False, False]
    assert not target.view(torch.uint8).any()
    # Views that share only part of their bytes are refused too.
    backing = torch.zeros(2 * PAGE_BYTES, dtype=torch.uint8)
    halves = [backing[:PAGE_BYTES], backing[PAGE_BYTES // 2 : PAGE_BYTES // 2 + PAGE_BYTES]]
    assert native.batch_get_flat(keys[:2], halves) == [False, False]
    assert not backing.any()
    assert backend.batch_get(keys[:2], [target, target]) == [None, None]
    # A set from one tensor under two keys stores nothing.
    source = pool.get_data_page(0)
    assert native.batch_set_flat([keys[2], prompt_keys(1, salt=92)[0]], [source, source]) == [False] * 2
    assert native.batch_exists(keys[2:]) == 0
    # Distinct tensors still work.
    a, b = pool.get_dummy_flat_data_page(), pool.get_dummy_flat_data_page()
    assert native.batch_get_flat(keys[:2], [a, b]) == [True, True]


# -- 4. indices and other arguments that are not what they should be --------

BAD_INDICES = {
    "negative": [-4, -3, -2, -1],
    "one_negative": [0, 1, 2, -1],
    "beyond_u64": [1 << 64] * 4,
    "beyond_i64": [1 << 63] * 4,
    "floats": [0.0, 1.0, 2.0, 3.0],
    "strings": ["0", "1", "2", "3"],
    "nones": [None] * 4,
    "none": None,
    "a_str": "0123",
    "an_int": 4,
    "a_dict": {0: 0},
    "not_page_aligned": [1, 2, 3, 4],
    "far_outside": [4 << 40, (4 << 40) + 1, (4 << 40) + 2, (4 << 40) + 3],
}


@pytest.mark.parametrize("name", sorted(BAD_INDICES))
def test_bad_token_indices_are_misses_never_exceptions(name):
    pool = MhaHostPool(pages=8, **engine.GEOMETRY)
    backend = attach(extra_config(True), pool)
    native = backend._backend
    keys = prompt_keys(1, salt=100)
    pool.fill_pages([0], seed=100)
    assert native.batch_set_v1(keys, pool.token_indices([0]).tolist()) == [True]
    bad = BAD_INDICES[name]
    assert native.batch_get_v1(keys, bad) == [False]
    assert native.batch_set_v1(prompt_keys(1, salt=101), bad) == [False]
    _, restored = kvcr_hicache._native.restore_from_rust(native, keys, bad, 1)
    assert restored is False
    stats = native.stats()
    assert stats["faults_argument"] + stats["faults_batch_get"] >= 1
    # Still serving.
    assert native.batch_get_v1(keys, pool.token_indices([3]).tolist()) == [True]


@pytest.mark.parametrize(
    "keys,shape",
    [
        (None, 0),
        (5, 0),
        ("0" * 64, 0),  # a str is not a list of keys
        ([None, 5], 2),
        ([b"0" * 64], 1),
        (["not-a-digest"], 1),
        ([["nested"]], 1),
    ],
    ids=["none", "int", "str", "non_str_items", "bytes_item", "not_a_digest", "nested"],
)
def test_bad_keys_are_misses_never_exceptions(keys, shape):
    pool = MhaHostPool(pages=8, **engine.GEOMETRY)
    native = attach(extra_config(True), pool)._backend
    indices = pool.token_indices(range(shape)).tolist() if shape else []
    assert native.batch_exists(keys) == 0
    assert native.batch_get_v1(keys, indices) == [False] * shape
    assert native.batch_set_v1(keys, indices) == [False] * shape
    assert native.stats()["faults_argument"] >= 3


@pytest.mark.parametrize("extra", [5, b"{}", "not json", "[1]", {"request_id": "r"}],
                         ids=["int", "bytes", "not_json", "list", "dict"])
def test_bad_extra_info_is_served_without_a_hint(extra):
    pool = MhaHostPool(pages=8, **engine.GEOMETRY)
    native = attach(extra_config(True), pool)._backend
    keys = prompt_keys(1, salt=102)
    assert native.batch_set_v1(keys, pool.token_indices([0]).tolist(), extra) == [True]
    assert native.batch_exists(keys, extra) == 1
    assert native.batch_get_v1(keys, pool.token_indices([1]).tolist(), extra) == [True]
    assert native.stats()["extra_info_rejected"] == 3


def test_bad_flat_page_lists_are_misses_never_exceptions():
    _, _, native = legacy_backend()
    keys = prompt_keys(2, salt=103)
    for pages in (None, 5, "pages", [None]):
        assert native.batch_get_flat(keys, pages) == [False, False]
        assert native.batch_set_flat(keys, pages) == [False, False]
    assert native.batch_get_flat(None, None) == []


# -- 5. the cluster secret ---------------------------------------------------

SECRET = "kvcr-test-cluster-secret"


def test_the_cluster_secret_keys_are_checked_and_never_echoed(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCR_CLUSTER_SECRET", raising=False)
    short = "tiny-secret"
    with pytest.raises(KvcrError, match="cluster_secret.*at least 16 bytes") as e:
        native_backend(cluster_secret=short)
    assert short not in str(e.value)
    with pytest.raises(KvcrError, match="not both") as e:
        native_backend(cluster_secret=SECRET, cluster_secret_file=str(tmp_path / "s"))
    assert SECRET not in str(e.value)
    with pytest.raises(KvcrError, match="cluster_secret_file.*cannot read"):
        native_backend(cluster_secret_file=str(tmp_path / "missing"))
    with pytest.raises(KvcrError, match="cluster_secret"):
        native_backend(cluster_secret=12345678901234567890)
    with pytest.raises(KvcrError, match="unknown key `cluster_secrets`") as e:
        native_backend(cluster_secrets=SECRET)
    assert SECRET not in str(e.value)
    secret_file = tmp_path / "secret"
    secret_file.write_text(f"  {short}\n")
    with pytest.raises(KvcrError, match="cluster_secret_file.*at least 16 bytes") as e:
        native_backend(cluster_secret_file=str(secret_file))
    assert short not in str(e.value)
    secret_file.write_text(f"{SECRET}\n")
    native_backend(cluster_secret_file=str(secret_file))
    native_backend(cluster_secret=SECRET)
    # Peers on other hosts need a secret (without one the control channel
    # serves loopback only).
    cross_host = dict(enable_remote_hint=True, control_port=free_port(),
                      control_advertise_host="10.0.0.5")
    with pytest.raises(KvcrError, match="needs a cluster secret"):
        native_backend(**cross_host)
    native_backend(cluster_secret=SECRET, **cross_host)
    # The environment variable is the fallback when neither key is set.
    monkeypatch.setenv("KVCR_CLUSTER_SECRET", short)
    with pytest.raises(KvcrError, match="KVCR_CLUSTER_SECRET.*at least 16 bytes") as e:
        native_backend()
    assert short not in str(e.value)
    native_backend(cluster_secret=SECRET)  # a key wins over the environment
    monkeypatch.setenv("KVCR_CLUSTER_SECRET", SECRET)
    native_backend(**cross_host)
    # Nothing the backend reports carries it.
    pool = MhaHostPool(pages=4, **engine.GEOMETRY)
    backend = attach(extra_config(True, cluster_secret=SECRET), pool)
    assert SECRET not in repr(backend.get_stats()) + repr(backend._backend)


@pytest.fixture(scope="module")
def secret_source():
    """A source engine process whose secret comes from KVCR_CLUSTER_SECRET."""
    env = dict(os.environ, KVCR_CLUSTER_SECRET=SECRET)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peer_source.py"), str(free_port()),
         "posix,cma,self", "1200", "7:4"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE, env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line, f"source exited early with {proc.wait(timeout=30)}"
        yield json.loads(line)
    finally:
        if proc.poll() is None:
            proc.stdin.write("quit\n")
            proc.stdin.close()
        assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize(
    "dest_secret,restores",
    [(SECRET, True), ("another-cluster-secret", False), (None, False)],
    ids=["same_secret", "other_secret", "no_secret"],
)
def test_the_cluster_secret_reaches_the_peer_channel(secret_source, dest_secret, restores,
                                                     monkeypatch):
    monkeypatch.delenv("KVCR_CLUSTER_SECRET", raising=False)
    assert secret_source["stored"] == {"7": 4}
    more = dict(operation_timeout_ms=1000, get_timeout_s=3)
    if dest_secret:
        more["cluster_secret"] = dest_secret
    pool = MhaHostPool(pages=8, **engine.GEOMETRY)
    dest = attach(engine.peer_extra_config(free_port(), "posix,cma,self", **more), pool)
    keys = prompt_keys(4, 7)
    hint = {"kvcr_router_hint": fetch_hint(secret_source["endpoint"], keys), "request_id": "s"}
    ctl = Controller(dest, pool, interface_v1=True)
    assert ctl.prefetch(keys, pool.token_indices(range(4)), extra_info=hint) == (4 if restores else 0)
    scratch = MhaHostPool(pages=4, **engine.GEOMETRY)
    scratch.fill_pages(range(4), seed=1200 + 7)
    for p in range(4):
        assert torch.equal(pool.page_bytes_of(p), scratch.page_bytes_of(p)) == restores
    stats = dest.get_stats()
    assert stats["hinted_pages_loaded"] == (4 if restores else 0)
    assert stats["faults_batch_get"] == 0
