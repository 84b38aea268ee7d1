"""The reference engine's model: Hugging Face ``transformers``' Qwen3 built
from a config (random weights from a fixed seed; nothing is downloaded),
greedy decoding over an explicit KV cache, and the KV moved between the
model's cache and an engine's paged KV pool, head-split by TP rank.

Random weights are enough for the check these harnesses make: a restored KV
cache must give the same computation as the engine's own. The cache holds
keys after the norm and RoPE, so a page's bytes depend on its position: a page
restored at the wrong place changes the logits.

Two geometries: ``small`` (CI on CPU, float32, a few seconds) and
``qwen3-0.6b`` (Qwen3-0.6B's: 28 layers, 16 query heads, 8 KV heads,
head_dim 128, bf16 on the GPU).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import struct

# Bit-for-bit comparisons between two runs of one computation need cuBLAS's
# deterministic workspace (set before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import divergence  # noqa: E402

# Weights drawn 5x wider than transformers' default (0.02): with the default a
# random model repeats one token; with these its greedy ids vary.
GEOMETRIES = {
    # Small enough for CI on two CPU cores; 4 KV heads so TP=2 splits them.
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, max_position_embeddings=4096, initializer_range=0.1),
    "qwen3-0.6b": dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40_960, initializer_range=0.1),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def repeatable_attention():
    """Switches cuDNN's SDPA backend off, process-wide.

    On an H100 (torch 2.11, CUDA 13) the same one-query decode run twice
    under torch's default backend choice parted at step 2 inside attention.
    Pinned to flash or to math it was bit-equal over 24 steps, and
    memory-efficient attention cannot run that shape, so the default was
    cuDNN's, whose attention outputs also differed between two pinned runs
    (``determinism_probe.py``; ``use_deterministic_algorithms`` does not
    cover SDPA's forward). Memory-efficient attention stays: it takes the
    masked prefills of long prompts, where math would hold every score.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


class ReferenceModel:
    """A Qwen3 causal LM with random weights from ``seed``, in eval mode."""

    def __init__(self, geometry, seed, device="cpu", dtype="float32"):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        self.geometry = geometry
        self.config = Qwen3Config(**{"rope_theta": 1_000_000.0, "tie_word_embeddings": True,
                                     **GEOMETRIES[geometry]})
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        if self.device.type == "cuda":
            # Deterministic kernels and no TF32: the same inputs give the
            # same bits in every engine process and thread.
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            repeatable_attention()
        if self.device.type == "cpu":
            # Several engine processes share the cores: one thread each, or
            # their thread pools spin against each other (30x slower on two).
            torch.set_num_threads(1)
        # The same seed gives the same weights in every engine process.
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(self.config)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.layers = self.config.num_hidden_layers
        self.kv_heads = self.config.num_key_value_heads
        self.head_dim = self.config.head_dim
        # transformers renamed ``past_key_values`` to ``cache``; the GPU
        # host's version may be either side of that.
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        # The ops torch ran without a deterministic implementation, and each
        # module's output for a traced run.
        self.nondeterminism = divergence.Nondeterminism()
        self.ops = divergence.OpTrace(self.model)

    # -- the cache -------------------------------------------------------------

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    def cache_from(self, keys, values):
        """A cache holding per-layer ``keys``/``values`` ([1, heads, tokens,
        dim] each), copied contiguous, as every path builds it."""
        cache = self.new_cache()
        for layer, (k, v) in enumerate(zip(keys, values)):
            cache.update(k.contiguous().clone(), v.contiguous().clone(), layer)
        return cache

    @staticmethod
    def layer_kv(cache, layer):
        """Layer ``layer``'s (keys, values) of a cache, [1, heads, tokens, dim]."""
        if hasattr(cache, "layers"):
            return cache.layers[layer].keys, cache.layers[layer].values
        return cache.key_cache[layer], cache.value_cache[layer]

    def kv_of(self, cache, tokens):
        """Per-layer keys and values of the first ``tokens`` positions."""
        keys, values = [], []
        for layer in range(self.layers):
            k, v = self.layer_kv(cache, layer)
            keys.append(k[:, :, :tokens].contiguous().clone())
            values.append(v[:, :, :tokens].contiguous().clone())
        return keys, values

    # -- running ---------------------------------------------------------------

    @torch.no_grad()
    def forward(self, ids, cache, trace=None):
        """One forward over ``ids`` extending ``cache``; the last position's
        logits (float32, on the CPU) and the cache. With ``trace`` (a list),
        the digests of the KV it appended (``divergence.record_forward``)."""
        start = cache.get_seq_length()
        inputs = torch.tensor([ids], dtype=torch.long, device=self.device)
        if trace is not None:
            self.ops.active = []
        try:
            with self.nondeterminism:
                out = self.model(input_ids=inputs, use_cache=True, **{self.cache_arg: cache})
        finally:
            ops, self.ops.active = self.ops.active, None
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        divergence.record_forward(trace, cache, self.layer_kv, self.layers, start, ops)
        return out.logits[0, -1].float().cpu(), cache

    def generate(self, ids, cache, new_tokens, trace=None):
        """Greedy decoding: prefill ``ids`` on ``cache`` (None: an empty one),
        then ``new_tokens`` tokens. Returns (token ids, their logits
        [new_tokens, vocab], the cache)."""
        cache = self.new_cache() if cache is None else cache
        logits, cache = self.forward(ids, cache, trace)
        out_ids, out_logits = [], []
        for step in range(new_tokens):
            out_logits.append(logits)
            token = int(torch.argmax(logits))
            out_ids.append(token)
            if step + 1 < new_tokens:
                logits, cache = self.forward([token], cache, trace)
        logits = torch.stack(out_logits) if out_logits else torch.empty(0, logits.numel())
        return out_ids, logits, cache

    def generate_chunked(self, ids, prefix, new_tokens, trace=None):
        """Cold inference as a chunked-prefill engine computes it: the first
        ``prefix`` tokens prefilled on an empty cache, their KV copied into a
        fresh cache (``cache_from``, as a restored or own-KV prefix is), the
        rest prefilled on it, then ``new_tokens`` greedy tokens. The same
        GEMM shapes, cache layout and code path as a restored prefix's run,
        which a one-shot prefill of every token does not share. Returns
        (ids, logits, cache, the prefix's (keys, values))."""
        if not prefix:
            return (*self.generate(ids, None, new_tokens, trace), ([], []))
        _, _, cache = self.generate(ids[:prefix], None, 0)
        own = self.kv_of(cache, prefix)
        del cache
        out_ids, logits, cache = self.generate(ids[prefix:], self.cache_from(*own), new_tokens,
                                               trace)
        return out_ids, logits, cache, own


def prompt(seed, n, vocab):
    """A synthetic prompt of ``n`` token ids (distinct per seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


# -- pages --------------------------------------------------------------------


def page_hashes(tokens, page_tokens):
    """Each full page's key as a u64: SHA-256 chained over the prior page's
    digest and the page's tokens (little-endian u32), its first 8 bytes big
    endian (SGLang's storage key, as a router's block hash)."""
    out, prior = [], b""
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        h = hashlib.sha256(prior)
        h.update(struct.pack(f"<{page_tokens}I", *tokens[start:start + page_tokens]))
        prior = h.digest()
        out.append(int.from_bytes(prior[:8], "big"))
    return out


def head_slice(kv_heads, tp, rank):
    """The KV heads rank ``rank`` of ``tp`` holds (SGLang splits them evenly)."""
    if kv_heads % tp:
        raise ValueError(f"{kv_heads} KV heads do not split over TP={tp}")
    per = kv_heads // tp
    return slice(rank * per, (rank + 1) * per)


def write_pages(pool, host_pages, keys, values, heads, page_tokens):
    """Writes the KV of ``len(host_pages)`` pages (tokens from 0) into a
    ``page_first`` host pool (``kv_buffer`` [2, slots, layer, head, dim]),
    the heads of ``heads`` only."""
    for i, page in enumerate(host_pages):
        src = slice(i * page_tokens, (i + 1) * page_tokens)
        dst = slice(page * page_tokens, (page + 1) * page_tokens)
        for layer, (k, v) in enumerate(zip(keys, values)):
            # [1, heads, tokens, dim] -> [tokens, heads, dim]
            to = dict(device=pool.kv_buffer.device, dtype=pool.dtype)
            pool.kv_buffer[0, dst, layer] = k[0, heads, src].permute(1, 0, 2).to(**to)
            pool.kv_buffer[1, dst, layer] = v[0, heads, src].permute(1, 0, 2).to(**to)


def read_pages(pools, host_pages, layers, page_tokens, device, dtype):
    """The per-layer keys and values of ``host_pages`` (in order, tokens from
    0), the ranks' head shards concatenated in rank order."""
    slots = torch.cat([torch.arange(p * page_tokens, (p + 1) * page_tokens) for p in host_pages])
    keys, values = [], []
    for layer in range(layers):
        # Each pool: [tokens, heads_of_rank, dim]; heads concatenated.
        k = torch.cat([pool.kv_buffer[0, slots, layer] for pool in pools], dim=1)
        v = torch.cat([pool.kv_buffer[1, slots, layer] for pool in pools], dim=1)
        keys.append(k.permute(1, 0, 2).unsqueeze(0).to(device=device, dtype=dtype))
        values.append(v.permute(1, 0, 2).unsqueeze(0).to(device=device, dtype=dtype))
    return keys, values


def page_digests(pool, host_pages):
    """SHA-256 of each host page's bytes (K and V of every layer)."""
    out = []
    for page in host_pages:
        data = pool.page_bytes_of(page).cpu().numpy().tobytes()
        out.append(hashlib.sha256(data).hexdigest())
    return out


def max_abs_diff(a, b):
    """The largest absolute difference of two logit tensors (inf where one is
    NaN and the other not)."""
    if a.shape != b.shape:
        return float("inf")
    diff = (a - b).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    return float(diff.max()) if diff.numel() else 0.0
