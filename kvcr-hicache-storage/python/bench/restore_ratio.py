"""BENCH py.restore_ratio: a restore of 64 pages of Qwen3-0.6B KV (64-token
pages, 7,340,032 bytes each) from local KVCR DRAM into an engine host pool,
driven through Python (SGLang's loader builds ``KvcrStorage``; each iteration is
one ``batch_get_v1`` call as SGLang's controller makes it), against the same
restore driven from Rust (``kvcr_hicache._native.restore_from_rust``: the same
backend, host pool, keys and pages, looping inside the extension with no
Python between iterations). Iterations alternate between the two (and which
goes first), so both see the same machine state; each figure is a median, and the
ratio is the median of the back-to-back pairs' ratios.

    python bench/restore_ratio.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402

import engine  # noqa: E402
from host_pool import MhaHostPool  # noqa: E402
from kvcr_hicache import _native  # noqa: E402

PAGES = 64
QWEN3_0_6B = dict(page_size=64, layer_num=28, head_num=8, head_dim=128, dtype=torch.bfloat16)


def main(argv):
    quick = "--quick" in argv
    iterations = 15 if quick else 41
    pool = MhaHostPool(pages=PAGES, layout="page_first", **QWEN3_0_6B)
    page_bytes = pool.page_bytes
    assert page_bytes == 7_340_032, page_bytes
    extra = dict(
        engine.KVCR_LOADER_KEYS,
        interface_v1=1,
        local_dram_bytes=(PAGES + 1) * page_bytes,
        prefault=True,
    )
    storage = engine.attach(extra, pool)
    tokens = list(range(PAGES * QWEN3_0_6B["page_size"]))
    keys = engine.page_keys(tokens, QWEN3_0_6B["page_size"])
    indices = pool.token_indices(range(PAGES))
    pool.fill_pages(range(PAGES), seed=7)
    first, last = pool.page_bytes_of(0), pool.page_bytes_of(PAGES - 1)
    assert all(storage.batch_set_v1(keys, indices)), "deposit failed"

    info = engine.HiCacheStorageExtraInfo(prefix_keys=None)
    index_list = indices.tolist()
    py_seconds, rust_seconds = [], []

    def through_python():
        pool.clear_pages([0, PAGES - 1])
        start = time.perf_counter()
        ok = storage.batch_get_v1(keys, indices, info)
        elapsed = time.perf_counter() - start
        assert all(ok), "restore through Python missed pages"
        assert torch.equal(pool.page_bytes_of(0), first)
        assert torch.equal(pool.page_bytes_of(PAGES - 1), last)
        return elapsed

    def from_rust():
        pool.clear_pages([0, PAGES - 1])
        seconds, all_ok = _native.restore_from_rust(storage._backend, keys, index_list, 1)
        assert all_ok, "restore from Rust missed pages"
        assert torch.equal(pool.page_bytes_of(0), first)
        return seconds[0]

    for i in range(iterations + 2):  # two warm-up rounds
        # Alternate which goes first, so neither always follows the other.
        if i % 2:
            rust, py = from_rust(), through_python()
        else:
            py, rust = through_python(), from_rust()
        if i >= 2:
            py_seconds.append(py)
            rust_seconds.append(rust)

    total = PAGES * page_bytes
    py_rate = total / statistics.median(py_seconds) / 1e9
    rust_rate = total / statistics.median(rust_seconds) / 1e9
    # Each pair ran back to back, so its ratio sees one machine state; the
    # median of the pairs is steadier than a ratio of medians on a busy host.
    ratio = statistics.median(r / p for p, r in zip(py_seconds, rust_seconds))
    print(f"BENCH py.restore_ratio value={py_rate:.2f} unit=GB/s "
          f"anchor={rust_rate:.2f} ratio={ratio:.3f}")
    print(f"# py.restore_ratio: batch_get_v1 of {PAGES} x {page_bytes} B pages (Qwen3-0.6B) "
          f"from local KVCR DRAM into a page_first host pool, through SGLang's KvcrStorage "
          f"(value) vs the same restore driven from Rust in the extension (anchor); "
          f"{iterations} back-to-back pairs, medians; ratio = median of the pairs' ratios")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
