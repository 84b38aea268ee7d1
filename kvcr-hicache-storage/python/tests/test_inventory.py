"""``publish_inventory`` through SGLang's loader: the DP owner rank of a TP=2
group publishes the group's agreed KVCR pages (only when the backup carried
their tokens), exposes its KV-event endpoints and the registration an engine
forwards, and detaches with ``close()``. The bytes on the wire are checked by
the Rust tests and, against Dynamo's indexer, by ``cargo xtask e2e``."""

from __future__ import annotations

import json

import engine
from engine import HiCacheStorageExtraInfo, free_port, prompt_keys
from host_pool import MhaHostPool
from test_tensor_parallel import TP, ThreadHub, ThreadRankGroup, on_all_ranks


def start_publishing_ranks(port):
    prefetch_hub, backup_hub = ThreadHub(TP), ThreadHub(TP)
    extra = engine.peer_extra_config(
        port, "posix,cma,self", publish_inventory=True, worker_type="prefill"
    )
    ranks = []
    for rank in range(TP):
        pool = MhaHostPool(pages=16, **engine.GEOMETRY)
        backend = engine.StorageBackendFactory.create_backend(
            "dynamic",
            engine.storage_config(extra, tp_rank=rank, tp_size=TP),
            pool,
            rank_group=ThreadRankGroup(prefetch_hub, rank),
            backup_group=ThreadRankGroup(backup_hub, rank),
        )
        backend.register_mem_pool_host(pool)
        pool.fill_pages(range(8), seed=70 + rank)
        ranks.append((backend, pool))
    return ranks


def tokens_of(keys):
    return list(range(len(keys) * engine.GEOMETRY["page_size"]))


def test_the_owner_publishes_and_registers():
    port = free_port()
    ranks = start_publishing_ranks(port)
    owner, other = ranks[0][0], ranks[1][0]

    assert owner.kv_events_endpoint.startswith("tcp://127.0.0.1:")
    assert owner.kv_events_replay_endpoint.startswith("tcp://127.0.0.1:")
    assert owner.kv_events_endpoint != owner.kv_events_replay_endpoint
    assert other.kv_events_endpoint is None and other.registration_metadata == []
    metadata = owner.registration_metadata
    assert [k for k, _ in metadata] == [
        "kv_events_endpoint",
        "kv_events_replay_endpoint",
        "router_hint_source_control_endpoints",
        "router_hint_worker_type",
        "router_hint",
    ]
    values = dict(metadata)
    # The owner's own endpoint, naming its member key.
    endpoints = json.loads(values["router_hint_source_control_endpoints"])
    assert list(endpoints) == ["0"]
    assert endpoints["0"].startswith(f"tcp://127.0.0.1:{port}?key=")
    assert len(endpoints["0"].split("?key=")[1]) == 64
    assert values["router_hint_worker_type"] == "prefill"
    assert values["router_hint"] == "true"

    # Without tokens a backup is stored but not published; with them (and a
    # prefix key as the chain's parent) every agreed page is, once.
    keys = prompt_keys(4, salt=80)
    unpublished = on_all_ranks(ranks, lambda r, b, p: b.batch_set_v1(keys[:2], p.token_indices(range(2))))
    assert unpublished == [[True] * 2] * TP
    assert owner.get_stats()["pages_unpublished"] == 2

    def backup_with_tokens(r, b, p):
        info = HiCacheStorageExtraInfo(
            prefix_keys=keys[:2],
            extra_info={"token_ids": tokens_of(keys[2:]), "cache_salt": "tenant-a"},
        )
        return b.batch_set_v1(keys[2:], p.token_indices(range(2, 4)), info)

    assert on_all_ranks(ranks, backup_with_tokens) == [[True] * 2] * TP
    stats = owner.get_stats()
    assert stats["pages_published"] == 2, stats
    assert "inventory_stored_blocks" in stats and "inventory_stored_blocks" not in other.get_stats()

    on_all_ranks(ranks, lambda r, b, p: b.sync_inventory())
    owner.close()
    other.close()  # no publisher on this rank: a no-op
    assert "inventory_stored_blocks" not in owner.get_stats(), "the publisher stopped"
