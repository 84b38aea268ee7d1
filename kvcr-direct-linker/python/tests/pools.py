"""KV pools for the tests: per-layer K and V tensors, pages of distinct
bytes, and the router hints a test hands to ``begin``."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

# A small geometry: 2 layers, 4-token pages, 2 KV heads of 16 bf16 elements
# (a span is 4 * 2 * 16 * 2 = 256 bytes), 8 page slots per buffer.
LAYERS, PAGE_TOKENS, KV_HEADS, HEAD_DIM, SLOTS = 2, 4, 2, 16, 8
DTYPE = torch.bfloat16
NAMESPACE = 7


def gpu():
    """The CUDA device the GPU tests use. With ``KVCR_TEST_GPU=1`` a missing
    GPU fails the test; without it, the test is skipped."""
    if os.environ.get("KVCR_TEST_GPU") == "1":
        if not torch.cuda.is_available():
            pytest.fail("KVCR_TEST_GPU=1 but torch finds no CUDA GPU")
        return torch.device("cuda", 0)
    pytest.skip("GPU test: set KVCR_TEST_GPU=1 on a GPU machine")


def buffers(device="cpu", layers=LAYERS, slots=SLOTS, dtype=DTYPE):
    """Zeroed K and V tensors, ``(tokens, kv_heads, head_dim)`` as SGLang
    shapes them."""
    shape = (slots * PAGE_TOKENS, KV_HEADS, HEAD_DIM)
    k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    return k, v


def raw(tensor):
    """A tensor's bytes as a flat uint8 view (shares its memory)."""
    return tensor.view(-1).view(torch.uint8)


def span_bytes():
    return PAGE_TOKENS * KV_HEADS * HEAD_DIM * torch.tensor([], dtype=DTYPE).element_size()


def page(tensor, slot):
    """The bytes of ``slot`` in one K or V buffer."""
    span = span_bytes()
    return raw(tensor)[slot * span:(slot + 1) * span]


def fill(k, v, slot, seed):
    """Writes distinct random bytes into ``slot`` of every buffer, and waits
    for the writes: the linker copies on its own CUDA stream, so an engine's
    pages must be written before it offloads them."""
    gen = torch.Generator().manual_seed(seed)
    for t in k + v:
        data = torch.randint(0, 256, (span_bytes(),), dtype=torch.uint8, generator=gen)
        page(t, slot).copy_(data.to(t.device))
    if k[0].device.type == "cuda":
        torch.cuda.synchronize(k[0].device)


def page_bytes(k, v, slot):
    """Every span of ``slot`` (L0.K, L0.V, L1.K, ...) as bytes on the CPU."""
    return b"".join(bytes(page(t, slot).cpu().numpy()) for pair in zip(k, v) for t in pair)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hint(endpoint, keys):
    """A router's ``kv.fetch@1.0`` envelope naming ``endpoint`` for ``keys``."""
    return json.dumps({
        "protocol_version": "0.1",
        "message_id": "m-1",
        "actions": [{
            "action_id": "a-1",
            "action_type": "kv.fetch",
            "action_version": "1.0",
            "payload": {
                "source_control_endpoint": endpoint,
                "block_hashes": list(keys),
                "mode": "copy",
            },
        }],
    })


DEVICES = [
    pytest.param("cpu", id="host"),
    pytest.param("cuda", id="gpu", marks=pytest.mark.gpu),
]

GUARD = 0xA5


class Pool:
    """The engine's pool on ``device`` ("cpu" for a host pool, "cuda" for
    the GPU): each K/V buffer is the middle of a larger tensor whose first and
    last page are guard bytes, so a write outside the pool shows."""

    def __init__(self, device, layers=LAYERS, slots=SLOTS):
        self.device = gpu() if device == "cuda" else torch.device("cpu")
        tokens = slots * PAGE_TOKENS
        self.backing = []
        self.k, self.v = [], []
        for _ in range(2 * layers):
            backing = torch.empty(
                tokens + 2 * PAGE_TOKENS, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=self.device
            )
            raw(backing).fill_(GUARD)
            inner = backing[PAGE_TOKENS:PAGE_TOKENS + tokens]
            raw(inner).zero_()
            self.backing.append(backing)
        self.k = [b[PAGE_TOKENS:PAGE_TOKENS + tokens] for b in self.backing[0::2]]
        self.v = [b[PAGE_TOKENS:PAGE_TOKENS + tokens] for b in self.backing[1::2]]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def host(self):
        return self.device.type == "cpu"

    def linker(self, **kwargs):
        import kvcr_direct

        kwargs.setdefault("page_tokens", PAGE_TOKENS)
        kwargs.setdefault("store_pages", 16)
        return kvcr_direct.DirectLinker(self.k, self.v, host=self.host, **kwargs)

    def fill(self, slot, seed):
        fill(self.k, self.v, slot, seed)

    def page(self, slot):
        return page_bytes(self.k, self.v, slot)

    def guards_intact(self):
        span = span_bytes()
        for b in self.backing:
            r = raw(b).cpu()
            if not (bool((r[:span] == GUARD).all()) and bool((r[-span:] == GUARD).all())):
                return False
        return True
