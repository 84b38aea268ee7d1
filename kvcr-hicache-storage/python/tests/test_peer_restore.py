"""Two Python processes, each with its own kvcr runner behind SGLang's storage
contract: the destination restores a prompt's pages from the source's KVCR
DRAM (UCX) because a router hint in ``extra_info`` names the source."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import engine
from engine import Controller, attach, fetch_hint, free_port, prompt_keys
from host_pool import MhaHostPool

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 1000
FULL, PARTIAL = 1, 2  # prompt salts
FULL_PAGES, PARTIAL_PAGES, PARTIAL_STORED = 24, 6, 4


@pytest.fixture(params=["posix,cma,self", "tcp,self"], ids=["shm", "tcp"])
def source(request):
    """The source engine process; yields (endpoint, pages stored per prompt)."""
    tls = request.param
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peer_source.py"), str(free_port()), tls, str(SEED),
         f"{FULL}:{FULL_PAGES}", f"{PARTIAL}:{PARTIAL_PAGES}:{PARTIAL_STORED}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE,
    )
    try:
        line = proc.stdout.readline()
        assert line, f"source exited early with {proc.wait(timeout=30)}"
        report = json.loads(line)
        yield tls, report
    finally:
        if proc.poll() is None:
            proc.stdin.write("quit\n")
            proc.stdin.close()
        assert proc.wait(timeout=60) == 0


def expected_pages(salt, n):
    """The bytes the source filled its host pages with for a prompt."""
    scratch = MhaHostPool(pages=n, **engine.GEOMETRY)
    scratch.fill_pages(range(n), seed=SEED + salt)
    return [scratch.page_bytes_of(p) for p in range(n)]


def test_destination_restores_from_the_source_on_a_router_hint(source):
    tls, report = source
    assert report["stored"] == {str(FULL): FULL_PAGES, str(PARTIAL): PARTIAL_STORED}
    endpoint = report["endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:")

    pool = MhaHostPool(pages=64, **engine.GEOMETRY)
    dest = attach(engine.peer_extra_config(free_port(), tls), pool)
    ctl = Controller(dest, pool, interface_v1=True)
    keys = prompt_keys(FULL_PAGES, FULL)
    hint = {"kvcr_router_hint": fetch_hint(endpoint, keys), "request_id": "req-1"}

    # Nothing local; the hint makes every page available.
    assert ctl.hit_query(keys) == 0
    assert ctl.hit_query(keys, extra_info=hint) == FULL_PAGES
    targets = list(range(10, 10 + FULL_PAGES))
    assert ctl.prefetch(keys, pool.token_indices(targets), extra_info=hint) == FULL_PAGES
    for page, want in zip(targets, expected_pages(FULL, FULL_PAGES)):
        assert torch.equal(pool.page_bytes_of(page), want), f"host page {page} differs"
    stats = dest.get_stats()
    assert stats["hinted_pages_requested"] == FULL_PAGES
    assert stats["hinted_pages_loaded"] == FULL_PAGES

    # The restored pages are now this runner's: no hint needed any more.
    dest.discard_request("req-1")
    assert ctl.hit_query(keys) == FULL_PAGES
    pool.clear_pages(targets)
    assert ctl.prefetch(keys, pool.token_indices(targets)) == FULL_PAGES
    assert torch.equal(pool.page_bytes_of(targets[-1]), expected_pages(FULL, FULL_PAGES)[-1])


def test_partial_source_gives_the_leading_run(source):
    tls, report = source
    pool = MhaHostPool(pages=32, **engine.GEOMETRY)
    dest = attach(engine.peer_extra_config(free_port(), tls), pool)
    keys = prompt_keys(PARTIAL_PAGES, PARTIAL)
    hint = {"kvcr_router_hint": fetch_hint(report["endpoint"], keys), "request_id": "req-2"}
    # Exists is optimistic for hinted pages; get reports what really arrived.
    assert dest.batch_exists(keys, engine.HiCacheStorageExtraInfo(extra_info=hint)) == PARTIAL_PAGES
    results = dest.batch_get_v1(
        keys, pool.token_indices(range(PARTIAL_PAGES)), engine.HiCacheStorageExtraInfo(extra_info=hint)
    )
    assert results == [True] * PARTIAL_STORED + [False] * (PARTIAL_PAGES - PARTIAL_STORED)
    want = expected_pages(PARTIAL, PARTIAL_STORED)
    for p in range(PARTIAL_STORED):
        assert torch.equal(pool.page_bytes_of(p), want[p])
    assert dest.get_stats()["hinted_pages_loaded"] == PARTIAL_STORED
