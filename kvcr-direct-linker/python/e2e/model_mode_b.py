"""Mode B under a real transformer, on a GPU (issue 41): Hugging Face's
``Qwen3ForCausalLM`` with Qwen3-0.6B's geometry (28 layers, 8 KV heads,
head_dim 128, bf16; weights from a fixed seed, nothing downloaded) whose KV
cache lives in a paged pool of per-layer K/V tensors that ``kvcr_direct``
offloads to KVCR DRAM and restores from it, or from a peer process's KVCR
DRAM on a router hint.

For each prompt length: a cold prefill and 16 greedy tokens; the no-kvcr
control, which prefills the same suffix on the engine's own cache of the
full pages and decodes 16 tokens (what an engine with prefix caching
computes); the engine's pages offloaded, then overwritten by a filler
prompt's KV (the GPU evicted them); the prompt replayed with its full pages
restored into the pool, the rest prefilled, 16 tokens decoded. Checks
(``CHECK PASS|FAIL``): the cold ids vary; every full page but the last
token's is restored; each restored page's bytes equal the engine's own KV;
the first logits equal the control's bit for bit; a zeroed page changes
them; the byte check refuses swapped pages; the first 8 ids, and all 16,
equal the control's.
Whether they also equal the one-shot cold prefill's is printed, with the
control's own agreement beside it: in bf16 a prompt prefilled in two chunks
may round differently from one prefilled at once (kvcr not involved). (Swapped pages leave the logits as they
were: attention over the cached keys and values is a sum over the set, each
key rotated for its position before it was cached; the byte comparison is
what catches them.) Time to first token, restore against cold
prefill, prints as ``BENCH model.ttft_restore_vs_cold_<n>`` (local) and
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

# Two runs of one computation must give the same bits: cuBLAS's deterministic
# workspace (set before CUDA starts) and deterministic kernels.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

PAGE_TOKENS = 16
NAMESPACE = 41
DECODE = 16  # the ids checked; the first 8 are also checked on their own
FIRST_IDS = 8
FAILED = []


def check(what, ok, detail=""):
    print(f"CHECK {'PASS' if ok else 'FAIL'} {what} ({detail})", flush=True)
    if not ok:
        FAILED.append(what)


def build_model(device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False

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


class Engine:
    """The model and its paged KV pool (one K and one V tensor per layer,
    ``(slots * PAGE_TOKENS, kv_heads, head_dim)``)."""

    def __init__(self, device, slots):
        self.device = device
        self.model = build_model(device)
        shape = (slots * PAGE_TOKENS, 8, 128)
        self.k = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(28)]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(28)]

    @torch.no_grad()
    def prefill(self, ids, cache=None):
        from transformers.cache_utils import DynamicCache

        cache = cache if cache is not None else DynamicCache()
        start = cache.get_seq_length()
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=ids.to(self.device).unsqueeze(0), past_key_values=cache,
            position_ids=positions, use_cache=True,
        )
        return out.logits[0, -1].float(), out.past_key_values

    @torch.no_grad()
    def decode(self, logits, cache, n):
        ids = [int(logits.argmax())]
        for _ in range(n - 1):
            logits, cache = self.prefill(torch.tensor([ids[-1]]), cache)
            ids.append(int(logits.argmax()))
        return ids

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
    _, cache = engine.prefill(tokens)
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


def replay(engine, linker, name, tokens, keys, slots, hints, cold_ids, cold_cache,
           one_shot_ids):
    """Restores the prompt's pages into ``slots`` and decodes; returns the
    TTFT in ms and the restored pages."""
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
    check(f"{name}: every full page restored", restored == pages, f"{restored} of {pages}")
    check(f"{name}: restored pages equal the engine's own KV",
          engine.pages_equal(cold_cache, restored, slots), f"{restored} pages")
    ids = engine.decode(logits, cache, DECODE)
    check(f"{name}: the first {FIRST_IDS} ids equal the no-kvcr control's",
          ids[:FIRST_IDS] == cold_ids[:FIRST_IDS], f"{ids[:FIRST_IDS]} vs {cold_ids[:FIRST_IDS]}")
    check(f"{name}: {DECODE} ids equal the no-kvcr control's", ids == cold_ids,
          f"{ids} vs {cold_ids}")
    print(f"NUMBER {name}: ids agree with the one-shot prefill's in "
          f"{sum(a == b for a, b in zip(ids, one_shot_ids))} of {DECODE}", flush=True)
    return ms, restored, logits


def run(n, peer, engine, linker):
    device = engine.device
    pages = (n - 1) // PAGE_TOKENS
    tokens = prompt(n, n)
    keys = page_keys(tokens, pages)
    slots = list(range(pages))
    # The cold prefill, timed on its second run (the first also builds the
    # kernels and allocations of this length).
    timed(lambda: engine.prefill(tokens))
    (cold_logits, cold_cache), cold_ms = timed(lambda: engine.prefill(tokens))
    one_shot_ids = engine.decode(cold_logits, cold_cache, DECODE)
    check(f"n={n}: cold ids vary", len(set(one_shot_ids)) > 1, f"{one_shot_ids}")
    # The control: the same suffix prefilled on the engine's own cache.
    engine.store(cold_cache, pages, slots)
    control, control_cache = engine.prefill(tokens[pages * PAGE_TOKENS:],
                                            engine.cache_from(slots))
    cold_ids = engine.decode(control, control_cache, DECODE)
    agree = sum(a == b for a, b in zip(cold_ids, one_shot_ids))
    print(f"NUMBER n={n}: the control's ids agree with the one-shot prefill's in "
          f"{agree} of {DECODE}", flush=True)
    # Negative controls: zeroed or swapped pages must change the logits.
    zeroed = engine.cache_from(slots)
    for layer in range(28):
        k, _ = layer_kv(zeroed, layer)
        k[:, :, :PAGE_TOKENS].zero_()
    bad, _ = engine.prefill(tokens[pages * PAGE_TOKENS:], zeroed)
    check(f"n={n}: a zeroed page changes the logits", not torch.equal(bad, control))
    swapped_slots = [1, 0] + slots[2:]
    swapped, _ = engine.prefill(tokens[pages * PAGE_TOKENS:], engine.cache_from(swapped_slots))
    check(f"n={n}: the byte check refuses swapped pages",
          not engine.pages_equal(cold_cache, pages, swapped_slots),
          f"their logits {'differ' if not torch.equal(swapped, control) else 'are unchanged'}")
    check(f"n={n}: the offload landed", offload(linker, keys, slots))
    # Filler traffic: another prompt's KV takes the slots (the GPU evicted).
    _, filler = engine.prefill(prompt(pages * PAGE_TOKENS + 1, n + 7))
    engine.store(filler, pages, slots)
    ms, restored, logits = replay(engine, linker, f"n={n} local", tokens, keys, slots, [],
                                  cold_ids, cold_cache, one_shot_ids)
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
                                  [hint(endpoint, keys)], cold_ids, cold_cache, one_shot_ids)
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
    print(f"model_mode_b: {len(FAILED)} checks failed: {FAILED}", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
