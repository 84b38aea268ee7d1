"""Two tensor-parallel ranks in one process (threads), each with its own kvcr
backend and runner, agreeing through a rank group lent from Python (the shape
an engine builds over its own collective). Ranks must agree on every hit and
page even when one rank's input is bad, and must stay in step afterwards."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import engine
from engine import HiCacheStorageExtraInfo, prompt_keys
from host_pool import MhaHostPool

TP = 2


class ThreadHub:
    """An in-process collective for threads standing in for ranks."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size
        self.result = None

    def exchange(self, rank, values, combine):
        self.slots[rank] = list(values)
        if self.barrier.wait() == 0:
            self.result = combine(self.slots)
        self.barrier.wait()
        result = self.result
        self.barrier.wait()
        return result


class ThreadRankGroup:
    """What kvcr_hicache asks of an engine's collective."""

    def __init__(self, hub, rank):
        self.hub, self.rank, self.size = hub, rank, hub.size

    def all_reduce_min(self, values):
        return self.hub.exchange(self.rank, values, lambda rows: [min(c) for c in zip(*rows)])

    def all_gather(self, values):
        return self.hub.exchange(self.rank, values, lambda rows: [list(r) for r in rows])


def start_ranks():
    # SGLang's prefetch and backup threads each have their own group.
    prefetch_hub, backup_hub = ThreadHub(TP), ThreadHub(TP)
    ranks = []
    for rank in range(TP):
        pool = MhaHostPool(pages=32, **engine.GEOMETRY)
        backend = engine.StorageBackendFactory.create_backend(
            "dynamic",
            engine.storage_config(engine.extra_config(True), tp_rank=rank, tp_size=TP),
            pool,
            rank_group=ThreadRankGroup(prefetch_hub, rank),
            backup_group=ThreadRankGroup(backup_hub, rank),
        )
        backend.register_mem_pool_host(pool)
        pool.fill_pages(range(8), seed=50 + rank)  # each rank holds its own shard
        ranks.append((backend, pool))
    return ranks


def on_all_ranks(ranks, call):
    """Runs call(rank, backend, pool) on every rank at once, as the engine's
    per-rank processes would."""
    with ThreadPoolExecutor(TP) as pool:
        futures = [pool.submit(call, r, b, p) for r, (b, p) in enumerate(ranks)]
        return [f.result(timeout=60) for f in futures]


def test_ranks_agree_and_stay_in_step_when_one_rank_has_bad_input():
    ranks = start_ranks()
    keys = prompt_keys(5, salt=60)
    shards = [[pool.page_bytes_of(p) for p in range(5)] for _, pool in ranks]

    stored = on_all_ranks(ranks, lambda r, b, p: b.batch_set_v1(keys, p.token_indices(range(5))))
    assert stored == [[True] * 5] * TP
    assert on_all_ranks(ranks, lambda r, b, p: b.batch_exists(keys)) == [5, 5]

    # Rank 1 sees a key that is not a digest at position 3: every rank agrees on 3.
    bad_keys = keys[:3] + ["not-a-digest"] + keys[4:]
    hits = on_all_ranks(ranks, lambda r, b, p: b.batch_exists(bad_keys if r else keys))
    assert hits == [3, 3]

    # Rank 1's indices are not whole pages: no rank reports a page restored.
    def get_with_bad_indices(r, b, p):
        indices = torch.arange(1, 1 + 5 * p.page_size) if r else p.token_indices(range(10, 15))
        return b.batch_get_v1(keys, indices)

    assert on_all_ranks(ranks, get_with_bad_indices) == [[False] * 5] * TP

    # Still in step: a normal restore on both ranks, each of its own shard.
    def restore(r, b, p):
        p.clear_pages(range(20, 25))
        return b.batch_get_v1(keys, p.token_indices(range(20, 25)), HiCacheStorageExtraInfo())

    assert on_all_ranks(ranks, restore) == [[True] * 5] * TP
    for (backend, pool), shard in zip(ranks, shards):
        assert all(torch.equal(pool.page_bytes_of(20 + i), shard[i]) for i in range(5))
        stats = backend.get_stats()
        assert stats["faults_collective"] == 0, stats
    assert ranks[1][0].get_stats()["faults_argument"] == 2
    assert ranks[0][0].get_stats()["faults_argument"] == 0
