"""One reference engine with kvcr as its HiCache backend (mode A), as its own
process: the real-model harness (``real_model.py``) starts a source S and a
destination D per TP size.

The engine runs a real transformer (``reference_model.ReferenceModel``:
Qwen3 with random weights from a fixed seed). Its TP ranks are threads, each
with its own host KV pool (SGLang's ``page_first`` layout, the rank's share of
the KV heads) and its own ``kvcr_hicache.sglang.KvcrStorage`` built through
SGLang's own ``StorageBackendFactory``, agreeing through in-process
collectives, as the ``hicache-dynamo`` engine does (its helpers are reused from
``kvcr-hicache-storage/python/tests``). The model is not split: the engine
computes the whole KV and each rank keeps its head shard, which is what kvcr
sees of a TP engine.

Protocol: one JSON object per line; a ``ready`` line after attaching, then
one answer per command read on stdin (``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``). Commands (``op``):

- ``prefill_store``: prefill ``tokens`` (empty cache; chunked where a
  destination's reusable prefix ends, as its cold reference is), write the KV
  of every full page into the ranks' host pools, back them up through
  ``batch_set_v1`` with the pages' ``token_ids`` (the DP owner rank publishes
  them); answers the pages stored and each page's SHA-256 per rank.
- ``inventory``: how many leading pages of ``keys`` this engine's KVCR holds
  (``batch_exists`` with no hint, every rank agreeing).
- ``serve``: a request of ``tokens`` on a destination: SGLang's prefetch
  (``batch_exists`` with the router ``hint``, then ``batch_get_v1``); cold
  inference (no cache, no kvcr) chunked where the restored prefix ends, and
  the one-shot prefill for comparison; the restored pages read back into the
  model's cache, the suffix prefilled and ``new_tokens`` decoded; the same on
  the engine's own KV (the control, run twice) and on the restored pages
  zeroed and shuffled (the negative controls). Answers ids, digests, logit
  differences, counters and, per compared pair, where the runs part
  (``divergence.compare``: per decode step, logits bit-equal or not).
- ``stats``, ``close``.
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
# The HiCache face's test helpers (SGLang's files, the host pool stand-in,
# the thread collectives); a GPU host's bundle puts them beside this file.
for helpers in (os.path.join(HERE, "hicache-helpers"),
                os.path.join(HERE, "..", "..", "kvcr-hicache-storage", "python", "tests")):
    if os.path.isdir(helpers):
        sys.path.insert(0, helpers)
        break

import torch  # noqa: E402

import engine  # noqa: E402  (loads SGLang's hicache_storage and backend_factory)
import divergence  # noqa: E402
import reference_model as rm  # noqa: E402
from engine import HiCacheStorageExtraInfo, page_keys  # noqa: E402
from host_pool import MhaHostPool  # noqa: E402
from test_tensor_parallel import ThreadHub, ThreadRankGroup  # noqa: E402

CALL_TIMEOUT_S = 300
log = logging.getLogger("model-engine")


class Rank:
    """One TP rank: its host pool (its KV heads) and its kvcr backend."""

    def __init__(self, rank, args, model, prefetch_hub, backup_hub):
        self.rank = rank
        self.heads = rm.head_slice(model.kv_heads, args.tp, rank)
        self.pool = MhaHostPool(pages=args.host_pages, page_size=args.page_tokens,
                                layer_num=model.layers, head_num=model.kv_heads // args.tp,
                                head_dim=model.head_dim, dtype=model.dtype, layout="page_first")
        more = dict(local_dram_bytes=args.kvcr_pages * self.pool.page_bytes,
                    operation_timeout_ms=5000, get_timeout_s=30)
        if args.publish:
            more.update(publish_inventory=True, kv_events_worker_id=args.worker_id,
                        worker_type="aggregated", inventory_heartbeat_ms=1000)
        extra = engine.peer_extra_config(args.control_port, args.tls, **more)
        self.backend = engine.StorageBackendFactory.create_backend(
            "dynamic",
            engine.storage_config(extra, tp_rank=rank, tp_size=args.tp),
            self.pool,
            rank_group=ThreadRankGroup(prefetch_hub, rank),
            backup_group=ThreadRankGroup(backup_hub, rank),
        )
        self.backend.register_mem_pool_host(self.pool)
        self.backend.on_host_pools_registered()

    def describe(self):
        b = self.backend
        return {"rank": self.rank, "endpoint": b.endpoint,
                "kv_events_endpoint": b.kv_events_endpoint,
                "kv_events_replay_endpoint": b.kv_events_replay_endpoint,
                "registration_metadata": [list(p) for p in b.registration_metadata],
                "page_bytes": self.pool.page_bytes}

    def copy_pages(self, src, dst, zero=False):
        """Copies host pages ``src`` to ``dst`` (the negative controls' pages)."""
        for s, d in zip(src, dst):
            view = self.pool._page_bytes_view(d)
            if zero:
                view.zero_()
            else:
                view.copy_(self.pool._page_bytes_view(s))


def reusable_tokens(tokens, page_tokens):
    """The tokens of the full pages a request can reuse: SGLang always
    recomputes the last token."""
    return (len(tokens) - 1) // page_tokens * page_tokens


def delta(before, after):
    return {k: v - before.get(k, 0) for k, v in after.items()
            if isinstance(v, int) and not isinstance(v, bool)}


class Engine:
    def __init__(self, args):
        self.args = args
        self.model = rm.ReferenceModel(args.geometry, args.seed, args.device, args.dtype)
        prefetch_hub, backup_hub = ThreadHub(args.tp), ThreadHub(args.tp)
        self.workers = ThreadPoolExecutor(args.tp)
        self.ranks = self.on_all(lambda r: Rank(r, args, self.model, prefetch_hub, backup_hub),
                                 on=list(range(args.tp)))

    def on_all(self, call, on=None):
        """``call`` on every rank at once (collectives need every rank)."""
        futures = [self.workers.submit(call, t) for t in (on if on is not None else self.ranks)]
        return [f.result(timeout=CALL_TIMEOUT_S) for f in futures]

    def pages_kv(self, host_pages):
        """The model-side KV of ``host_pages``, the ranks' shards joined."""
        return rm.read_pages([r.pool for r in self.ranks], host_pages, self.model.layers,
                             self.args.page_tokens, self.model.device, self.model.dtype)

    def digests(self, host_pages):
        return [rm.page_digests(r.pool, host_pages) for r in self.ranks]

    # -- commands ----------------------------------------------------------------

    def prefill_store(self, cmd):
        tokens, size = cmd["tokens"], self.args.page_tokens
        # Chunked at the prefix a destination reuses (SGLang recomputes the
        # last token), as the destination's cold reference prefills it: the
        # pages' bytes are those of the same computation.
        _, _, cache, _ = self.model.generate_chunked(tokens, reusable_tokens(tokens, size), 0)
        n = len(tokens) // size
        keys_hex = page_keys(tokens, size)[:n]
        k, v = self.model.kv_of(cache, n * size)
        pages = list(range(n))
        info = HiCacheStorageExtraInfo(prefix_keys=None,
                                       extra_info={"token_ids": tokens[:n * size]})

        def store(rank):
            rm.write_pages(rank.pool, pages, k, v, rank.heads, size)
            return list(rank.backend.batch_set_v1(keys_hex, rank.pool.token_indices(pages), info))

        stored = self.on_all(store)
        return {"stored": [sum(map(bool, s)) for s in stored], "digests": self.digests(pages),
                "page_bytes": self.ranks[0].pool.page_bytes}

    def inventory(self, cmd):
        hits = self.on_all(lambda r: r.backend.batch_exists(cmd["keys"]))
        return {"hits": hits}

    def serve(self, cmd):
        tokens, n_new = cmd["tokens"], cmd["new_tokens"]
        size = self.args.page_tokens
        reusable = reusable_tokens(tokens, size) // size
        keys_hex = page_keys(tokens, size)[:reusable]
        model = self.model

        # SGLang's prefetch through kvcr, on the router's hint.
        extra = {"request_id": cmd.get("request_id", "req")}
        if cmd.get("hint") is not None:
            extra["kvcr_router_hint"] = cmd["hint"]
        info = HiCacheStorageExtraInfo(prefix_keys=None, extra_info=extra)
        restore_pages = list(range(reusable))

        def prefetch(rank):
            before = rank.backend.get_stats()
            hits = rank.backend.batch_exists(keys_hex, info)
            results = []
            if hits:
                rank.pool.clear_pages(restore_pages[:hits])
                indices = rank.pool.token_indices(restore_pages[:hits])
                results = list(rank.backend.batch_get_v1(keys_hex[:hits], indices, info))
            restored = next((i for i, ok in enumerate(results) if not ok), len(results))
            rank.backend.discard_request(extra["request_id"])
            return {"hits": hits, "restored": restored,
                    "stats_delta": delta(before, rank.backend.get_stats())}

        fetched = self.on_all(prefetch)
        restored = min(f["restored"] for f in fetched)
        prefix = restored * size
        pages = restore_pages[:restored]

        # Cold inference (the same model, no cache, no kvcr), chunked where
        # the restored prefix ends, as the source prefilled it. The one-shot
        # prefill of every token is reported beside it: its GEMMs have other
        # shapes, so in bf16 it may round differently (kvcr not involved).
        cold_trace = []
        cold_ids, cold_logits, _, own = model.generate_chunked(tokens, prefix, n_new, cold_trace)
        one_shot_ids, one_shot_logits, _ = model.generate(tokens, None, n_new)

        def run(host_pages, trace=None):
            kv = self.pages_kv(host_pages)
            ids, logits, _ = model.generate(tokens[prefix:], model.cache_from(*kv), n_new, trace)
            return ids, logits

        # The control: the same suffix prefilled on the engine's own KV; run
        # twice, which shows whether this device computes one thing twice
        # to the same bits.
        own_pages = list(range(reusable, 2 * reusable))[:restored]
        for rank in self.ranks:
            rm.write_pages(rank.pool, own_pages, *own, rank.heads, size)
        own_digests = self.digests(own_pages)
        control_trace, repeat_trace = [], []
        control_ids, control_logits = run(own_pages, control_trace)
        _, repeat_logits = run(own_pages, repeat_trace)
        diagnostics = {
            "control_repeat": divergence.compare(control_logits, repeat_logits, control_trace,
                                                 repeat_trace),
            "control_vs_cold": divergence.compare(control_logits, cold_logits, control_trace,
                                                  cold_trace),
            "one_shot_vs_cold": divergence.compare(one_shot_logits, cold_logits),
        }

        variants = {}

        def variant(name, host_pages):
            trace = []
            ids, logits = run(host_pages, trace)
            variants[name] = {
                "digests": self.digests(host_pages),
                "ids": ids,
                "logits_equal_control": bool(torch.equal(logits, control_logits)),
                "logits_equal_cold": bool(torch.equal(logits, cold_logits)),
                "logits_max_diff_control": rm.max_abs_diff(logits, control_logits),
                "logits_max_diff_cold": rm.max_abs_diff(logits, cold_logits),
                "vs_control": divergence.compare(logits, control_logits, trace, control_trace),
            }

        variant("restored", pages)
        diagnostics["restored_vs_control"] = variants["restored"]["vs_control"]
        # Negative controls: the restored pages zeroed, and in the wrong
        # order (rotated by one page), in scratch pages.
        scratch = own_pages
        for rank in self.ranks:
            rank.copy_pages(pages, scratch, zero=True)
        variant("zeroed", scratch)
        rotated = pages[1:] + pages[:1]
        for rank in self.ranks:
            rank.copy_pages(rotated, scratch)
        variant("shuffled", scratch if len(pages) > 1 else [])
        return {
            "reusable_pages": reusable,
            "ranks": fetched,
            "restored_pages": restored,
            "restored_tokens": prefix,
            "restored_bytes": restored * sum(r.pool.page_bytes for r in self.ranks),
            "cold_ids": cold_ids,
            "one_shot_ids": one_shot_ids,
            "own_digests": own_digests,
            "control_ids": control_ids,
            "control_repeat_equal": bool(torch.equal(control_logits, repeat_logits)),
            "variants": variants,
            "diagnostics": diagnostics,
            "environment": divergence.environment(model.device),
            "nondeterministic_ops": model.nondeterminism.seen,
        }

    def stats(self, _cmd):
        return {"ranks": [{k: v for k, v in r.backend.get_stats().items()
                           if isinstance(v, (int, float, str, type(None)))}
                          for r in self.ranks]}

    def close(self, _cmd):
        stats = self.stats(None)
        self.on_all(lambda r: r.backend.close())
        return stats


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--control-port", type=int, required=True,
                   help="rank r serves peers at this port + r")
    p.add_argument("--tls", default="posix,cma,self")
    p.add_argument("--kvcr-pages", type=int, default=16, help="KVCR DRAM per rank, in pages")
    p.add_argument("--host-pages", type=int, default=8)
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--geometry", default="small", choices=sorted(rm.GEOMETRIES))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(rm.DTYPES))
    p.add_argument("--publish", action="store_true",
                   help="the DP owner rank publishes the group's inventory")
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
    handlers = {"prefill_store": eng.prefill_store, "inventory": eng.inventory,
                "serve": eng.serve, "stats": eng.stats, "close": eng.close}
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
