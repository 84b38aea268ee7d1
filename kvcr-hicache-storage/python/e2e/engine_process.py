"""One simulated SGLang engine at TP=2, as its own process, for the
``hicache-dynamo`` end-to-end scenario (``hicache_dynamo.py`` starts two).

The engine's two tensor-parallel ranks are threads; each rank has its own host
KV pool (SGLang's ``page_first`` layout, Qwen3-0.6B's geometry sliced by TP: 28
layers, 4 of the 8 KV heads, head_dim 128, bf16, 64-token pages) and its own
``kvcr_hicache.sglang.KvcrStorage``, built through SGLang's own
``StorageBackendFactory`` exactly as the Python face's tests do (their helper
modules are reused from ``../tests``). The ranks agree through in-process
collectives (``ThreadHub``), one for the prefetch thread's calls and one for
the backup thread's, as SGLang gives each its own group.

Protocol: one JSON object per line. After attaching, the process prints a
``ready`` line (its endpoints); then it reads one command per line on stdin
and answers each with one line on stdout (``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``). Logs go to stderr. Commands (``op``):

- ``store``: fill host pages with each rank's deterministic bytes for
  ``keys`` and back them up through ``batch_set_v1`` on both ranks, with
  ``token_ids`` (and an optional ``cache_salt`` / ``lora_name`` /
  ``lora_id``) in the extra info so the DP owner rank publishes them.
- ``fetch``: SGLang's prefetch for ``keys`` on both ranks: ``batch_exists``,
  then ``batch_get_v1`` of the hit pages, with an optional router ``hint``;
  every restored byte is compared with what the source computed.
- ``exists``: ``batch_exists`` on both ranks, no hint.
- ``sync``: ``sync_inventory()`` on both ranks (a collective).
- ``stats``: ``get_stats()`` of both ranks.
- ``close``: ``close()`` on both ranks; the process then exits.

    python engine_process.py --name S --control-port 20000 --kvcr-pages 12 \
        --host-pages 8 --worker-id 1 [--publish] [--tls posix,cma,self]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
# The Python face's test helpers (SGLang's files, the host pool stand-in, the
# thread collectives) import by name from their folder.
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402

import engine  # noqa: E402  (loads SGLang's hicache_storage and backend_factory)
from engine import HiCacheStorageExtraInfo  # noqa: E402
from host_pool import MhaHostPool  # noqa: E402
from test_tensor_parallel import ThreadHub, ThreadRankGroup  # noqa: E402

TP = 2
PAGE_TOKENS = 64
# Qwen3-0.6B: 28 layers, 8 KV heads of 128 dims, bf16; each TP rank holds
# half the heads (SGLang's host pool is per rank, head_num is the rank's).
GEOMETRY = dict(page_size=PAGE_TOKENS, layer_num=28, head_num=8 // TP, head_dim=128,
                dtype=torch.bfloat16)
LAYOUT = "page_first"
# Longest a rank's call may take before the command is reported failed.
CALL_TIMEOUT_S = 120

log = logging.getLogger("engine")


def page_seed(key: str, rank: int) -> int:
    """The seed of the bytes rank ``rank`` computes for the page ``key`` (what
    prefill would write): a function of the page's key, so the same page has
    the same bytes on every engine, and each TP shard its own."""
    return (int(key[:16], 16) ^ (0x9E37_79B9_7F4A_7C15 * (rank + 1))) % (1 << 63)


class Rank:
    """One TP rank: its host pool and its kvcr backend."""

    def __init__(self, rank, args, prefetch_hub, backup_hub):
        self.rank = rank
        self.pool = MhaHostPool(pages=args.host_pages, layout=LAYOUT, **GEOMETRY)
        # A one-page scratch pool where the expected bytes are recomputed.
        self.scratch = MhaHostPool(pages=1, layout=LAYOUT, **GEOMETRY)
        more = dict(
            local_dram_bytes=args.kvcr_pages * self.pool.page_bytes,
            operation_timeout_ms=5000,
            get_timeout_s=10,
        )
        if args.publish:
            more.update(
                publish_inventory=True,
                kv_events_worker_id=args.worker_id,
                worker_type="aggregated",
                inventory_heartbeat_ms=args.heartbeat_ms,
            )
        extra = engine.peer_extra_config(args.control_port, args.tls, **more)
        # SGLang's dynamic loader builds the backend; the controller then
        # registers its host pool and ends the registration burst.
        self.backend = engine.StorageBackendFactory.create_backend(
            "dynamic",
            engine.storage_config(extra, tp_rank=rank, tp_size=TP),
            self.pool,
            rank_group=ThreadRankGroup(prefetch_hub, rank),
            backup_group=ThreadRankGroup(backup_hub, rank),
        )
        self.backend.register_mem_pool_host(self.pool)
        done = getattr(self.backend, "on_host_pools_registered", None)
        if done is not None:
            done()

    def describe(self):
        b = self.backend
        return {
            "rank": self.rank,
            "endpoint": b.endpoint,
            "kv_events_endpoint": b.kv_events_endpoint,
            "kv_events_replay_endpoint": b.kv_events_replay_endpoint,
            "registration_metadata": [list(p) for p in b.registration_metadata],
            "page_bytes": self.pool.page_bytes,
            "spans_per_page": self.spans_per_page(),
        }

    def spans_per_page(self):
        """Spans per page of the backend's own span plan."""
        return self.backend.spans_per_page

    # -- data ----------------------------------------------------------------

    def fill(self, host_page, key):
        self.pool.fill_pages([host_page], seed=page_seed(key, self.rank))

    def expected(self, key):
        self.scratch.fill_pages([0], seed=page_seed(key, self.rank))
        return self.scratch.page_bytes_of(0)

    def store(self, keys, host_pages, prefix_keys, extra_info):
        for page, key in zip(host_pages, keys):
            self.fill(page, key)
        info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys, extra_info=extra_info)
        return list(self.backend.batch_set_v1(keys, self.pool.token_indices(host_pages), info))

    def fetch(self, keys, host_pages, extra_info):
        """SGLang's prefetch of ``keys``: the hit query, then the leading hit
        pages restored into host pages; each restored page's bytes compared
        with what the source computed for this rank's shard."""
        info = HiCacheStorageExtraInfo(prefix_keys=None, extra_info=extra_info)
        before = self.backend.get_stats()
        hits = self.backend.batch_exists(keys, info)
        results = []
        if hits:
            pages = host_pages[:hits]
            self.pool.clear_pages(pages)
            indices = self.pool.token_indices(pages)
            results = list(self.backend.batch_get_v1(keys[:hits], indices, info))
        restored = next((i for i, ok in enumerate(results) if not ok), len(results))
        after = self.backend.get_stats()
        equal = mismatched = 0
        for page, key in zip(host_pages[:restored], keys):
            if torch.equal(self.pool.page_bytes_of(page), self.expected(key)):
                equal += 1
            else:
                mismatched += 1
        host_spans = 0
        if restored:
            # The host pool's own zero-copy spans of the restored pages (K and
            # V per page in the page_first layout), to set beside the plan's.
            ptrs, _ = self.pool.get_page_buffer_meta(
                self.pool.token_indices(host_pages[:restored]))
            host_spans = len(ptrs)
        rid = (extra_info or {}).get("request_id")
        if rid:
            self.backend.discard_request(rid)
        return {
            "rank": self.rank,
            "hits": hits,
            "restored": restored,
            "failed_keys": [k for k, ok in zip(keys, results) if not ok],
            "equal": equal,
            "mismatched": mismatched,
            "spans_per_page": self.spans_per_page(),
            "host_spans": host_spans,
            "bytes": restored * self.pool.page_bytes,
            "stats_delta": delta(before, after),
        }


def delta(before, after):
    """How much each integer counter grew."""
    return {k: v - before.get(k, 0) for k, v in after.items()
            if isinstance(v, int) and not isinstance(v, bool)}


def plain(stats):
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str, type(None)))}


class Engine:
    def __init__(self, args):
        self.args = args
        prefetch_hub, backup_hub = ThreadHub(TP), ThreadHub(TP)
        self.workers = ThreadPoolExecutor(TP)
        self.ranks = self.on_all(lambda r: Rank(r, args, prefetch_hub, backup_hub),
                                 on=list(range(TP)))
        self.next_host_page = 0

    def on_all(self, call, on=None):
        """Runs ``call`` on every rank at once, as an engine's per-rank
        processes would (collectives need every rank in the call)."""
        targets = on if on is not None else self.ranks
        futures = [self.workers.submit(call, t) for t in targets]
        return [f.result(timeout=CALL_TIMEOUT_S) for f in futures]

    def host_pages(self, n):
        """``n`` host pages from a ring over the pool (the same on both ranks:
        the controller allocates once for the whole TP group)."""
        size = self.args.host_pages
        if n > size:
            raise ValueError(f"{n} pages do not fit the {size}-page host pool")
        pages = [(self.next_host_page + i) % size for i in range(n)]
        self.next_host_page = (self.next_host_page + n) % size
        return pages

    # -- commands ------------------------------------------------------------

    def store(self, cmd):
        """Backs up a page sequence in host-pool-sized batches, each with its
        prefix (the keys before it) and its pages' tokens."""
        keys, tokens = cmd["keys"], cmd.get("tokens")
        prefix = list(cmd.get("prefix_keys") or [])
        tags = {k: cmd[k] for k in ("cache_salt", "lora_name", "lora_id") if cmd.get(k) is not None}
        stored = [[] for _ in range(TP)]
        batch = self.args.host_pages
        for start in range(0, len(keys), batch):
            chunk = keys[start:start + batch]
            extra = dict(tags)
            if tokens is not None:
                extra["token_ids"] = tokens[start * PAGE_TOKENS:(start + len(chunk)) * PAGE_TOKENS]
            pages = self.host_pages(len(chunk))
            results = self.on_all(
                lambda r: r.store(chunk, pages, prefix or None, extra or None))
            for rank, res in enumerate(results):
                stored[rank] += res
            prefix += chunk
        return {"stored": stored}

    def fetch(self, cmd):
        keys = cmd["keys"]
        extra = {}
        if cmd.get("hint") is not None:
            extra["kvcr_router_hint"] = cmd["hint"]
        if cmd.get("request_id"):
            extra["request_id"] = cmd["request_id"]
        pages = self.host_pages(len(keys))
        return {"ranks": self.on_all(lambda r: r.fetch(keys, pages, extra or None))}

    def exists(self, cmd):
        return {"hits": self.on_all(lambda r: r.backend.batch_exists(cmd["keys"]))}

    def sync(self, _cmd):
        self.on_all(lambda r: r.backend.sync_inventory())
        return {}

    def stats(self, _cmd):
        return {"ranks": self.on_all(lambda r: plain(r.backend.get_stats()))}

    def close(self, _cmd):
        stats = self.stats(None)
        self.on_all(lambda r: r.backend.close())
        return stats


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--control-port", type=int, required=True,
                   help="rank r serves peers at this port + r")
    p.add_argument("--tls", default="posix,cma,self")
    p.add_argument("--kvcr-pages", type=int, required=True,
                   help="KVCR DRAM per rank, in pages")
    p.add_argument("--host-pages", type=int, default=8)
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--publish", action="store_true",
                   help="the DP owner rank publishes the group's inventory")
    p.add_argument("--heartbeat-ms", type=int, default=1000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")

    out = sys.stdout
    try:
        eng = Engine(args)
    except Exception:
        log.exception("attach failed")
        out.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")
        out.flush()
        return 1
    ready = {"ok": True, "ready": True, "pid": os.getpid(),
             "ranks": [r.describe() for r in eng.ranks]}
    out.write(json.dumps(ready) + "\n")
    out.flush()
    log.info("ready: %s", ready)

    handlers = {"store": eng.store, "fetch": eng.fetch, "exists": eng.exists,
                "sync": eng.sync, "stats": eng.stats, "close": eng.close}
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            answer = {"ok": True, **handlers[op](cmd)}
        except Exception:
            log.exception("%s failed", op)
            answer = {"ok": False, "error": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()
        if op == "close":
            break
    eng.workers.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
