"""Under a real model, mode B: a reference engine whose paged KV pool (per-layer
K and V torch tensors) is linked to KVCR DRAM through ``kvcr_direct``, against
the same engine without kvcr (the control).

The engine (``PagedEngine``) keeps a device prefix cache of whole pages (page
key -> slot, least recently used evicted when slots run out). Serving a
request: the device-resident prefix first; the rest of the reusable pages
restored through the linker (``begin`` + ``restore_hinted`` into slots the
engine allocated, from KVCR DRAM or, on a hint, a peer's); the suffix
prefilled and ``--new-tokens`` decoded greedily; the prompt's new full pages
written to slots and offloaded (write-through, after a stream sync).

The workload: prompts A and B of ``--prompt-tokens`` tokens, then filler
prompts until the device pool has evicted A and B, then A and B again. Checks:

- the fillers evicted A and B from the device (no device prefix on replay);
- the replays restore every reusable page from KVCR DRAM (the no-kvcr
  engine restores nothing and recomputes, its ids those of cold inference,
  which vary);
- every restored page's SHA-256 equals the engine's own KV's; the replay's
  first logits equal, bit for bit, an own-KV control's (the same suffix
  prefilled on the engine's own KV), and its ids the control's;
- a peer process (its own model, pool and linker) restores A's pages from
  this engine's KVCR DRAM on a ``kv.fetch`` hint naming its endpoint: every
  page, byte-equal, ids equal the own-KV control's;
- the own-KV control run twice gives the same logits (the device repeats a
  computation bit for bit: without it no bit-exact check means anything).

Each pair that should compute the same bits (restored vs own-KV control,
the no-kvcr engine vs cold inference, the control vs itself) prints a
``DIAG`` line: per decode step whether the logits are bit-equal and, at the
first that is not, the difference, the top-1/top-2 margins and the first
forward and layer whose appended KV differ.

The restored path prefills the prompt in two chunks (the restored prefix,
then the suffix), as the own-KV control does; cold inference prefills it at
once. In float32 on the CPU the two agree; in bf16 on a GPU they may round
differently (kvcr not involved), so how many ids the replay shares with cold
inference is printed, not checked.

``kvcr_direct`` pools are CUDA tensors (``--device cuda``, the GPU host,
Qwen3-0.6B's geometry in bf16); ``--device cpu`` runs the same on a host pool
(``host=True``) with the small geometry, as a check of the harness itself.
Output: ``CHECK``/``NUMBER`` lines and a table; exits 1 if a check failed.

    python real_model_direct.py --geometry qwen3-0.6b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections import OrderedDict

import torch

import divergence
import reference_model as rm

NAMESPACE = 1


def say(text):
    print(f"# {text}", flush=True)


class Checks:
    def __init__(self):
        self.results = []

    def check(self, what, ok, detail=""):
        ok = bool(ok)
        self.results.append((what, ok, detail))
        print(f"CHECK {'PASS' if ok else 'FAIL'} {what} ({detail})", flush=True)
        return ok

    def equal(self, what, got, want):
        return self.check(what, got == want, f"got {got!r}, want {want!r}")


def number(name, value):
    print(f"NUMBER {name}={value}", flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fetch_hint(endpoint, keys):
    """A router's ``kv.fetch@1.0`` envelope naming ``endpoint`` for ``keys``."""
    return json.dumps({
        "protocol_version": "0.1",
        "message_id": "m-1",
        "actions": [{"action_id": "a-1", "action_type": "kv.fetch", "action_version": "1.0",
                     "payload": {"source_control_endpoint": endpoint,
                                 "block_hashes": list(keys), "mode": "copy"}}],
    })


class PagedEngine:
    """An engine's paged KV pool and device prefix cache, with or without a
    ``kvcr_direct`` linker."""

    def __init__(self, model, args, kvcr, peer=False):
        self.model, self.size = model, args.page_tokens
        self.device = model.device
        tokens = args.device_pages * self.size
        shape = (tokens, model.kv_heads, model.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=self.device)
                  for _ in range(model.layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.resident = OrderedDict()  # page key -> slot, least recently used first
        self.free = list(range(args.device_pages))
        self.linker = None
        if kvcr:
            import kvcr_direct

            self.linker = kvcr_direct.DirectLinker(
                self.k, self.v, page_tokens=self.size, store_pages=args.store_pages,
                peer=peer, host=self.device.type == "cpu")
        self.requests = 0

    def alloc(self, n, keep):
        """``n`` free slots, evicting the least recently used pages not in
        ``keep`` (their bytes are in KVCR DRAM already: write-through)."""
        while len(self.free) < n:
            victim = next((k for k, s in self.resident.items() if s not in keep), None)
            if victim is None:
                raise RuntimeError(f"{n} slots do not fit the device pool")
            self.free.append(self.resident.pop(victim))
        slots, self.free = self.free[:n], self.free[n:]
        return slots

    def slot_kv(self, slots):
        """Per-layer [1, heads, tokens, dim] keys and values of ``slots``."""
        index = torch.cat([torch.arange(s * self.size, (s + 1) * self.size) for s in slots])
        index = index.to(self.device)
        keys = [t[index].permute(1, 0, 2).unsqueeze(0) for t in self.k]
        values = [t[index].permute(1, 0, 2).unsqueeze(0) for t in self.v]
        return keys, values

    def slot_digests(self, slots):
        return [page_digest(*self.slot_kv([s])) for s in slots]

    def serve(self, tokens, new_tokens, hints=(), trace=None):
        """One request; returns what happened (ids, logits, prefix sources).
        ``trace`` (a list) gets the digests of the KV each forward appended."""
        self.requests += 1
        size = self.size
        keys = rm.page_hashes(tokens, size)
        reusable = (len(tokens) - 1) // size  # the last token is always computed
        device_pages = 0
        while device_pages < reusable and keys[device_pages] in self.resident:
            device_pages += 1
        keep = {self.resident[k] for k in keys[:device_pages]}
        for k in keys[:device_pages]:
            self.resident.move_to_end(k)
        restored, restore_s = 0, 0.0
        if self.linker is not None and device_pages < reusable:
            tail = keys[device_pages:reusable]
            ctx = self.linker.begin(f"req-{self.requests}", namespace=NAMESPACE,
                                    device_prefix_pages=device_pages, tail=tail,
                                    hints=list(hints))
            slots = self.alloc(len(tail), keep)
            start = time.monotonic()
            ticket = self.linker.restore_hinted(ctx, slots)
            events = self.linker.settle(120.0)
            restore_s = time.monotonic() - start
            done = [e for e in events if getattr(e, "ticket", None) == ticket
                    and type(e).__name__ == "RestoreDone"]
            if len(done) != 1:
                raise RuntimeError(f"no RestoreDone for ticket {ticket}: {events}")
            restored = done[0].restored
            self.linker.end_attempt(ctx.attempt)
            for k, s in zip(tail[:restored], slots[:restored]):
                self.resident[k] = s
                keep.add(s)
            self.free += slots[restored:]
        prefix_pages = device_pages + restored
        prefix_slots = [self.resident[k] for k in keys[:prefix_pages]]
        cache = (self.model.cache_from(*self.slot_kv(prefix_slots)) if prefix_pages else None)
        ids, logits, cache = self.model.generate(tokens[prefix_pages * size:], cache, new_tokens,
                                                 trace)
        # The prompt's new full pages into slots, then offloaded.
        new_keys = keys[prefix_pages:len(tokens) // size]
        slots = self.alloc(len(new_keys), keep)
        kv = self.model.kv_of(cache, len(keys) * size)
        for i, (k, s) in enumerate(zip(new_keys, slots)):
            page = prefix_pages + i
            src = slice(page * size, (page + 1) * size)
            dst = slice(s * size, (s + 1) * size)
            for layer in range(self.model.layers):
                self.k[layer][dst] = kv[0][layer][0, :, src].permute(1, 0, 2)
                self.v[layer][dst] = kv[1][layer][0, :, src].permute(1, 0, 2)
            self.resident[k] = s
        offloaded = 0
        if self.linker is not None and new_keys:
            sync(self.device)  # the linker copies on its own stream
            outcome = self.linker.offload(NAMESPACE, list(zip(new_keys, slots)))
            if type(outcome).__name__ == "Queued":
                events = self.linker.settle(120.0)
                offloaded = sum(len(new_keys) for e in events
                                if type(e).__name__ == "OffloadDone" and e.success)
        return {"ids": ids, "logits": logits, "device_pages": device_pages,
                "restored_pages": restored, "restored_tokens": restored * size,
                "reusable_pages": reusable, "offloaded": offloaded,
                "restored_slots": [self.resident[k] for k in
                                   keys[device_pages:device_pages + restored]],
                "restore_s": restore_s}


def page_digest(keys, values):
    """SHA-256 of one page's K and V, layer by layer, as [tokens, heads, dim]."""
    h = hashlib.sha256()
    for k, v in zip(keys, values):
        for t in (k, v):
            h.update(t[0].permute(1, 0, 2).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def own_reference(model, tokens, prefix_tokens, size, new_tokens):
    """Cold inference, the own KV's page digests and the own-KV control's
    logits (the suffix prefilled on the engine's own KV), the control run
    twice; each run's trace (``divergence.record_forward``)."""
    cold_trace, control_trace, repeat_trace = [], [], []
    cold_ids, cold_logits, cache = model.generate(tokens, None, new_tokens, cold_trace)
    keys, values = model.kv_of(cache, prefix_tokens)
    digests = []
    for p in range(prefix_tokens // size):
        part = slice(p * size, (p + 1) * size)
        digests.append(page_digest([k[:, :, part] for k in keys], [v[:, :, part] for v in values]))
    del cache
    control_ids, control_logits, _ = model.generate(tokens[prefix_tokens:],
                                                    model.cache_from(keys, values), new_tokens,
                                                    control_trace)
    _, repeat_logits, _ = model.generate(tokens[prefix_tokens:], model.cache_from(keys, values),
                                         new_tokens, repeat_trace)
    return {"cold_ids": cold_ids, "cold_logits": cold_logits, "digests": digests,
            "control_ids": control_ids, "control_logits": control_logits,
            "cold_trace": cold_trace, "control_trace": control_trace,
            "repeat": divergence.compare(control_logits, repeat_logits, control_trace,
                                         repeat_trace)}


def diag(case, what, d):
    """A ``DIAG`` line: where two runs that should compute the same bits part."""
    print(f"DIAG {case} {what}: {divergence.describe(d)}", flush=True)


def build_model(args):
    return rm.ReferenceModel(args.geometry, args.seed, args.device, args.dtype)


def peer_main(args):
    """The peer destination process: its own model, pool and linker; one
    request on a hint, answered as one JSON line."""
    model = build_model(args)
    engine = PagedEngine(model, args, kvcr=True, peer=True)
    print(json.dumps({"ready": True, "endpoint": engine.linker.endpoint}), flush=True)
    cmd = json.loads(sys.stdin.readline())
    tokens = cmd["tokens"]
    trace = []
    r = engine.serve(tokens, args.new_tokens, hints=[cmd["hint"]], trace=trace)
    ref = own_reference(model, tokens, r["restored_tokens"] + r["device_pages"] * args.page_tokens,
                        args.page_tokens, args.new_tokens)
    answer = {"ids": r["ids"], "restored_pages": r["restored_pages"],
              "device_pages": r["device_pages"],
              "digests": engine.slot_digests(r["restored_slots"]),
              "ids_equal_control": r["ids"] == ref["control_ids"],
              "ids_agreeing_with_cold": sum(a == b for a, b in zip(r["ids"], ref["cold_ids"])),
              "logits_equal_control": bool(torch.equal(r["logits"][:1],
                                                       ref["control_logits"][:1])),
              "logits_max_diff_control": rm.max_abs_diff(r["logits"][:1],
                                                         ref["control_logits"][:1]),
              "vs_control": divergence.compare(r["logits"], ref["control_logits"], trace,
                                               ref["control_trace"]),
              "repeat": ref["repeat"],
              "nondeterministic_ops": model.nondeterminism.seen,
              "stores": [engine.linker.stores(NAMESPACE, k) for k in
                         rm.page_hashes(tokens, args.page_tokens)[:r["restored_pages"]]],
              "one_hop_pages": (engine.linker.peer_stats() or {}).get("one_hop_pages", 0)}
    print(json.dumps(answer), flush=True)
    engine.linker.close()
    return 0


def run(args, checks, rows):
    vocab = rm.GEOMETRIES[args.geometry]["vocab_size"]
    size = args.page_tokens
    # The peer destination starts first: its imports and model overlap ours.
    peer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "peer"]
                            + args.passthrough, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        model = build_model(args)
        engine = PagedEngine(model, args, kvcr=True, peer=True)
        control = PagedEngine(model, args, kvcr=False)
        prompt_pages = args.prompt_tokens // size
        fillers = -(-args.device_pages // prompt_pages) + 1
        a = rm.prompt(args.seed * 1000 + 1, args.prompt_tokens, vocab)
        b = rm.prompt(args.seed * 1000 + 2, args.prompt_tokens, vocab)
        workload = [("A", a), ("B", b)]
        workload += [(f"filler-{i}", rm.prompt(args.seed * 1000 + 10 + i, args.prompt_tokens,
                                               vocab)) for i in range(fillers)]
        workload += [("A again", a), ("B again", b)]
        say(f"{len(workload)} requests of {args.prompt_tokens} tokens; device pool "
            f"{args.device_pages} pages of {size} tokens, KVCR DRAM {args.store_pages} pages")
        served, traces = {}, {}
        for name, tokens in workload:
            # The replays' runs keep traces for the diagnostics.
            pair = ([], []) if name.endswith(" again") else (None, None)
            traces[name] = pair
            served[name] = (engine.serve(tokens, args.new_tokens, trace=pair[0]),
                            control.serve(tokens, args.new_tokens, trace=pair[1]))
        for name, tokens in (("A", a), ("B", b)):
            first_k, first_c = served[name]
            k, c = served[f"{name} again"]
            reusable = k["reusable_pages"]
            prefix_tokens = (k["device_pages"] + k["restored_pages"]) * size
            ref = own_reference(model, tokens, prefix_tokens, size, args.new_tokens)
            cold = ref["cold_ids"]
            case = f"replay {name}"
            checks.check(f"{case}: the cold ids vary", len(set(cold)) > 1, f"{cold}")
            checks.equal(f"{case}: the fillers evicted it from the device (kvcr, control)",
                         (k["device_pages"], c["device_pages"]), (0, 0))
            checks.equal(f"{case}: restored tokens, kvcr vs the no-kvcr control",
                         (k["restored_tokens"], c["restored_tokens"]), (reusable * size, 0))
            checks.equal(f"{case}: the no-kvcr engine's ids equal cold inference's", c["ids"], cold)
            checks.equal(f"{case}: ids equal the own-KV control's", k["ids"], ref["control_ids"])
            checks.check(f"{case}: the own-KV control run twice gives the same logits, bit for "
                         "bit (this device repeats a computation)", ref["repeat"]["first"] is None,
                         ref["repeat"]["steps"])
            k_trace, c_trace = traces[f"{name} again"]
            diag(case, "own-KV control vs the same run again", ref["repeat"])
            diag(case, "no-kvcr engine vs cold inference (the same one-shot call)",
                 divergence.compare(c["logits"], ref["cold_logits"], c_trace, ref["cold_trace"]))
            diag(case, "restored vs own-KV control",
                 divergence.compare(k["logits"], ref["control_logits"], k_trace,
                                    ref["control_trace"]))
            number(f"{name}_ids_agreeing_with_cold",
                   f"{sum(x == y for x, y in zip(k['ids'], cold))}/{len(cold)}")
            number(f"{name}_ids_agreeing_with_first_serving",
                   f"{sum(x == y for x, y in zip(k['ids'], first_k['ids']))}/{len(cold)}")
            digests = engine.slot_digests(k["restored_slots"])
            checks.check(f"{case}: every restored page's SHA-256 equals the engine's own KV's",
                         digests == ref["digests"], f"{len(digests)} pages")
            same = bool(torch.equal(k["logits"][:1], ref["control_logits"][:1]))
            diff = rm.max_abs_diff(k["logits"][:1], ref["control_logits"][:1])
            checks.check(f"{case}: first logits equal the own-KV control's, bit for bit", same,
                         f"max diff {diff:g}")
            number(f"{name}_restored_tokens", f"{k['restored_tokens']}/{args.prompt_tokens}")
            rows.append([case, "local KVCR DRAM",
                         f"{k['restored_tokens']} / {c['restored_tokens']}",
                         digests == ref["digests"], k["ids"] == ref["control_ids"], f"{diff:g}"])

        # A peer process restores A from this engine's KVCR DRAM on a hint.
        ready = json.loads(peer.stdout.readline())
        keys = rm.page_hashes(a, size)[:(len(a) - 1) // size]
        peer.stdin.write(json.dumps({"tokens": a,
                                     "hint": fetch_hint(engine.linker.endpoint, keys)}) + "\n")
        peer.stdin.flush()
        line = peer.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer process exited ({peer.wait()})")
        p = json.loads(line)
        ref = own_reference(model, a, len(keys) * size, size, args.new_tokens)
        checks.equal("peer: restores every reusable page of A on the hint",
                     (p["device_pages"], p["restored_pages"]), (0, len(keys)))
        checks.check("peer: every page's SHA-256 equals the source engine's own KV's",
                     p["digests"] == ref["digests"], f"{len(p['digests'])} pages")
        checks.check("peer: ids equal its own-KV control's", p["ids_equal_control"],
                     f"{p['ids']}")
        number("peer_ids_agreeing_with_cold", f"{p['ids_agreeing_with_cold']}/{len(p['ids'])}")
        checks.check("peer: first logits equal its own-KV control's, bit for bit",
                     p["logits_equal_control"], f"max diff {p['logits_max_diff_control']:g}")
        checks.check("peer: its own-KV control run twice gives the same logits, bit for bit",
                     p["repeat"]["first"] is None, p["repeat"]["steps"])
        diag("peer", "own-KV control vs the same run again", p["repeat"])
        diag("peer", "restored vs own-KV control", p["vs_control"])
        print(f"DIAG environment: {json.dumps(divergence.environment(model.device))}", flush=True)
        for who, ops in (("this process", model.nondeterminism.seen),
                         ("the peer", p["nondeterministic_ops"])):
            print(f"DIAG ops torch ran without a deterministic implementation ({who}): "
                  f"{json.dumps(ops) if ops else 'none'}", flush=True)
        # Pages pulled through this rank's KVCR DRAM stay there; pages a
        # same-host source wrote straight into the GPU (one hop: a CUDA
        # copier on both sides) never pass through it, by design.
        one_hop = p["one_hop_pages"]
        number("peer_one_hop_pages", f"{one_hop}/{len(p['stores'])}")
        checks.equal(f"peer: the pages pulled through KVCR DRAM stay there, none of the "
                     f"{one_hop} that came in one hop", sum(p["stores"]),
                     len(p["stores"]) - one_hop)
        number("peer_restored_tokens", f"{p['restored_pages'] * size}/{args.prompt_tokens}")
        rows.append(["peer A", ready["endpoint"].split("?")[0],
                     f"{p['restored_pages'] * size} / -", p["digests"] == ref["digests"],
                     p["ids_equal_control"], f"{p['logits_max_diff_control']:g}"])
        engine.linker.close()
    finally:
        if peer.poll() is None:
            peer.stdin.close()
            try:
                peer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait()


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["main", "peer"], default="main")
    p.add_argument("--geometry", default="qwen3-0.6b", choices=sorted(rm.GEOMETRIES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(rm.DTYPES))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--device-pages", type=int, default=400,
                   help="the engine's device pool, in pages (small, so fillers evict)")
    p.add_argument("--store-pages", type=int, default=2048, help="KVCR DRAM, in pages")
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args(argv)
    # The peer process gets the same arguments, less the role.
    args.passthrough = [a for i, a in enumerate(argv) if not a.startswith("--role")
                        and not (i and argv[i - 1] == "--role")]
    if args.role == "peer":
        return peer_main(args)
    checks, rows = Checks(), []
    error = None
    try:
        run(args, checks, rows)
    except Exception as e:  # noqa: BLE001  (could not finish: report)
        error = e
        traceback.print_exc()
        checks.check("every case runs to the end", False, f"{type(e).__name__}: {e}")
    print()
    print(f"| case | restored from | restored tokens (kvcr / control) | digests equal "
          f"| {args.new_tokens} ids equal the control | first logits max diff vs control |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    failed = [r for r in checks.results if not r[1]]
    print(f"\nreal-model mode B ({args.geometry}, {args.device}, {args.dtype}): "
          f"{len(checks.results) - len(failed)} of {len(checks.results)} checks passed")
    if error is not None:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
