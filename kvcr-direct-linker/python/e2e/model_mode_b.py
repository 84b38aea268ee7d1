"""Mode B under a real transformer, on a GPU (issue 41): Hugging Face's
``Qwen3ForCausalLM`` with Qwen3-0.6B's geometry (28 layers, 8 KV heads,
head_dim 128, bf16; weights from a fixed seed, nothing downloaded) whose KV
cache lives in a paged pool of per-layer K/V tensors that ``kvcr_direct``
offloads to KVCR DRAM and restores from it, or from a peer process's KVCR
DRAM on a router hint.

For each prompt length: a cold prefill (the TTFT anchor) and 16 greedy
tokens; the no-kvcr control, cold inference as a chunked-prefill engine runs
it: the full pages' prefix prefilled on its own, its KV written to the pool,
the suffix prefilled on a cache read from the pool and 16 tokens decoded; the
engine's pages offloaded, then overwritten by a filler prompt's KV (the GPU
evicted them); the prompt replayed with its full pages restored into the
pool, the rest prefilled on a cache read from the pool the same way, 16
tokens decoded. The replay and the control compute the same GEMMs on the same
cache layout, so they must agree to the bit. Checks (``CHECK PASS|FAIL``):
the cold ids vary; the control run twice gives the same logits (the device
repeats a computation); every full page but the last token's is restored;
each restored page's bytes equal the engine's own KV; the first logits equal
the control's bit for bit; a zeroed page changes them; the byte check refuses
swapped pages; the first 8 ids, and all 16, equal the control's. Whether they
also equal the one-shot cold prefill's is printed: in bf16 a prompt
prefilled in two chunks may round differently from one prefilled at once
(other GEMM shapes; kvcr not involved). (Swapped pages leave the logits as
they were: attention over the cached keys and values is a sum over the set,
each key rotated for its position before it was cached; the byte comparison
is what catches them.) Per pair that should agree to the bit a ``DIAG`` line
says which decode steps' logits are bit-equal and, at the first that is not,
the difference, both runs' top-1/top-2 margins (a near tie?) and the first
forward and layer whose appended KV differ. Time to first token, restore
against cold prefill, prints as ``BENCH model.ttft_restore_vs_cold_<n>`` (local) and
``BENCH model.ttft_peer_restore_vs_cold_<n>`` (peer).

    python model_mode_b.py [--tokens 3000,16384,32768] [--no-peer]

Exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import warnings

# Two runs of one computation must give the same bits: cuBLAS's deterministic
# workspace (set before CUDA starts) and deterministic kernels.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

PAGE_TOKENS = 16
NAMESPACE = 41
DECODE = 16  # the ids checked; the first 8 are also checked on their own
FIRST_IDS = 8
FAILED = []
# torch's warnings that it ran an op without a deterministic implementation.
NONDETERMINISTIC = []


def check(what, ok, detail=""):
    print(f"CHECK {'PASS' if ok else 'FAIL'} {what} ({detail})", flush=True)
    if not ok:
        FAILED.append(what)


def build_model(device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    # No cuDNN attention: torch chose it for a one-query decode on an H100,
    # and it did not repeat a computation to the bit (the harness's
    # determinism_probe.py; reference_model.repeatable_attention).
    torch.backends.cuda.enable_cudnn_sdp(False)

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
        # Untied output weights drawn wider than the default 0.02: the
        # default's greedy ids repeat one token, which would prove little.
        tie_word_embeddings=False, initializer_range=0.1,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151936, (n,), generator=g)


def page_keys(tokens, pages):
    """Chained page keys (each page's key covers every token before it)."""
    keys, running = [], b""
    for p in range(pages):
        chunk = tokens[p * PAGE_TOKENS:(p + 1) * PAGE_TOKENS].numpy().tobytes()
        running = hashlib.blake2b(running + chunk, digest_size=8).digest()
        keys.append(int.from_bytes(running, "little") >> 1)
    return keys


def layer_kv(cache, layer):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def digest(t):
    data = t.contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def trace_kv(trace, cache, start, ops=None):
    """Appends to ``trace`` one forward's record: the digests of each layer's
    K and V from position ``start`` on (what the forward appended) and
    ``ops``, each module's (name, output digest) in the order they finished
    (None where the forward was not hooked)."""
    if trace is not None:
        trace.append((
            [(digest(k[:, :, start:]), digest(v[:, :, start:]))
             for k, v in (layer_kv(cache, layer) for layer in range(28))],
            ops))


def hook_modules(model, engine):
    """While ``engine.ops`` is a list, every submodule appends its (name,
    output digest) to it."""
    def hook_for(name):
        def hook(_module, _inputs, output):
            first = output[0] if isinstance(output, tuple) and output else output
            if engine.ops is not None and isinstance(first, torch.Tensor):
                engine.ops.append((name, digest(first)))
        return hook

    def attention_out(name):
        def hook(_module, inputs):
            if engine.ops is not None:
                engine.ops.append((f"{name} (attention)", digest(inputs[0])))
        return hook

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(hook_for(name))
        if name.endswith("self_attn.o_proj"):
            # Its input is the attention's output: SDPA apart from the GEMM.
            module.register_forward_pre_hook(attention_out(name.removesuffix(".o_proj")))


def top2(row):
    values, ids = torch.topk(row, 2)
    return f"{int(ids[0])}/{int(ids[1])} margin {float(values[0] - values[1]):g}"


def diag(what, a_logits, b_logits, a_trace=None, b_trace=None):
    """A ``DIAG`` line: per decode step whether two runs' logits are
    bit-equal; at the first that is not, the largest difference and each
    run's top-1/top-2 margin (a near tie flips on one ulp); the first forward
    (0: the prefill) and layer whose appended KV differ. Returns whether
    every step was bit-equal."""
    equal = [bool(torch.equal(a, b)) for a, b in zip(a_logits, b_logits)]
    line = "steps " + "".join("=" if e else "x" for e in equal)
    if False in equal:
        i = equal.index(False)
        diff = float((a_logits[i] - b_logits[i]).abs().nan_to_num(nan=float("inf")).max())
        margins = [float(torch.topk(x[i], 2).values.diff().abs()) for x in (a_logits, b_logits)]
        line += (f"; first differing step {i}: max diff {diff:g}, top-1/top-2 "
                 f"{top2(a_logits[i])} vs {top2(b_logits[i])} "
                 f"({'a near tie' if diff >= min(margins) else 'not a near tie'})")
    if a_trace is not None and b_trace is not None:
        where = next(([f, n, "K" if x[0] != y[0] else "V"]
                      for f, (sa, sb) in enumerate(zip(a_trace, b_trace))
                      for n, (x, y) in enumerate(zip(sa[0], sb[0])) if x != y), None)
        line += ("; appended KV bit-equal in every layer of every forward" if where is None
                 else f"; appended KV first differs at forward {where[0]} (0 = prefill) "
                 f"layer {where[1]} ({where[2]})")
        op = next(([f, x[0] if x[0] == y[0] else f"{x[0]} / {y[0]}"]
                   for f, (sa, sb) in enumerate(zip(a_trace, b_trace))
                   if sa[1] is not None and sb[1] is not None
                   for x, y in zip(sa[1], sb[1]) if x != y), None)
        line += ("; every decode step's module outputs bit-equal" if op is None else
                 f"; first module whose output differs: forward {op[0]} {op[1]}")
    print(f"DIAG {what}: {line}", flush=True)
    return all(equal)


class Engine:
    """The model and its paged KV pool (one K and one V tensor per layer,
    ``(slots * PAGE_TOKENS, kv_heads, head_dim)``)."""

    def __init__(self, device, slots):
        self.device = device
        self.model = build_model(device)
        self.ops = None  # each module's output digest while a decode is traced
        hook_modules(self.model, self)
        shape = (slots * PAGE_TOKENS, 8, 128)
        self.k = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(28)]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(28)]

    @torch.no_grad()
    def prefill(self, ids, cache=None):
        from transformers.cache_utils import DynamicCache

        cache = cache if cache is not None else DynamicCache()
        start = cache.get_seq_length()
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = self.model(
                input_ids=ids.to(self.device).unsqueeze(0), past_key_values=cache,
                position_ids=positions, use_cache=True,
            )
        for w in seen:
            if "determinis" in str(w.message) and str(w.message) not in NONDETERMINISTIC:
                NONDETERMINISTIC.append(str(w.message))
        return out.logits[0, -1].float(), out.past_key_values

    @torch.no_grad()
    def decode(self, logits, cache, n, trace=None):
        """``n`` greedy ids from the prefill's ``logits``; the ids and each
        step's logits ([n, vocab]); ``trace`` gets each step's appended KV."""
        ids, steps = [int(logits.argmax())], [logits]
        for _ in range(n - 1):
            start = cache.get_seq_length()
            self.ops = [] if trace is not None else None
            logits, cache = self.prefill(torch.tensor([ids[-1]]), cache)
            ops, self.ops = self.ops, None
            trace_kv(trace, cache, start, ops)
            ids.append(int(logits.argmax()))
            steps.append(logits)
        return ids, torch.stack(steps)

    def store(self, cache, pages, slots):
        """Writes the cache's first ``pages`` pages into ``slots``."""
        for layer in range(28):
            k, v = layer_kv(cache, layer)
            for p, s in zip(range(pages), slots):
                t = slice(p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS)
                self.k[layer][s * PAGE_TOKENS:(s + 1) * PAGE_TOKENS] = k[0, :, t].transpose(0, 1)
                self.v[layer][s * PAGE_TOKENS:(s + 1) * PAGE_TOKENS] = v[0, :, t].transpose(0, 1)
        torch.cuda.synchronize(self.device)

    def cache_from(self, slots):
        """A cache holding the pool's ``slots``, in order."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        index = torch.cat([
            torch.arange(s * PAGE_TOKENS, (s + 1) * PAGE_TOKENS) for s in slots
        ]).to(self.device)
        for layer in range(28):
            k = self.k[layer].index_select(0, index).transpose(0, 1).unsqueeze(0)
            v = self.v[layer].index_select(0, index).transpose(0, 1).unsqueeze(0)
            cache.update(k.contiguous(), v.contiguous(), layer)
        return cache

    def pages_equal(self, cache, pages, slots):
        for layer in range(28):
            k, v = layer_kv(cache, layer)
            for p, s in zip(range(pages), slots):
                t = slice(p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS)
                mine = slice(s * PAGE_TOKENS, (s + 1) * PAGE_TOKENS)
                if not (torch.equal(self.k[layer][mine], k[0, :, t].transpose(0, 1))
                        and torch.equal(self.v[layer][mine], v[0, :, t].transpose(0, 1))):
                    return False
        return True


def linker_for(engine, slots, peer):
    import kvcr_direct as kd

    return kd.DirectLinker(
        engine.k, engine.v, page_tokens=PAGE_TOKENS, store_pages=slots, peer=peer,
        operation_timeout_s=120.0,
    )


def hint(endpoint, keys):
    return json.dumps({"source_control_endpoint": endpoint, "block_hashes": list(keys)})


def offload(linker, keys, slots):
    import kvcr_direct as kd

    linker.offload(NAMESPACE, list(zip(keys, slots)))
    events = linker.settle(120.0)
    return any(isinstance(e, kd.OffloadDone) and e.success for e in events)


def source_main(n):
    """``--source N``: a second engine process that prefills the prompt,
    offloads its pages, prints ``ENDPOINT``, and serves until stdin closes."""
    device = torch.device("cuda", 0)
    pages = (n - 1) // PAGE_TOKENS
    engine = Engine(device, pages)
    tokens = prompt(n, n)
    # The pages' prefix prefilled on its own, as the destination's cold
    # reference prefills it (chunked where the restored prefix ends).
    _, cache = engine.prefill(tokens[:pages * PAGE_TOKENS])
    slots = list(range(pages))
    engine.store(cache, pages, slots)
    linker = linker_for(engine, pages, True)
    assert offload(linker, page_keys(tokens, pages), slots), "source offload failed"
    print(f"ENDPOINT {linker.endpoint}", flush=True)
    sys.stdin.read()
    linker.close()


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


def replay(engine, linker, name, tokens, keys, slots, hints, control):
    """Restores the prompt's pages into ``slots`` and decodes; compares with
    ``control`` (the no-kvcr run: ids, logits, trace, own cache); returns the
    TTFT in ms, the restored pages and the first logits."""
    import kvcr_direct as kd

    pages = len(keys)

    def first_token():
        ctx = linker.begin(name, namespace=NAMESPACE, device_prefix_pages=0, tail=keys,
                           hints=hints)
        linker.restore_hinted(ctx, slots)
        done = [e for e in linker.settle(120.0) if isinstance(e, kd.RestoreDone)]
        restored = done[0].restored if done else 0
        linker.end_attempt(ctx.attempt)
        cache = engine.cache_from(slots[:restored])
        logits, cache = engine.prefill(tokens[restored * PAGE_TOKENS:], cache)
        return restored, logits, cache

    (restored, logits, cache), ms = timed(first_token)
    # The trace is taken after the timing: the prefill's appended KV.
    trace = []
    trace_kv(trace, cache, restored * PAGE_TOKENS)
    check(f"{name}: every full page restored", restored == pages, f"{restored} of {pages}")
    check(f"{name}: restored pages equal the engine's own KV",
          engine.pages_equal(control["own"], restored, slots), f"{restored} pages")
    ids, steps = engine.decode(logits, cache, DECODE, trace)
    want = control["ids"]
    check(f"{name}: the first {FIRST_IDS} ids equal the no-kvcr control's",
          ids[:FIRST_IDS] == want[:FIRST_IDS], f"{ids[:FIRST_IDS]} vs {want[:FIRST_IDS]}")
    check(f"{name}: {DECODE} ids equal the no-kvcr control's", ids == want, f"{ids} vs {want}")
    diag(f"{name} restored vs the no-kvcr control", steps, control["logits"], trace,
         control["trace"])
    print(f"NUMBER {name}: ids agree with the one-shot prefill's in "
          f"{sum(a == b for a, b in zip(ids, control['one_shot_ids']))} of {DECODE}", flush=True)
    return ms, restored, logits


def no_kvcr_run(engine, tokens, slots):
    """The suffix prefilled on the pool's ``slots`` (the engine's own KV) and
    decoded: the ids, each step's logits and the trace."""
    trace = []
    cache = engine.cache_from(slots)
    logits, cache = engine.prefill(tokens[len(slots) * PAGE_TOKENS:], cache)
    trace_kv(trace, cache, len(slots) * PAGE_TOKENS)
    ids, steps = engine.decode(logits, cache, DECODE, trace)
    return ids, steps, trace


def run(n, peer, engine, linker):
    pages = (n - 1) // PAGE_TOKENS
    tokens = prompt(n, n)
    keys = page_keys(tokens, pages)
    slots = list(range(pages))
    # The cold prefill, timed on its second run (the first also builds the
    # kernels and allocations of this length): the TTFT anchor.
    timed(lambda: engine.prefill(tokens))
    (cold_logits, cold_cache), cold_ms = timed(lambda: engine.prefill(tokens))
    one_shot_ids, one_shot_steps = engine.decode(cold_logits, cold_cache, DECODE)
    del cold_cache
    # The no-kvcr control, cold inference as a chunked-prefill engine runs
    # it: the full pages' prefix prefilled on its own, its KV in the pool,
    # the suffix prefilled on it. The restored run computes the same GEMMs
    # over the same cache layout; the one-shot prefill above has other GEMM
    # shapes, so in bf16 its ids may part from both (kvcr not involved).
    _, own = engine.prefill(tokens[:pages * PAGE_TOKENS])
    engine.store(own, pages, slots)
    control_ids, control_steps, control_trace = no_kvcr_run(engine, tokens, slots)
    control = control_steps[0]
    check(f"n={n}: cold ids vary", len(set(control_ids)) > 1, f"{control_ids}")
    # The same computation again: does this device repeat it to the bit?
    _, repeat_steps, repeat_trace = no_kvcr_run(engine, tokens, slots)
    check(f"n={n}: the no-kvcr control run twice gives the same logits, bit for bit",
          diag(f"n={n} no-kvcr control vs the same run again", control_steps, repeat_steps,
               control_trace, repeat_trace))
    diag(f"n={n} one-shot cold prefill vs the chunked control (other GEMM shapes; "
         "not checked)", one_shot_steps, control_steps)
    agree = sum(a == b for a, b in zip(control_ids, one_shot_ids))
    print(f"NUMBER n={n}: the control's ids agree with the one-shot prefill's in "
          f"{agree} of {DECODE}", flush=True)
    reference = {"ids": control_ids, "logits": control_steps, "trace": control_trace,
                 "own": own, "one_shot_ids": one_shot_ids}
    # Negative controls: zeroed or swapped pages must change the logits.
    zeroed = engine.cache_from(slots)
    for layer in range(28):
        k, _ = layer_kv(zeroed, layer)
        k[:, :, :PAGE_TOKENS].zero_()
    bad, _ = engine.prefill(tokens[pages * PAGE_TOKENS:], zeroed)
    del zeroed
    check(f"n={n}: a zeroed page changes the logits", not torch.equal(bad, control))
    swapped_slots = [1, 0] + slots[2:]
    swapped, _ = engine.prefill(tokens[pages * PAGE_TOKENS:], engine.cache_from(swapped_slots))
    check(f"n={n}: the byte check refuses swapped pages",
          not engine.pages_equal(own, pages, swapped_slots),
          f"their logits {'differ' if not torch.equal(swapped, control) else 'are unchanged'}")
    check(f"n={n}: the offload landed", offload(linker, keys, slots))
    # Filler traffic: another prompt's KV takes the slots (the GPU evicted).
    _, filler = engine.prefill(prompt(pages * PAGE_TOKENS + 1, n + 7))
    engine.store(filler, pages, slots)
    ms, restored, logits = replay(engine, linker, f"n={n} local", tokens, keys, slots, [],
                                  reference)
    check(f"n={n} local: first logits equal the control's, bit for bit",
          torch.equal(logits, control))
    print(f"NUMBER n={n} local: {restored * PAGE_TOKENS} of {n} tokens restored, "
          f"{restored * PAGE_TOKENS * 114688} bytes; TTFT {ms:.1f} ms, cold {cold_ms:.1f} ms",
          flush=True)
    print(f"BENCH model.ttft_restore_vs_cold_{n} value={ms:.2f} unit=ms "
          f"anchor={cold_ms:.2f} ratio={ms / cold_ms:.3f}", flush=True)
    if not peer:
        return
    source = subprocess.Popen([sys.executable, __file__, "--source", str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    endpoint = None
    for line in source.stdout:
        if line.startswith("ENDPOINT "):
            endpoint = line.split()[1]
            break
    check(f"n={n}: the source process serves", endpoint is not None)
    if endpoint is None:
        return
    # This engine's store starts empty (a restart): every page comes from
    # the source process.
    linker.reset(int(linker.incarnation) + 1)
    check(f"n={n}: the local store is empty", not linker.stores(NAMESPACE, keys[0]))
    engine.store(filler, pages, slots)
    ms, restored, logits = replay(engine, linker, f"n={n} peer", tokens, keys, slots,
                                  [hint(endpoint, keys)], reference)
    check(f"n={n} peer: first logits equal the control's, bit for bit",
          torch.equal(logits, control))
    print(f"NUMBER n={n} peer: {restored * PAGE_TOKENS} of {n} tokens restored from "
          f"another process; TTFT {ms:.1f} ms, cold {cold_ms:.1f} ms", flush=True)
    print(f"BENCH model.ttft_peer_restore_vs_cold_{n} value={ms:.2f} unit=ms "
          f"anchor={cold_ms:.2f} ratio={ms / cold_ms:.3f}", flush=True)
    source.stdin.close()
    source.wait(timeout=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="3000,16384,32768")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--source", type=int)
    args = parser.parse_args()
    if args.source:
        return source_main(args.source)
    if not torch.cuda.is_available():
        print("model_mode_b: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    lengths = [int(n) for n in args.tokens.split(",")]
    slots = (max(lengths) - 1) // PAGE_TOKENS + 2
    engine = Engine(device, slots)
    linker = linker_for(engine, 2 * slots, not args.no_peer)
    engine.prefill(prompt(512, 1))  # warm-up: kernels, allocator
    for n in lengths:
        run(n, not args.no_peer, engine, linker)
    linker.close()
    import transformers

    print(f"DIAG environment: torch {torch.__version__}, transformers "
          f"{transformers.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name(device)}, CUBLAS_WORKSPACE_CONFIG "
          f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')}", flush=True)
    print(f"DIAG ops torch ran without a deterministic implementation: "
          f"{json.dumps(NONDETERMINISTIC) if NONDETERMINISTIC else 'none'}", flush=True)
    print(f"model_mode_b: {len(FAILED)} checks failed: {FAILED}", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
