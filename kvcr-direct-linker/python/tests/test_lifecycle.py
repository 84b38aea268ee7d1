"""The linker through its Python face, over a real runner: offload and
restore byte exact, the prepared path (begin, request_started, lookup, load),
request-id reuse and cancellation, misses, eviction, capacity and reset, and
pages pulled from a peer linker on a router hint. Each
runs on a host pool (CI) and on CUDA tensors (marked `gpu`: with
KVCR_TEST_GPU=1 on a GPU machine, failing there without a GPU)."""

from __future__ import annotations

import pytest

import kvcr_direct as kd
from pools import DEVICES, NAMESPACE, SLOTS, Pool

def _zero(pool):
    return bytes(len(pool.page(0)))


@pytest.fixture(params=DEVICES)
def pool(request):
    return Pool(request.param)


def _offload(linker, pool, pages):
    """Fills and offloads ``pages`` (``(key, slot)``), then waits for it."""
    for key, slot in pages:
        pool.fill(slot, seed=key)
    outcome = linker.offload(NAMESPACE, pages)
    assert isinstance(outcome, kd.Queued)
    assert linker.settle(30) == [kd.OffloadDone(outcome.ticket, True)]
    return {key: pool.page(slot) for key, slot in pages}


def test_offload_then_restore_is_byte_exact(pool):
    linker = pool.linker()
    sent = _offload(linker, pool, [(101, 0), (102, 1), (103, 2)])
    assert all(linker.stores(NAMESPACE, key) for key in sent)
    context = linker.begin("r", namespace=NAMESPACE, device_prefix_pages=0, tail=[101, 102, 103])
    ticket = linker.restore_hinted(context, [7, 5, 6])
    assert linker.settle(30) == [kd.RestoreDone(context.attempt, ticket, 3, 3)]
    assert [pool.page(s) for s in (7, 5, 6)] == [sent[101], sent[102], sent[103]]
    # Nothing else was written: the slots not named and the guard pages.
    assert pool.page(3) == pool.page(4) == _zero(pool)
    assert pool.guards_intact()
    assert linker.accounting()["transfers_in_flight"] == 0


def test_the_prepared_path_loads_into_engine_slots(pool):
    linker = pool.linker()
    sent = _offload(linker, pool, [(201, 0), (202, 1), (203, 2)])
    context = linker.begin("p", namespace=NAMESPACE, device_prefix_pages=0, tail=[201, 202, 203])
    linker.request_started(context)
    attempt = context.attempt
    assert linker.settle(30) == []
    assert linker.preparation(attempt) == "ready"
    assert linker.accounting()["claims_held"] == 3
    assert linker.lookup(attempt, 0, [201, 202, 203]) == [1, 2, 3]
    ticket = linker.load(attempt, [6, 7])
    assert linker.settle(30) == [kd.LoadDone(attempt, ticket, True)]
    assert [pool.page(6), pool.page(7)] == [sent[201], sent[202]]
    assert linker.preparation(attempt) == "loaded"
    linker.request_finished(attempt)
    assert linker.accounting() == {"claims_held": 0, "transfers_in_flight": 0, "live_attempts": 0}
    assert pool.guards_intact()


def test_request_id_reuse_supersedes_the_old_attempt(pool):
    linker = pool.linker()
    _offload(linker, pool, [(301, 0), (302, 1)])
    first = linker.begin("same", namespace=NAMESPACE, device_prefix_pages=0, tail=[301, 302])
    linker.request_started(first)
    linker.settle(30)
    assert linker.accounting()["claims_held"] == 2
    second = linker.begin("same", namespace=NAMESPACE, device_prefix_pages=0, tail=[301, 302])
    assert second.superseded == first.attempt
    assert second.attempt.generation > first.attempt.generation
    linker.request_started(second)
    linker.settle(30)
    # The old attempt's claims went back; the new one holds its own.
    assert linker.accounting() == {"claims_held": 2, "transfers_in_flight": 0, "live_attempts": 1}
    for stale in (lambda: linker.preparation(first.attempt),
                  lambda: linker.load(first.attempt, [5]),
                  lambda: linker.request_finished(first.attempt)):
        with pytest.raises(kd.ContractError, match="superseded"):
            stale()
    ticket = linker.load(second.attempt, [4, 5])
    assert linker.settle(30) == [kd.LoadDone(second.attempt, ticket, True)]
    linker.request_finished(second.attempt)
    assert linker.accounting() == {"claims_held": 0, "transfers_in_flight": 0, "live_attempts": 0}


def test_a_cancelled_attempt_releases_its_claims_and_the_id_is_reusable(pool):
    linker = pool.linker()
    _offload(linker, pool, [(401, 0)])
    context = linker.begin("c", namespace=NAMESPACE, device_prefix_pages=0, tail=[401])
    linker.request_started(context)
    linker.settle(30)
    assert linker.accounting()["claims_held"] == 1
    linker.request_aborted(context.attempt)
    assert linker.accounting() == {"claims_held": 0, "transfers_in_flight": 0, "live_attempts": 0}
    with pytest.raises(kd.ContractError, match="no live attempt"):
        linker.load(context.attempt, [3])
    again = linker.begin("c", namespace=NAMESPACE, device_prefix_pages=0, tail=[401])
    assert again.superseded is None
    linker.request_started(again)
    linker.settle(30)
    assert linker.preparation(again.attempt) == "ready"
    linker.request_aborted(again.attempt)


def test_a_load_without_a_preparation_is_refused(pool):
    linker = pool.linker()
    context = linker.begin("n", namespace=NAMESPACE, device_prefix_pages=0, tail=[501])
    linker.request_started(context)
    linker.settle(30)
    assert linker.lookup(context.attempt, 0, [501]) == []
    with pytest.raises(kd.ContractError, match="without a held claim"):
        linker.load(context.attempt, [1])
    assert pool.page(1) == _zero(pool)


def test_a_miss_restores_nothing_and_writes_nothing(pool):
    linker = pool.linker()
    context = linker.begin("m", namespace=NAMESPACE, device_prefix_pages=0, tail=[601, 602])
    ticket = linker.restore_hinted(context, [SLOTS - 2, SLOTS - 1])
    assert linker.settle(30) == [kd.RestoreDone(context.attempt, ticket, 0, 2)]
    assert pool.page(SLOTS - 1) == pool.page(SLOTS - 2) == _zero(pool)
    assert pool.guards_intact()


def test_evictions_capacity_and_reset(pool):
    linker = pool.linker(store_pages=2, incarnation=11)
    _offload(linker, pool, [(701, 0), (702, 1)])
    outcome = linker.offload(NAMESPACE, [(703, 2), (704, 3)])
    events = linker.settle(30)
    assert kd.Evicted(11, "KvcrDram", [(NAMESPACE, 701), (NAMESPACE, 702)]) in events
    assert kd.OffloadDone(outcome.ticket, True) in events
    assert linker.offload(NAMESPACE, [(705, 4), (706, 5), (707, 6)]) == kd.Declined(
        "over_capacity"
    )
    linker.reset(12)
    assert linker.incarnation == 12
    assert not linker.stores(NAMESPACE, 703)


def test_fused_per_layer_buffers(pool):
    import torch

    fused = [torch.stack([k, v]) for k, v in zip(pool.k, pool.v)]
    linker = kd.DirectLinker.from_fused(fused, page_tokens=4, store_pages=8, host=pool.host)
    view = Pool.__new__(Pool)
    view.k, view.v = [f[0] for f in fused], [f[1] for f in fused]
    view.fill(0, seed=9)
    sent = view.page(0)
    assert isinstance(linker.offload(NAMESPACE, [(801, 0)]), kd.Queued)
    linker.settle(30)
    context = linker.begin("f", namespace=NAMESPACE, device_prefix_pages=0, tail=[801])
    linker.restore_hinted(context, [3])
    assert [type(e) for e in linker.settle(30)] == [kd.RestoreDone]
    assert view.page(3) == sent
    assert linker.layout["device"] == ("cpu" if pool.host else "cuda:0")


def test_ranks_agree_on_the_common_prefix():
    assert kd.agree_restorable_prefix([[1, 2, 3], [1, 2]], 2) == 2
    assert kd.agree_restorable_prefix([[1, 3], [2]], 2) == 0
    with pytest.raises(kd.ContractError):
        kd.agree_restorable_prefix([[1]], 2)
    with pytest.raises(kd.ArgumentError):
        kd.agree_restorable_prefix([[-1]], 1)


def test_the_ledger_ends_attempts_the_linker_never_saw(pool):
    linker = pool.linker()
    _offload(linker, pool, [(901, 0)])
    context = linker.begin("h", namespace=NAMESPACE, device_prefix_pages=0, tail=[901])
    linker.restore_hinted(context, [4])
    linker.settle(30)
    # restore_hinted takes no preparation: the linker holds nothing for the
    # attempt, so its hook refuses, and the ledger still ends the attempt.
    with pytest.raises(kd.ContractError, match="no live attempt"):
        linker.request_finished(context.attempt)
    assert not linker.end_attempt(context.attempt)
    again = linker.begin("h", namespace=NAMESPACE, device_prefix_pages=0, tail=[901])
    assert again.superseded is None
    assert linker.end_attempt(again.attempt)
    assert linker.begin("h", namespace=NAMESPACE, device_prefix_pages=0, tail=[]).superseded is None


@pytest.mark.parametrize("path", ["restore_hinted", "prepared"])
def test_a_hint_pulls_pages_from_a_peer_linker(pool, path):
    from pools import hint

    source_pool = Pool(pool.device.type)
    source = source_pool.linker(peer=True)
    sent = _offload(source, source_pool, [(1001, 0), (1002, 1), (1003, 2)])
    linker = pool.linker(peer=True)
    keys = [1001, 1002, 1003]
    context = linker.begin(
        "peer", namespace=NAMESPACE, device_prefix_pages=0, tail=keys,
        hints=[hint(source.endpoint, keys)],
    )
    assert context.hint_sources == [source.endpoint]
    if path == "restore_hinted":
        ticket = linker.restore_hinted(context, [5, 6, 7])
        assert linker.settle(30) == [kd.RestoreDone(context.attempt, ticket, 3, 3)]
        linker.end_attempt(context.attempt)
    else:
        linker.request_started(context)
        assert linker.settle(30) == []
        assert linker.lookup(context.attempt, 0, keys) == [1, 2, 3]
        ticket = linker.load(context.attempt, [5, 6, 7])
        assert linker.settle(30) == [kd.LoadDone(context.attempt, ticket, True)]
        linker.request_finished(context.attempt)
    assert [pool.page(s) for s in (5, 6, 7)] == [sent[k] for k in keys]
    assert pool.guards_intact()
    # The pulled pages stay in this rank's KVCR DRAM: both linkers live in
    # this one process, so the one-hop route (a source in another process
    # writing this GPU) is not taken.
    assert all(linker.stores(NAMESPACE, k) for k in keys)
    stats = linker.peer_stats()
    assert stats["keys_received"] == 3
    assert stats["one_hop_pages"] == 0
    assert source.peer_stats()["keys_sent"] == 3
    assert Pool(pool.device.type).linker().peer_stats() is None
