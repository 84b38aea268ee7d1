#!/usr/bin/env python3
"""Checks kvcr's encoded KVEventBatch payloads against vLLM 0.33's own classes.

  python vllm_bytes_check.py FILE      (FILE: one hex payload per line)

For every payload:
  1. strict typed decode with msgspec.msgpack.Decoder(vllm KVEventBatch): any
     type or shape vLLM would refuse fails here;
  2. byte-exact re-encode: decoded with vLLM's classes (plus kvcr's one
     extension, an `ownership` key on AllBlocksCleared, declared on vLLM's own
     KVCacheEvent base) and encoded again by msgspec, the bytes must equal
     kvcr's: same key order, map/array headers and integer widths. kvcr's
     other extension, SGLang's `cache_salt` on a salted tenant's
     BlockStored, is declared on a subclass of vLLM's own BlockStored (its
     fields come after vLLM's, as kvcr writes them).
Needs VLLM_KV_EVENTS_PY (vllm/distributed/kv_events.py from the vllm wheel).
"""
import os, sys

import msgspec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_kv_events_shim  # noqa: E402

kv = vllm_kv_events_shim.load()


class AllBlocksClearedOwned(kv.KVCacheEvent, tag="AllBlocksCleared"):
    ownership: str | None = None


class BlockStoredSalted(kv.BlockStored, tag="BlockStored"):
    cache_salt: str | None = None


class KVEventBatchOwned(kv.EventBatch):
    events: list[BlockStoredSalted | kv.BlockRemoved | AllBlocksClearedOwned]


strict = msgspec.msgpack.Decoder(kv.KVEventBatch)
owned = msgspec.msgpack.Decoder(KVEventBatchOwned)
enc = msgspec.msgpack.Encoder()

n = 0
for line in open(sys.argv[1]).read().split():
    ours = bytes.fromhex(line)
    batch = strict.decode(ours)
    for e in batch.events:
        if isinstance(e, (kv.BlockStored, kv.BlockRemoved)):
            assert all(isinstance(h, int) for h in e.block_hashes), e
    again = enc.encode(owned.decode(ours))
    if again != ours:
        print(f"batch {n}: bytes differ\n ours  {ours.hex()}\n vllm  {again.hex()}")
        sys.exit(1)
    print(f"ok batch {n}: {[type(e).__name__ for e in batch.events]} dp={batch.data_parallel_rank}")
    n += 1
print(f"{n} batches decoded and byte-identical")
