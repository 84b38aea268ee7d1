"""``g3_paths`` / ``g3_capacity_bytes`` through SGLang's loader: a KVCR DRAM
of two pages over a G3 file tier. Pages backed up past DRAM's capacity move
to the files, stay visible to ``batch_exists`` and come back byte-exact."""

from __future__ import annotations

import torch

import engine
from engine import Controller, attach, prompt_keys
from host_pool import MhaHostPool

# Spans of 8 KiB (a multiple of the files' direct-I/O alignment).
GEOMETRY = dict(page_size=16, layer_num=2, head_num=2, head_dim=64)


def test_pages_past_kvcr_dram_live_in_g3_and_restore(tmp_path):
    pool = MhaHostPool(pages=32, **GEOMETRY)
    page_bytes = pool.page_bytes
    extra = engine.extra_config(
        True,
        kvcr_pages=0,
        local_dram_bytes=2 * page_bytes,
        g3_paths=[str(tmp_path / "a"), str(tmp_path / "b")],
        g3_capacity_bytes=16 * page_bytes,
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    backend = attach(extra, pool)
    ctl = Controller(backend, pool, interface_v1=True)
    keys = prompt_keys(8, salt=90)
    pool.fill_pages(range(8), seed=91)
    want = [pool.page_bytes_of(p).clone() for p in range(8)]
    # Backups of two pages (what DRAM holds at once); each moves older ones.
    for first in range(0, 8, 2):
        batch = keys[first:first + 2]
        assert ctl.backup(batch, pool.token_indices(range(first, first + 2))) == 2
    assert (tmp_path / "a" / "kvcr-g3-r0.bin").exists()
    assert ctl.hit_query(keys) == 8
    pool.clear_pages(range(16, 24))
    assert ctl.prefetch(keys, pool.token_indices(range(16, 24))) == 8
    for p in range(8):
        assert torch.equal(pool.page_bytes_of(16 + p), want[p]), f"page {p} differs"
