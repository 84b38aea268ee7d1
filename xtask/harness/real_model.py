"""End-to-end under a real model, mode A: two reference engines running
``transformers``' Qwen3 (random weights from a fixed seed) with kvcr as their
HiCache L3 backend, per TP size.

Per TP size: engine S prefills a 256-token prompt and backs its 4 pages up
through kvcr (each TP rank its own runner, its own head shard); the router
finds S through Dynamo's standalone indexer (``/query`` on S's published
inventory; ``--hint-from inventory`` instead builds the hint from S's own
``batch_exists`` answer and registration metadata, where no indexer exists,
e.g. on the GPU host); engine D restores 192 of the 256 tokens (3 pages: SGLang
recomputes the last token) from S's KVCR DRAM on that hint, prefills the rest
and decodes 8 tokens greedily. Checks, per TP size:

- the cold ids (the same model, no cache) vary (a model that repeats one
  token would prove little);
- D restores 192 tokens on every rank, every page from the peer;
- every restored page's SHA-256 equals S's (per rank shard) and D's own KV's;
- D's ids equal the cold ids; D's logits equal, bit for bit, those of a
  control that prefills the same suffix on the engine's own KV and those of
  cold inference. Cold inference (no cache, no kvcr) prefills the prompt in
  two chunks split where the restored prefix ends, as a chunked-prefill
  engine does and as S computed the pages it backed up: the same GEMM shapes
  and cache layout as the restored run, so the same bits. A one-shot prefill
  of all 256 tokens has other GEMM shapes and in bf16 may round differently;
  its agreement is reported, not checked;
- the control run twice gives the same logits (the device repeats a
  computation bit for bit: without it no bit-exact check means anything);
- negative controls: the restored pages zeroed, or rotated by one page, FAIL
  the same check (digests differ and the logits are not the control's). A
  rotation leaves the ids unchanged with this model (attention is
  order-blind once RoPE is in the keys): the reason ids alone are a weak check.

Per compared pair a ``DIAG`` line says which decode steps' logits are
bit-equal and, at the first step that is not, the largest difference, each
run's top-1/top-2 margin (a near tie?) and the first forward and layer whose
appended KV differ; then the kernel-choosing versions and switches, and the
ops torch ran without a deterministic implementation.

Each check prints ``CHECK PASS|FAIL <case>: <what> (<detail>)``, key numbers
``NUMBER <name>=<value>`` (the ``hicache-dynamo`` scenario's format). Exits 1
if a check failed, 2 if the scenario could not run.

    python real_model.py --log-dir target/e2e/real-model \
        --indexer-python target/realclients/venv/bin/python
    python real_model.py --log-dir /tmp/real-model --hint-from inventory \
        --geometry qwen3-0.6b --device cuda --dtype bfloat16      # the GPU host
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
for helpers in (os.path.join(HERE, "hicache-helpers"),
                os.path.join(HERE, "..", "..", "kvcr-hicache-storage", "python", "tests")):
    if os.path.isdir(helpers):
        sys.path.insert(0, helpers)
        break

from engine import fetch_hint, page_keys  # noqa: E402

import divergence  # noqa: E402
import reference_model as rm  # noqa: E402

PAGE_TOKENS = 64
PROMPT_TOKENS = 256
NEW_TOKENS = 8
ENGINE_START_S = 300
CALL_S = 600
PUBLISH_S = 30


class Checks:
    def __init__(self):
        self.results = []

    def check(self, case, what, ok, detail=""):
        ok = bool(ok)
        self.results.append((case, what, ok, detail))
        print(f"CHECK {'PASS' if ok else 'FAIL'} {case}: {what} ({detail})", flush=True)
        return ok

    def equal(self, case, what, got, want):
        return self.check(case, what, got == want, f"got {got!r}, want {want!r}")

    def failed(self):
        return [r for r in self.results if not r[2]]


def number(name, value):
    print(f"NUMBER {name}={value}", flush=True)


def say(text):
    print(f"# {text}", flush=True)


def free_port(n=1):
    """A free loopback TCP port with ``n - 1`` free ports after it (a rank
    serves peers at the engine's port + its rank)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        held = []
        try:
            for i in range(n):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class ModelEngine:
    """A ``model_engine.py`` process and its JSON-lines channel."""

    def __init__(self, name, worker, tp, args, publish):
        self.name, self.worker, self.tp = name, worker, tp
        self.log_path = os.path.join(args.log_dir, f"engine-{name}.log")
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, os.path.join(HERE, "model_engine.py"), "--name", name,
               "--worker-id", str(worker), "--tp", str(tp),
               "--control-port", str(free_port(n=tp)), "--tls", args.tls,
               "--geometry", args.geometry, "--seed", str(args.seed),
               "--device", args.device, "--dtype", args.dtype,
               "--page-tokens", str(PAGE_TOKENS)] + (["--publish"] if publish else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=HERE)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = None

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _answer(self, timeout, what):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {self.name}: no answer to {what} in {timeout} s") from None
        if line is None:
            raise RuntimeError(f"engine {self.name} exited ({self.proc.wait()}) during {what}; "
                               f"see {self.log_path}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"engine {self.name}: {what} failed:\n{answer.get('error')}")
        return answer

    def wait_ready(self):
        ready = self._answer(ENGINE_START_S, "attach")
        owner = ready["ranks"][0]
        self.endpoint = owner["endpoint"]
        self.kv_events_endpoint = owner["kv_events_endpoint"]
        self.kv_events_replay_endpoint = owner["kv_events_replay_endpoint"]
        self.metadata = dict(owner["registration_metadata"])
        say(f"engine {self.name} (pid {ready['pid']}, TP={self.tp}): control {self.endpoint}")

    def call(self, op, **fields):
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._answer(CALL_S, op)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.call("close")
            except Exception as e:  # noqa: BLE001  (closing: report, go on)
                print(f"close {self.name}: {e}", file=sys.stderr)
            finally:
                self.proc.stdin.close()
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.log.close()


def source_endpoint(source):
    """S's DP-0 control endpoint, as its registration metadata advertises it."""
    sources = json.loads(source.metadata.get("router_hint_source_control_endpoints", "{}"))
    return sources.get("0", source.endpoint)


def hint_from_indexer(indexer, tokens, source, destination, reusable):
    """The router: ``/query`` on the indexer, the best worker other than the
    destination, a hint for the pages the destination can reuse."""
    from hicache_dynamo import route

    want = PROMPT_TOKENS
    deadline = time.monotonic() + PUBLISH_S
    while indexer.matched(source.worker, tokens) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    best, instances = route(indexer, tokens, destination.worker)
    if best is None or best[0] != source.worker:
        return None, f"/query names no source: {instances}"
    keys = page_keys(tokens, PAGE_TOKENS)[:min(best[1], reusable)]
    return fetch_hint(source_endpoint(source), keys), f"indexer: worker {best[0]}, {best[1]} pages"


def hint_from_inventory(tokens, source, reusable):
    """Where no indexer runs: the hint from S's own inventory (its KVCR's
    leading hits, every rank agreeing) and its registration metadata."""
    keys = page_keys(tokens, PAGE_TOKENS)[:reusable]
    hits = min(source.call("inventory", keys=keys)["hits"])
    if not hits:
        return None, "S holds none of the pages"
    return fetch_hint(source_endpoint(source), keys[:hits]), f"S's inventory: {hits} pages"


# The compared pairs' diagnostics, in the order they localise a divergence:
# the device against itself first, kvcr last.
DIAGNOSED = [
    ("control_repeat", "own-KV control vs the same run again"),
    ("control_vs_cold", "own-KV control vs cold inference (chunked)"),
    ("restored_vs_control", "restored vs own-KV control"),
    ("one_shot_vs_cold", "one-shot cold prefill vs chunked (other GEMM shapes; not checked)"),
]


def report_diagnostics(case, served):
    """``DIAG`` lines: per compared pair, which decode steps' logits are
    bit-equal and, at the first that is not, the difference and margins."""
    for key, what in DIAGNOSED:
        print(f"DIAG {case} {what}: {divergence.describe(served['diagnostics'][key])}",
              flush=True)
    print(f"DIAG {case} environment: {json.dumps(served['environment'])}", flush=True)
    ops = served["nondeterministic_ops"]
    print(f"DIAG {case} ops torch ran without a deterministic implementation: "
          f"{json.dumps(ops) if ops else 'none'}", flush=True)


def run_tp(args, checks, tp, S, D, indexer):
    case = f"TP={tp}"
    reusable = (PROMPT_TOKENS - 1) // PAGE_TOKENS
    tokens = rm.prompt(args.seed * 1000 + tp, PROMPT_TOKENS,
                       rm.GEOMETRIES[args.geometry]["vocab_size"])
    stored = S.call("prefill_store", tokens=tokens)
    checks.equal(case, "S backs up the prompt's full pages on every rank", stored["stored"],
                 [PROMPT_TOKENS // PAGE_TOKENS] * tp)
    if indexer is not None:
        hint, how = hint_from_indexer(indexer, tokens, S, D, reusable)
    else:
        hint, how = hint_from_inventory(tokens, S, reusable)
    checks.check(case, "the router names S for the prompt", hint is not None, how)
    served = D.call("serve", tokens=tokens, hint=hint, new_tokens=args.new_tokens,
                    request_id=f"req-tp{tp}")
    want_tokens = reusable * PAGE_TOKENS
    cold = served["cold_ids"]
    checks.check(case, "the cold ids vary (not one repeated token)", len(set(cold)) > 1,
                 f"cold ids {cold}")
    checks.equal(case, f"D restores {want_tokens} of {PROMPT_TOKENS} tokens",
                 served["restored_tokens"], want_tokens)
    checks.equal(case, "every rank's pages came from the peer (hinted pages loaded)",
                 [r["stats_delta"].get("hinted_pages_loaded", 0) for r in served["ranks"]],
                 [reusable] * tp)
    s_digests = [d[:reusable] for d in stored["digests"]]
    variants = served["variants"]

    def verdict(name):
        """The check: restored bytes equal S's, logits equal the control's,
        ids equal the cold ids."""
        v = variants[name]
        return (v["digests"] == s_digests, v["logits_equal_control"], v["ids"] == cold)

    r = variants["restored"]
    checks.check(case, "every restored page's SHA-256 equals S's, per rank shard",
                 r["digests"] == s_digests, f"{reusable} pages x {tp} shards")
    checks.check(case, "and equals D's own KV's (what D's prefill computes)",
                 served["own_digests"] == s_digests, f"{reusable} pages x {tp} shards")
    if args.new_tokens > NEW_TOKENS:
        checks.equal(case, f"D's first {NEW_TOKENS} ids equal cold inference's",
                     r["ids"][:NEW_TOKENS], cold[:NEW_TOKENS])
    checks.equal(case, f"D's {args.new_tokens} ids equal cold inference's", r["ids"], cold)
    checks.check(case, "D's logits equal the own-KV control's, bit for bit",
                 r["logits_equal_control"], f"max diff {r['logits_max_diff_control']:g}")
    checks.check(case, "D's logits equal cold inference's, bit for bit",
                 r["logits_equal_cold"], f"max diff {r['logits_max_diff_cold']:g}")
    checks.equal(case, "the control's ids equal cold inference's", served["control_ids"], cold)
    checks.check(case, "the control run twice gives the same logits, bit for bit "
                 "(this device repeats a computation)", served["control_repeat_equal"],
                 served["diagnostics"]["control_repeat"]["steps"])
    report_diagnostics(case, served)
    number(f"tp{tp}_ids_agreeing_with_one_shot",
           f"{sum(a == b for a, b in zip(r['ids'], served['one_shot_ids']))}/{len(cold)}")
    for name in ("zeroed", "shuffled"):
        v = variants[name]
        digests_ok, logits_ok, ids_ok = verdict(name)
        checks.check(case, f"negative control: {name} pages FAIL the check",
                     not digests_ok and not logits_ok,
                     f"digests equal {digests_ok}, logits equal {logits_ok} "
                     f"(max diff {v['logits_max_diff_control']:g}), ids equal {ids_ok}")
        number(f"tp{tp}_{name}", f"diff {v['logits_max_diff_control']:g} ids "
               + ("same" if ids_ok else "changed"))
    checks.check(case, "negative control: zeroed pages change the ids", not verdict("zeroed")[2],
                 f"ids {variants['zeroed']['ids']}")
    number(f"tp{tp}_restored", f"{served['restored_tokens']}/{PROMPT_TOKENS} tokens "
           f"{served['restored_bytes']} B")
    number(f"tp{tp}_logits_diff", f"control {r['logits_max_diff_control']:g} "
           f"cold {r['logits_max_diff_cold']:g}")
    return [case, f"{served['restored_tokens']} / {PROMPT_TOKENS}", served["restored_bytes"],
            r["digests"] == s_digests, r["ids"] == cold, r["logits_max_diff_control"],
            how]


# Mode B on a host pool (kvcr_direct's ``host=True``), CI-sized: shorter
# prompts and a smaller device pool than the GPU host's 3000 tokens.
MODE_B_CI = ["--geometry", "small", "--device", "cpu", "--dtype", "float32",
             "--prompt-tokens", "512", "--page-tokens", "16", "--device-pages", "64",
             "--store-pages", "256"]


def start_mode_b():
    """``real_model_direct.py`` as a child, started first: it computes while
    the mode A engines start."""
    return subprocess.Popen([sys.executable, os.path.join(HERE, "real_model_direct.py")]
                            + MODE_B_CI, stdout=subprocess.PIPE, text=True, cwd=HERE)


def finish_mode_b(proc, checks):
    """The child's ``CHECK``/``NUMBER`` lines pass through (prefixed ``mode
    B``); its exit status is a check."""
    for line in proc.stdout:
        line = line.rstrip("\n")
        for kind in ("CHECK PASS ", "CHECK FAIL "):
            if line.startswith(kind):
                what, _, detail = line[len(kind):].rpartition(" (")
                checks.check("mode B", what, kind == "CHECK PASS ", detail.removesuffix(")"))
                break
        else:
            if line.startswith("NUMBER "):
                print(f"NUMBER mode_b_{line[len('NUMBER '):]}", flush=True)
            elif line:
                print(f"# mode B: {line}", flush=True)
    checks.equal("mode B", "real_model_direct.py exits 0", proc.wait(), 0)


def close_all(engines):
    """Closes the engines at once (each ``close`` waits on its runners)."""
    with ThreadPoolExecutor(max(len(engines), 1)) as pool:
        list(pool.map(lambda e: e.close(), engines))


def run(args, checks, rows, cleanup):
    sizes = [int(t) for t in args.tp.split(",")]
    mode_b = start_mode_b() if args.mode_b else None
    if mode_b is not None:
        cleanup.append(lambda: mode_b.poll() is None and mode_b.kill())
    indexer = None
    if args.hint_from == "indexer":
        # The hicache-dynamo scenario's indexer process and router.
        sys.path.insert(0, os.path.join(HERE, "..", "..", "kvcr-hicache-storage", "python", "e2e"))
        from hicache_dynamo import Indexer

        indexer = Indexer(args.indexer_python, "indexer", args.log_dir)
        cleanup.append(indexer.close)
    publish = indexer is not None
    pairs, engines = [], []
    cleanup.append(lambda: close_all(engines))
    # Every engine starts at once (their imports and model builds overlap).
    for i, tp in enumerate(sizes):
        S = ModelEngine(f"S-tp{tp}", 10 * i + 1, tp, args, publish)
        D = ModelEngine(f"D-tp{tp}", 10 * i + 2, tp, args, publish)
        engines += [S, D]
        pairs.append((tp, S, D))
    for tp, S, D in pairs:
        S.wait_ready()
        D.wait_ready()
        if indexer is not None:
            indexer.register(S.worker, S)
            indexer.register(D.worker, D)
    for tp, S, D in pairs:
        rows.append(run_tp(args, checks, tp, S, D, indexer))
    close_all(engines)
    if mode_b is not None:
        finish_mode_b(mode_b, checks)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-dir", required=True)
    p.add_argument("--hint-from", choices=["indexer", "inventory"], default="indexer")
    p.add_argument("--indexer-python", help="the interpreter with ai-dynamo-runtime")
    p.add_argument("--tp", default="1,2", help="TP sizes, comma-separated")
    p.add_argument("--geometry", default="small", choices=sorted(rm.GEOMETRIES))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(rm.DTYPES))
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--tls", default="posix,cma,self")
    p.add_argument("--mode-b", action="store_true",
                   help="then mode B on a host pool, CI-sized (real_model_direct.py)")
    args = p.parse_args(argv)
    if args.hint_from == "indexer" and not args.indexer_python:
        p.error("--hint-from indexer needs --indexer-python")
    os.makedirs(args.log_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    checks, rows, cleanup = Checks(), [], []
    error = None
    try:
        run(args, checks, rows, cleanup)
    except Exception as e:  # noqa: BLE001  (the scenario could not finish: report)
        error = e
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        checks.check("scenario", "every case runs to the end", False,
                     f"{type(e).__name__}: {first}")
    finally:
        for close in reversed(cleanup):
            try:
                close()
            except Exception as e:  # noqa: BLE001
                print(f"cleanup: {e}", file=sys.stderr)
    print()
    print(f"| TP | tokens restored | bytes | digests equal | {args.new_tokens} ids equal cold "
          "| logits max diff vs control | hint |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    failed = checks.failed()
    print(f"\nreal-model ({args.geometry}, {args.device}, {args.dtype}): "
          f"{len(checks.results) - len(failed)} of {len(checks.results)} checks passed")
    if error is not None:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
