"""End-to-end: two SGLang engines at TP=2 with kvcr as their HiCache L3
backend, and Dynamo's standalone KV indexer as the only inventory authority.

``cargo xtask e2e --only hicache-dynamo`` runs this inside a network namespace
that holds only loopback (the indexer binds every interface and has no host
flag). Real processes: two engines (``engine_process.py``, each TP=2 with its
ranks as threads, every rank its own ``KvcrStorage`` built through SGLang's
``StorageBackendFactory``, Qwen3-0.6B geometry, 64-token pages, ``page_first``
host pools), two ``python -m dynamo.indexer`` processes. Each engine's DP owner
rank publishes its group's rank-agreed KVCR inventory on the vLLM/Dynamo
KV-event wire; this program registers each engine with the indexer from the
endpoints the backend reports and plays the router: hints come only from the
indexer's ``/query`` answers.

Cases (SGLang's prefix rules: a 256-token prompt reuses at most 192 tokens,
3 of its 4 pages, as it recomputes at least the last token):

(a) KVCR evicts, the engine retains: the source S stores prompt Q, then enough
    other pages that its small KVCR DRAM evicts Q; after ``sync_inventory`` the
    indexer gives S 0 tokens for Q, so the destination D gets no hint, nothing
    moves, D reuses nothing.
(b) KVCR retains, the engine evicts: S stores prompt P; the indexer names S
    with 192 tokens; D's two ranks restore those 3 pages from S's KVCR DRAM on
    a ``kv.fetch`` hint built from the answer, each rank its own shard, every
    byte checked.
(c) Namespaces: a salted tenant and a LoRA adapter store pages of the same
    token sequence R (different keys); ``/query`` without salt or LoRA matches
    neither, each matches only with its own ``cache_salt`` / ``lora_name``.
(d) A late indexer, started after S has published and gone quiet, converges
    to the first indexer's answers (the heartbeat reveals the gap, replay fills
    it) within a stated bound.
Then the engines close: ``AllBlocksCleared`` takes S out of every answer.

Each check prints one ``CHECK PASS|FAIL <case>: <what> (<detail>)`` line, key
numbers a ``NUMBER <name>=<value>`` line; a table closes the run. Exits 1 if
any check failed (2 if the scenario could not run).

    python hicache_dynamo.py --indexer-python target/realclients/venv/bin/python \
        --log-dir target/e2e/hicache-dynamo
"""

from __future__ import annotations

import argparse
import hashlib
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
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

# Only the page-key helpers: SGLang's storage keys (SHA-256 chained per page).
from engine import fetch_hint, page_keys  # noqa: E402

MODEL = "Qwen/Qwen3-0.6B"
PAGE_TOKENS = 64
PROMPT_TOKENS = 256
# SGLang recomputes at least the last token: 3 of a 256-token prompt's 4 pages.
REUSABLE_PAGES = (PROMPT_TOKENS - 1) // PAGE_TOKENS
TP = 2
S_WORKER, D_WORKER = 1, 2
SALT = "tenant-a"
LORA_NAME, LORA_ID = "adapter-x", 7
# The pages each namespace stores of prompt R: distinct counts, so an answer
# shows which namespace it matched.
R_BASE_PAGES, R_SALT_PAGES, R_LORA_PAGES = 1, 3, 2
# Generous deadlines for things that must happen (only invariants are checked;
# a slow machine is slower, not red).
INDEXER_START_S = 60
ENGINE_START_S = 180
CALL_S = 180
PUBLISH_S = 20


# ---------------------------------------------------------------------------
# Checks and output.

class Checks:
    def __init__(self):
        self.results = []  # (case, what, ok, detail)

    def check(self, case, what, ok, detail=""):
        ok = bool(ok)
        self.results.append((case, what, ok, detail))
        print(f"CHECK {'PASS' if ok else 'FAIL'} {case}: {what} ({detail})", flush=True)
        return ok

    def equal(self, case, what, got, want):
        return self.check(case, what, got == want, f"got {got!r}, want {want!r}")

    def failed(self):
        return [r for r in self.results if not r[2]]

    def case_ok(self, case):
        mine = [r for r in self.results if r[0] == case]
        return bool(mine) and all(r[2] for r in mine)


def number(name, value):
    print(f"NUMBER {name}={value}", flush=True)


def say(text):
    print(f"# {text}", flush=True)


# ---------------------------------------------------------------------------
# Prompts.

def prompt_tokens(seed, n=PROMPT_TOKENS):
    """A synthetic prompt: ``n`` token ids, distinct per seed."""
    return [(seed * 7919 + 13 * i) % 151_000 for i in range(n)]


def namespace_seed(kind, value):
    """The seed of a namespace's hash chain (SGLang seeds the page-key chain
    of a salted or LoRA request, so the same tokens give different keys)."""
    return hashlib.sha256(f"{kind}:{value}".encode()).hexdigest()


class Prompt:
    """A prompt's tokens and SGLang's storage keys of its full pages."""

    def __init__(self, name, seed, prior_hex=None, n_tokens=PROMPT_TOKENS):
        self.name = name
        self.tokens = prompt_tokens(seed, n_tokens)
        self.keys = page_keys(self.tokens, PAGE_TOKENS, prior_hex)

    def page_tokens(self, pages):
        return self.tokens[:pages * PAGE_TOKENS]


# ---------------------------------------------------------------------------
# Processes.

def free_port(host="127.0.0.1", n=1):
    """A free TCP port with ``n - 1`` free ports after it."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n > 65_535:
            continue
        held = []
        try:
            for i in range(n):
                s = socket.socket()
                held.append(s)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def http(port, method, path, body=None, timeout=10):
    """One HTTP request to 127.0.0.1:port; (status, JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Indexer:
    """Dynamo's standalone KV indexer (``python -m dynamo.indexer``)."""

    def __init__(self, python, name, log_dir):
        self.name = name
        self.port = free_port("0.0.0.0")
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--block-size", str(PAGE_TOKENS),
             "--port", str(self.port), "--threads", "1"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            env=dict(os.environ, RUST_LOG="info"))
        deadline = time.monotonic() + INDEXER_START_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}\n{self.tail()}")
            try:
                if http(self.port, "GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer /health in {INDEXER_START_S} s")
            time.sleep(0.2)
        say(f"{name}: Dynamo's standalone indexer on port {self.port} (pid {self.proc.pid})")

    def tail(self, n=20):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def register(self, worker, engine):
        """Registers an engine's DP-0 stream, from the endpoints its backend reports."""
        body = {
            "instance_id": worker,
            "endpoint": engine.kv_events_endpoint,
            "replay_endpoint": engine.kv_events_replay_endpoint,
            "model_name": MODEL,
            "block_size": PAGE_TOKENS,
            "dp_rank": 0,
        }
        status, answer = http(self.port, "POST", "/register", body)
        if not 200 <= status < 300:
            raise RuntimeError(f"{self.name} /register {body}: {status} {answer}")

    def query(self, tokens, lora_name=None, cache_salt=None):
        """The ``instances`` map of a ``/query`` answer (worker id -> match)."""
        body = {"token_ids": tokens, "model_name": MODEL}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        status, answer = http(self.port, "POST", "/query", body)
        if status != 200 or not isinstance(answer, dict):
            raise RuntimeError(f"{self.name} /query: {status} {answer}")
        return answer.get("instances") or {}

    def matched(self, worker, tokens, **ns):
        """Tokens the indexer says ``worker`` holds of the prompt's prefix."""
        entry = self.query(tokens, **ns).get(str(worker)) or {}
        return int(entry.get("longest_matched", 0))

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class EngineProcess:
    """An engine process (``engine_process.py``) and its JSON-lines channel."""

    def __init__(self, name, worker, args, kvcr_pages, host_pages, publish=True):
        self.name, self.worker = name, worker
        self.log_path = os.path.join(args.log_dir, f"engine-{name}.log")
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, os.path.join(HERE, "engine_process.py"),
               "--name", name, "--worker-id", str(worker),
               "--control-port", str(free_port(n=TP)), "--tls", args.tls,
               "--kvcr-pages", str(kvcr_pages), "--host-pages", str(host_pages),
               "--heartbeat-ms", str(args.heartbeat_ms)] + (["--publish"] if publish else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=HERE)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._answer(ENGINE_START_S, "attach")
        self.ranks = ready["ranks"]
        owner = self.ranks[0]
        self.endpoint = owner["endpoint"]
        self.kv_events_endpoint = owner["kv_events_endpoint"]
        self.kv_events_replay_endpoint = owner["kv_events_replay_endpoint"]
        self.metadata_keys = [k for k, _ in owner["registration_metadata"]]
        self.metadata = dict(owner["registration_metadata"])
        self.page_bytes = owner["page_bytes"]
        say(f"engine {name} (pid {ready['pid']}, TP={TP}): control {self.endpoint}, "
            f"KV events {self.kv_events_endpoint}, replay {self.kv_events_replay_endpoint}")

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

    def call(self, op, **fields):
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._answer(CALL_S, op)

    def store(self, keys, tokens, prefix_keys=None, **tags):
        """Backs up pages on both ranks; the number every rank stored."""
        stored = self.call("store", keys=keys, tokens=tokens, prefix_keys=prefix_keys, **tags)
        return [sum(1 for ok in rank if ok) for rank in stored["stored"]]

    def stats(self):
        return self.call("stats")["ranks"]

    def close(self):
        """``close()`` on both ranks (the publisher clears and stops); the
        process exits."""
        answer = None
        if self.proc.poll() is None:
            try:
                answer = self.call("close")
            finally:
                self.proc.stdin.close()
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.log.close()
        return answer

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def poll(deadline_s, probe, done):
    """Calls ``probe()`` until ``done(value)`` or the deadline; returns
    (value, seconds taken, whether it held)."""
    start = time.monotonic()
    while True:
        value = probe()
        if done(value):
            return value, time.monotonic() - start, True
        if time.monotonic() - start > deadline_s:
            return value, time.monotonic() - start, False
        time.sleep(0.1)


# The registration metadata the DP owner rank reports, in publish order.
REGISTRATION_KEYS = ["kv_events_endpoint", "kv_events_replay_endpoint",
                     "router_hint_source_control_endpoints", "router_hint_worker_type",
                     "router_hint"]


def sent_bytes(ranks):
    """Bytes an engine's ranks wrote for peers (the runners' peer counter)."""
    return sum(int(r["peer_bytes_sent"]) for r in ranks)


# ---------------------------------------------------------------------------
# The scenario.

def route(indexer, tokens, destination, **ns):
    """The router: the worker (not the destination) with the longest match in
    the indexer's answer, and that many whole pages, or None."""
    instances = indexer.query(tokens, **ns)
    best = None
    for worker, entry in instances.items():
        if int(worker) == destination:
            continue
        pages = int(entry.get("longest_matched", 0)) // PAGE_TOKENS
        if pages and (best is None or pages > best[1]):
            best = (int(worker), pages)
    return best, instances


def run(args, checks, rows, cleanup):
    """Starts the processes, plays the cases, records checks and table rows;
    ``cleanup`` collects what stops each process started."""
    ix = Indexer(args.indexer_python, "indexer-a", args.log_dir)
    cleanup.append(ix.close)
    engines = {}
    for name, worker, kvcr_pages in (("S", S_WORKER, args.kvcr_pages), ("D", D_WORKER, 8)):
        e = EngineProcess(name, worker, args, kvcr_pages, args.host_pages)
        cleanup.append(e.kill)
        engines[worker] = e
    S, D = engines[S_WORKER], engines[D_WORKER]

    # What the backend reports for registration (DP owner rank only).
    for e in (S, D):
        checks.check("attach", f"{e.name}: the DP owner rank reports its KV-event endpoints",
                     bool(e.kv_events_endpoint and e.kv_events_replay_endpoint),
                     f"{e.kv_events_endpoint}, {e.kv_events_replay_endpoint}")
        non_owner = e.ranks[1]
        checks.check("attach", f"{e.name}: the non-owner rank publishes nothing",
                     non_owner["kv_events_endpoint"] is None and not non_owner["registration_metadata"],
                     f"rank 1: {non_owner['kv_events_endpoint']}, {non_owner['registration_metadata']}")
        sources = json.loads(e.metadata.get("router_hint_source_control_endpoints", "{}"))
        checks.equal("attach", f"{e.name}: registration metadata names the control endpoint of DP rank 0",
                     sources, {"0": e.endpoint})
        checks.equal("attach", f"{e.name}: registration metadata advertises router hints",
                     e.metadata.get("router_hint"), "true")
        checks.equal("attach", f"{e.name}: registration metadata in publish order",
                     e.metadata_keys, REGISTRATION_KEYS)
        checks.equal("attach", f"{e.name}: registration metadata names the reported KV-event endpoints",
                     (e.metadata.get("kv_events_endpoint"), e.metadata.get("kv_events_replay_endpoint")),
                     (e.kv_events_endpoint, e.kv_events_replay_endpoint))
        ix.register(e.worker, e)
    say(f"{ix.name}: registered S as worker {S_WORKER}, D as worker {D_WORKER} "
        f"(model {MODEL}, block size {PAGE_TOKENS})")

    page_bytes = S.page_bytes  # one TP shard of one page
    Q = Prompt("Q", 1)
    P = Prompt("P", 2)
    R = Prompt("R", 3)
    R_salt = Prompt("R/salt", 3, namespace_seed("cache_salt", SALT))
    R_lora = Prompt("R/lora", 3, namespace_seed("lora", LORA_ID))
    filler_pages = args.kvcr_pages + REUSABLE_PAGES
    filler = Prompt("filler", 4, n_tokens=filler_pages * PAGE_TOKENS)

    # (a) KVCR evicts Q, the engine would retain it. --------------------------
    case = "(a) KVCR evicted"
    q_pages = Q.keys[:REUSABLE_PAGES]
    checks.equal(case, "S stores Q's reusable pages on both ranks",
                 S.store(q_pages, Q.page_tokens(REUSABLE_PAGES)), [REUSABLE_PAGES] * TP)
    got, secs, ok = poll(PUBLISH_S, lambda: ix.matched(S_WORKER, Q.tokens),
                         lambda m: m == REUSABLE_PAGES * PAGE_TOKENS)
    checks.check(case, "the indexer learns Q from S's stream before the eviction", ok,
                 f"S matches {got} tokens after {secs:.1f} s")
    stored = S.store(filler.keys, filler.tokens)
    checks.equal(case, f"S stores {filler_pages} other pages (its KVCR DRAM holds {args.kvcr_pages})",
                 stored, [filler_pages] * TP)
    S.call("sync")
    checks.equal(case, "S's KVCR no longer holds Q on any TP shard",
                 S.call("exists", keys=q_pages)["hits"], [0] * TP)
    removed = S.stats()[0].get("pages_removed", 0)
    checks.check(case, "S's owner rank published Removed for Q's pages (and the evicted fillers)",
                 removed >= REUSABLE_PAGES, f"pages_removed {removed}")
    got, secs, ok = poll(PUBLISH_S, lambda: ix.matched(S_WORKER, Q.tokens), lambda m: m == 0)
    checks.check(case, "the indexer gives S 0 tokens for Q (BlockRemoved reached it)", ok,
                 f"S matches {got} tokens after {secs:.1f} s")
    sent_before = sent_bytes(S.stats())
    best, instances = route(ix, Q.tokens, D_WORKER)
    checks.check(case, "the router finds no source for Q: D gets no hint", best is None,
                 f"/query: {instances}")
    fetched = D.call("fetch", keys=Q.keys[:REUSABLE_PAGES], hint=None, request_id="req-q")["ranks"]
    restored_a = [r["restored"] for r in fetched]
    checks.equal(case, "D reuses nothing of Q", restored_a, [0] * TP)
    requested = [r["stats_delta"].get("hinted_pages_requested", 0) for r in fetched]
    checks.equal(case, "D asks no peer for a page (hinted_pages_requested)", requested, [0] * TP)
    sent = sent_bytes(S.stats()) - sent_before
    checks.equal(case, "S sends no byte to a peer (peer_bytes_sent)", sent, 0)
    blocks = [r["stats_delta"].get("peer_keys_received") for r in fetched]
    checks.equal(case, "no block reaches D from a peer (peer_keys_received)", blocks, [0] * TP)
    rows.append([case, f"{min(restored_a) * PAGE_TOKENS} / {PROMPT_TOKENS}",
                 " / ".join(map(str, blocks)), " / ".join(str(r["host_spans"]) for r in fetched),
                 f"{sent:,}", case])

    # (b) KVCR retains P, the engine evicted it. -------------------------------
    case = "(b) KVCR retained"
    p_pages = P.keys[:REUSABLE_PAGES]
    checks.equal(case, "S stores P's reusable pages on both ranks",
                 S.store(p_pages, P.page_tokens(REUSABLE_PAGES)), [REUSABLE_PAGES] * TP)
    want = REUSABLE_PAGES * PAGE_TOKENS
    got, secs, ok = poll(PUBLISH_S, lambda: ix.matched(S_WORKER, P.tokens), lambda m: m == want)
    checks.check(case, f"the indexer names S with {want} tokens of P", ok,
                 f"S matches {got} tokens after {secs:.1f} s")
    best, instances = route(ix, P.tokens, D_WORKER)
    checks.equal(case, "the router picks S for P's matched pages", best, (S_WORKER, REUSABLE_PAGES))
    pages = best[1] if best else 0
    # The hint names the source's DP-0 control endpoint, as its registration
    # metadata advertises it (each destination rank dials its own shard).
    sources = json.loads(S.metadata.get("router_hint_source_control_endpoints", "{}"))
    source = sources.get("0", S.endpoint)
    hint = fetch_hint(source, P.keys[:pages]) if pages else None
    s_before = S.stats()
    fetched = D.call("fetch", keys=P.keys[:REUSABLE_PAGES], hint=hint, request_id="req-p")["ranks"]
    s_after = S.stats()
    restored = [r["restored"] for r in fetched]
    restored_bytes = sum(r["bytes"] for r in fetched)
    tokens = min(restored) * PAGE_TOKENS
    checks.equal(case, f"D restores {want} of P's {PROMPT_TOKENS} tokens on every rank", tokens, want)
    checks.equal(case, "every restored byte equals the source's, per shard",
                 [(r["equal"], r["mismatched"]) for r in fetched], [(REUSABLE_PAGES, 0)] * TP)
    checks.equal(case, "no failed key", [r["failed_keys"] for r in fetched], [[]] * TP)
    checks.equal(case, "each rank's hinted pages were loaded from the peer",
                 [(r["stats_delta"].get("hinted_pages_requested", 0),
                   r["stats_delta"].get("hinted_pages_loaded", 0)) for r in fetched],
                 [(REUSABLE_PAGES, REUSABLE_PAGES)] * TP)
    # Blocks per shard: what the source's runner wrote for each destination
    # rank (its peer counter).
    blocks = [r["stats_delta"].get("peer_keys_received") for r in fetched]
    checks.equal(case, f"{REUSABLE_PAGES} blocks per TP shard came from the peer", blocks,
                 [REUSABLE_PAGES] * TP)
    # Spans per shard: blocks x the backend plan's spans per page, checked
    # against the host pool's own buffer meta for the restored pages.
    host_spans = [r["host_spans"] for r in fetched]
    plan = [r["spans_per_page"] for r in fetched]
    spans = [(b or 0) * (p or 0) for b, p in zip(blocks, plan)]
    checks.equal(case, "spans per shard (blocks x the plan's spans per page) equal the host "
                 "pool's buffer meta", spans, host_spans)
    checks.equal(case, "restored bytes = pages x shards x shard bytes",
                 restored_bytes, REUSABLE_PAGES * TP * page_bytes)
    # Aggregate bytes: what S's ranks wrote for peers (their peer counter).
    sent = [a.get("peer_bytes_sent", 0) - b.get("peer_bytes_sent", 0)
            for a, b in zip(s_after, s_before)]
    aggregate = sum(sent)
    checks.equal(case, "S's ranks sent exactly the restored bytes, each rank its own shard",
                 sent, [REUSABLE_PAGES * page_bytes] * TP)
    number("restored_tokens", f"{tokens}/{PROMPT_TOKENS}")
    number("blocks_per_shard", "/".join(map(str, blocks)))
    number("spans_per_shard", "/".join(map(str, spans)))
    number("source_bytes", aggregate)
    rows.append([case, f"{tokens} / {PROMPT_TOKENS}", " / ".join(map(str, blocks)),
                 " / ".join(map(str, spans)), f"{aggregate:,}", case])

    # (c) A salted tenant and a LoRA adapter: other namespaces. -----------------
    case = "(c) namespaces"
    checks.equal(case, f"S stores {R_BASE_PAGES} base page of R",
                 S.store(R.keys[:R_BASE_PAGES], R.page_tokens(R_BASE_PAGES)), [R_BASE_PAGES] * TP)
    checks.equal(case, f"S stores {R_SALT_PAGES} pages of R salted {SALT!r}",
                 S.store(R_salt.keys[:R_SALT_PAGES], R.page_tokens(R_SALT_PAGES), cache_salt=SALT),
                 [R_SALT_PAGES] * TP)
    checks.equal(case, f"S stores {R_LORA_PAGES} pages of R for LoRA {LORA_NAME!r}",
                 S.store(R_lora.keys[:R_LORA_PAGES], R.page_tokens(R_LORA_PAGES),
                         lora_name=LORA_NAME, lora_id=LORA_ID),
                 [R_LORA_PAGES] * TP)
    # Distinct page counts per namespace: an answer shows what it matched.
    expect = [
        # (short name, query namespace, what it shows, pages S must match)
        ("base", {}, "neither salt nor LoRA", R_BASE_PAGES),
        ("salt", {"cache_salt": SALT}, f"cache_salt {SALT!r}", R_SALT_PAGES),
        ("lora", {"lora_name": LORA_NAME}, f"lora_name {LORA_NAME!r}", R_LORA_PAGES),
        ("salt+lora", {"cache_salt": SALT, "lora_name": LORA_NAME}, "both the salt and the LoRA", 0),
        ("other-salt", {"cache_salt": "tenant-b"}, "another tenant's salt", 0),
    ]
    matches = []
    for short, ns, label, want_pages in expect:
        want = want_pages * PAGE_TOKENS
        got, secs, ok = poll(PUBLISH_S, lambda ns=ns: ix.matched(S_WORKER, R.tokens, **ns),
                             lambda m, want=want: m == want)
        checks.check(case, f"/query R with {label} gives S {want} tokens", ok,
                     f"S matches {got} tokens")
        matches.append(f"{short} {got}")
    number("namespace_matched_tokens", "/".join(matches))
    rows.append([case, "matched: " + ", ".join(matches), "-", "-", "-", case])

    # (d) A late indexer. -------------------------------------------------------
    case = "(d) late indexer"
    # Every query the earlier cases made, as (tokens, namespace).
    probes = [(Q.tokens, {}), (P.tokens, {}), (R.tokens, {}), (R.tokens, {"cache_salt": SALT}),
              (R.tokens, {"lora_name": LORA_NAME}),
              (R.tokens, {"cache_salt": SALT, "lora_name": LORA_NAME})]
    quiet = max(2 * args.heartbeat_ms / 1000, 1.0)
    say(f"S has gone quiet (no store for {quiet:.1f} s); starting a second indexer")
    time.sleep(quiet)
    ix_b = Indexer(args.indexer_python, "indexer-b", args.log_dir)
    cleanup.append(ix_b.close)
    for e in (S, D):
        ix_b.register(e.worker, e)
    bound = args.converge_s

    def answers(indexer):
        return [indexer.query(t, **ns) for t, ns in probes]

    got, secs, ok = poll(bound, lambda: (answers(ix), answers(ix_b)), lambda ab: ab[0] == ab[1])
    checks.check(case, f"the late indexer's answers equal the first's within {bound:.0f} s "
                 f"(heartbeat {args.heartbeat_ms} ms)", ok,
                 f"after {secs:.1f} s" if ok else f"first {got[0]}, late {got[1]}")
    checks.equal(case, "the late indexer names S with P's 192 tokens",
                 ix_b.matched(S_WORKER, P.tokens), REUSABLE_PAGES * PAGE_TOKENS)
    number("late_indexer_converged_s", f"{secs:.1f}")
    rows.append([case, f"P: {ix_b.matched(S_WORKER, P.tokens)} / {PROMPT_TOKENS}", "-", "-", "-",
                 case])

    # Close: AllBlocksCleared takes S out of every answer. -----------------------
    case = "close"
    S.close()
    for indexer in (ix, ix_b):
        got, secs, ok = poll(PUBLISH_S, lambda indexer=indexer: [
            indexer.matched(S_WORKER, t, **ns) for t, ns in probes], lambda m: not any(m))
        checks.check(case, f"{indexer.name} gives S 0 tokens after S closes (AllBlocksCleared)",
                     ok, f"S matches {got} after {secs:.1f} s")
    D.close()
    rows.append([case, "S: 0", "-", "-", "-", case])


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--indexer-python", required=True,
                   help="the interpreter with ai-dynamo-runtime (target/realclients/venv/bin/python)")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--tls", default="posix,cma,self")
    p.add_argument("--kvcr-pages", type=int, default=12,
                   help="S's KVCR DRAM per rank, in pages (small, so it evicts)")
    p.add_argument("--host-pages", type=int, default=8)
    p.add_argument("--heartbeat-ms", type=int, default=1000)
    p.add_argument("--converge-s", type=float, default=15.0,
                   help="the bound on the late indexer's convergence")
    p.add_argument("--allow-host-network", action="store_true",
                   help="run even where interfaces other than loopback exist")
    args = p.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)

    interfaces = sorted(name for _, name in socket.if_nameindex())
    if interfaces != ["lo"] and not args.allow_host_network:
        print(f"hicache-dynamo: Dynamo's indexer binds every interface; run this in a network "
              f"namespace holding only loopback (found {interfaces})", file=sys.stderr)
        return 2

    # A stop from outside (SIGTERM) still closes the engines and indexers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    checks, rows, cleanup = Checks(), [], []
    error = None
    try:
        run(args, checks, rows, cleanup)
    except Exception as e:  # the scenario could not finish: report, then clean up
        error = e
        traceback.print_exc()
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        summary = lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else "") if lines else ""
        checks.check("scenario", "every case runs to the end", False,
                     f"{type(e).__name__}: {summary}")
    finally:
        for close in reversed(cleanup):
            try:
                close()
            except Exception as e:
                print(f"cleanup: {e}", file=sys.stderr)

    print()
    print("| case | tokens restored / prompt tokens | blocks per shard | spans per shard "
          "| aggregate source bytes | result |")
    print("|---|---|---|---|---|---|")
    for case, tokens, blocks, spans, nbytes, key in rows:
        print(f"| {case} | {tokens} | {blocks} | {spans} | {nbytes} | "
              f"{'pass' if checks.case_ok(key) else 'FAIL'} |")
    failed = checks.failed()
    print(f"\nhicache-dynamo: {len(checks.results) - len(failed)} of {len(checks.results)} "
          f"checks passed" + (f"; stopped early: {error}" if error else ""))
    if error is not None:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
