"""Bad input raises a typed exception, never crashes, and is refused twice:
by the package's checks and, on its own, by the extension (called directly,
as code that skipped the package would). CPU tensors in host mode stand in
for the engine's pool, so every check runs on a machine without a GPU."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import kvcr_direct as kd
from kvcr_direct import _native
from pools import HEAD_DIM, KV_HEADS, NAMESPACE, PAGE_TOKENS, SLOTS, buffers, hint

TOKENS = SLOTS * PAGE_TOKENS


def _dtype(k, v):
    k = [torch.zeros_like(t, dtype=torch.float64) for t in k]
    v = [torch.zeros_like(t, dtype=torch.float64) for t in v]
    return k, v, {}


def _mixed_dtype(k, v):
    v[1] = torch.zeros_like(v[1], dtype=torch.float16)
    return k, v, {}


def _not_contiguous(k, v):
    k[1] = torch.zeros(TOKENS, HEAD_DIM, KV_HEADS, dtype=k[1].dtype).transpose(1, 2)
    assert k[1].shape == k[0].shape and not k[1].is_contiguous()
    return k, v, {}


def _layer_shapes(k, v):
    k[1] = torch.zeros(TOKENS, KV_HEADS, HEAD_DIM // 2, dtype=k[1].dtype)
    return k, v, {}


def _aliased(k, v):
    v[0] = k[0]
    return k, v, {}


def _overlapping(k, v):
    backing = torch.zeros(TOKENS + TOKENS // 2, KV_HEADS, HEAD_DIM, dtype=k[0].dtype)
    k[0], v[0] = backing[:TOKENS], backing[TOKENS // 2:]
    return k, v, {}


def _unaligned(k, v):
    flat = torch.zeros(TOKENS * KV_HEADS * HEAD_DIM + 1, dtype=k[0].dtype)
    k[0] = flat[1:].view(TOKENS, KV_HEADS, HEAD_DIM)
    return k, v, {}


def _zero_tokens(k, v):
    k, v = buffers(slots=0)
    return k, v, {}


def _two_dims(k, v):
    k = [t.view(TOKENS, KV_HEADS * HEAD_DIM) for t in k]
    v = [t.view(TOKENS, KV_HEADS * HEAD_DIM) for t in v]
    return k, v, {}


def _too_many_layers(k, v):
    k, v = buffers(layers=kd.MAX_LAYERS + 1, slots=1)
    return k, v, {}


def _count_mismatch(k, v):
    return k, v[:1], {}


def _no_layers(k, v):
    return [], [], {}


def _numpy(k, v):
    return [np.zeros((TOKENS, KV_HEADS, HEAD_DIM), np.float16) for _ in k], v, {}


def _subclass(k, v):
    k[0] = torch.nn.Parameter(k[0], requires_grad=False)
    return k, v, {}


def _page_tokens_zero(k, v):
    return k, v, {"page_tokens": 0}


def _page_tokens_uneven(k, v):
    return k, v, {"page_tokens": 3}


def _page_tokens_absurd(k, v):
    return k, v, {"page_tokens": 1 << 31}


def _span_not_16(k, v):
    k = [torch.zeros(TOKENS, 1, 1, dtype=torch.bfloat16) for _ in k]
    v = [torch.zeros(TOKENS, 1, 1, dtype=torch.bfloat16) for _ in v]
    return k, v, {"page_tokens": 1}


def _store_pages_zero(k, v):
    return k, v, {"store_pages": 0}


def _store_pages_overflow(k, v):
    return k, v, {"store_pages": (1 << 32) - 1}


def _store_pages_not_u32(k, v):
    return k, v, {"store_pages": 1 << 40}


def _tp_rank_out_of_world(k, v):
    return k, v, {"tp_rank": 2, "tp_size": 2}


def _incarnation_zero(k, v):
    return k, v, {"incarnation": 0}


def _peer_not_bool(k, v):
    return k, v, {"peer": "yes"}


def _timeout_nan(k, v):
    return k, v, {"operation_timeout_s": math.nan}


CASES = [
    (_dtype, kd.LayoutError, "not of 1, 2 or 4 bytes"),
    (_mixed_dtype, kd.LayoutError, "every buffer must match"),
    (_not_contiguous, kd.LayoutError, "not contiguous"),
    (_layer_shapes, kd.LayoutError, "every buffer must match"),
    (_aliased, kd.LayoutError, "share memory"),
    (_overlapping, kd.LayoutError, "share memory"),
    (_unaligned, kd.LayoutError, "16-byte aligned"),
    (_zero_tokens, kd.LayoutError, "no bytes"),
    (_two_dims, kd.LayoutError, "kv_heads, head_dim"),
    (_too_many_layers, kd.LayoutError, "one K and one V"),
    (_count_mismatch, kd.LayoutError, "one K and one V"),
    (_no_layers, kd.LayoutError, "one K and one V"),
    (_numpy, kd.LayoutError, "torch.Tensor"),
    (_subclass, kd.LayoutError, "torch.Tensor"),
    (_page_tokens_zero, kd.LayoutError, "page_tokens must be"),
    (_page_tokens_uneven, kd.LayoutError, "whole number"),
    (_page_tokens_absurd, kd.LayoutError, "whole number"),
    (_span_not_16, kd.LayoutError, "multiple of 16"),
    (_store_pages_zero, kd.LayoutError, "store_pages"),
    (_store_pages_overflow, kd.LayoutError, "store_pages"),
    (_store_pages_not_u32, kd.ArgumentError, "store_pages"),
    (_tp_rank_out_of_world, kd.LayoutError, "tp_rank"),
    (_incarnation_zero, kd.ArgumentError, "incarnation"),
    (_peer_not_bool, kd.ArgumentError, "peer"),
    (_timeout_nan, kd.ArgumentError, "operation_timeout_s"),
]


def _build(case):
    k, v = buffers()
    k, v, extra = case(list(k), list(v))
    kwargs = {"page_tokens": PAGE_TOKENS, "store_pages": 8}
    kwargs.update(extra)
    return k, v, kwargs


IDS = [c.__name__.lstrip("_") for c, _, _ in CASES]


@pytest.mark.parametrize("case,error,why", CASES, ids=IDS)
def test_the_package_refuses(case, error, why):
    k, v, kwargs = _build(case)
    with pytest.raises(error, match=why):
        kd.DirectLinker(k, v, host=True, **kwargs)


@pytest.mark.parametrize("case,error,why", CASES, ids=IDS)
def test_the_extension_refuses_on_its_own(case, error, why):
    k, v, kwargs = _build(case)
    with pytest.raises(error, match=why):
        _native.DirectLinker(k, v, device=None, **kwargs)


def test_every_error_is_a_kvcr_error():
    for error in (kd.LayoutError, kd.NoGpuError, kd.CudaError, kd.ContractError,
                  kd.HintError, kd.ArgumentError, kd.RunnerError):
        assert issubclass(error, kd.KvcrError)


def test_cpu_tensors_are_refused_for_a_gpu_pool():
    k, v = buffers()
    with pytest.raises(kd.LayoutError, match="cuda"):
        kd.DirectLinker(k, v, page_tokens=PAGE_TOKENS, store_pages=8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_no_gpu_is_a_typed_error_not_a_crash():
    with pytest.raises(kd.NoGpuError):
        kd.cuda_device_name(0)
    # The extension opens the device before it reads the tensors: without a
    # driver nothing is looked at, and the answer is NoGpuError.
    k, v = buffers()
    with pytest.raises(kd.NoGpuError):
        _native.DirectLinker(k, v, page_tokens=PAGE_TOKENS, store_pages=8, device=0)


def test_an_absurd_device_ordinal_is_an_argument_error():
    k, v = buffers()
    with pytest.raises(kd.ArgumentError):
        _native.DirectLinker(k, v, page_tokens=PAGE_TOKENS, store_pages=8, device=1 << 40)
    with pytest.raises(kd.ArgumentError):
        kd.cuda_device_name(-1)


@pytest.fixture
def linker():
    k, v = buffers()
    linker = kd.DirectLinker(k, v, page_tokens=PAGE_TOKENS, store_pages=8, host=True)
    yield linker
    linker.close()


def test_bad_keys_slots_and_namespaces(linker):
    bad = [
        (lambda: linker.offload(NAMESPACE, [(1, -1)]), kd.ArgumentError),
        (lambda: linker.offload(NAMESPACE, [(1 << 64, 0)]), kd.ArgumentError),
        (lambda: linker.offload(NAMESPACE, [("1", 0)]), kd.ArgumentError),
        (lambda: linker.offload(NAMESPACE, [(1, True)]), kd.ArgumentError),
        (lambda: linker.offload(NAMESPACE, [(1,)]), kd.ArgumentError),
        (lambda: linker.offload(-1, [(1, 0)]), kd.ArgumentError),
        (lambda: linker.offload(NAMESPACE, [(1, SLOTS)]), kd.ContractError),
        (lambda: linker.stores(NAMESPACE, 1.5), kd.ArgumentError),
        (lambda: linker.begin(7, namespace=NAMESPACE, device_prefix_pages=0, tail=[1]),
         kd.ArgumentError),
        (lambda: linker.begin("r", namespace=NAMESPACE, device_prefix_pages=-1, tail=[1]),
         kd.ArgumentError),
        (lambda: linker.begin("r", namespace=NAMESPACE, device_prefix_pages=0, tail=[None]),
         kd.ArgumentError),
        (lambda: linker.preparation(("r", 1)), kd.ArgumentError),
        (lambda: linker.request_finished("r"), kd.ArgumentError),
        (lambda: linker.reset(0), kd.ArgumentError),
        (lambda: linker.settle(-1), kd.ArgumentError),
        (lambda: linker.settle(math.nan), kd.ArgumentError),
        (lambda: linker.settle("1"), kd.ArgumentError),
    ]
    for call, error in bad:
        with pytest.raises(error):
            call()
    # Nothing was accepted by any of them.
    assert linker.accounting() == {"claims_held": 0, "transfers_in_flight": 0, "live_attempts": 0}


def test_restore_slots_must_match_the_tail(linker):
    context = linker.begin("r", namespace=NAMESPACE, device_prefix_pages=0, tail=[1, 2])
    for slots in ([0], [0, 1, 2], [3, 3], [0, SLOTS]):
        with pytest.raises(kd.ContractError):
            linker.restore_hinted(context, slots)
    with pytest.raises(kd.ArgumentError):
        linker.restore_hinted(context, [0, -1])
    with pytest.raises(kd.ArgumentError):
        linker.restore_hinted("not a context", [0, 1])
    assert linker.accounting()["transfers_in_flight"] == 0


@pytest.mark.parametrize(
    "text",
    [
        hint("http://127.0.0.1:5000", [1, 2]),
        hint("tcp://", [1, 2]),
        hint("tcp://127.0.0.1:5000", []),
        json.dumps({"source_control_endpoint": "ftp://host:1", "block_hashes": [1]}),
        json.dumps({"source_control_endpoint": "tcp://127.0.0.1:1", "block_hashes": []}),
        "not json",
        "[]",
    ],
)
def test_bad_hint_endpoints_are_hint_errors(linker, text):
    with pytest.raises(kd.HintError):
        linker.begin("r", namespace=NAMESPACE, device_prefix_pages=0, tail=[1], hints=[text])


def test_a_hint_that_is_not_text_is_an_argument_error(linker):
    with pytest.raises(kd.ArgumentError):
        linker.begin("r", namespace=NAMESPACE, device_prefix_pages=0, tail=[1], hints=[{"a": 1}])


def test_a_closed_linker_refuses_every_call(linker):
    linker.close()
    with pytest.raises(kd.KvcrError, match="closed"):
        linker.poll()
    with pytest.raises(kd.KvcrError, match="closed"):
        linker.offload(NAMESPACE, [(1, 0)])
