"""What only a GPU machine can show (marked `gpu`; with KVCR_TEST_GPU=1 these
fail when no GPU is found): the extension itself refuses a pool that is not
on the device it opened, and the device opens by name."""

from __future__ import annotations

import pytest

import kvcr_direct as kd
from kvcr_direct import _native
from pools import PAGE_TOKENS, buffers, gpu


@pytest.mark.gpu
def test_the_device_opens_and_a_missing_one_is_a_typed_error():
    gpu()
    assert kd.cuda_device_name(0)
    with pytest.raises(kd.NoGpuError):
        kd.cuda_device_name(4096)


@pytest.mark.gpu
def test_the_extension_refuses_cpu_tensors_for_a_gpu_pool():
    gpu()
    k, v = buffers()
    with pytest.raises(kd.LayoutError, match="must be on cuda:0"):
        _native.DirectLinker(k, v, page_tokens=PAGE_TOKENS, store_pages=8, device=0)


@pytest.mark.gpu
def test_a_cuda_pool_registers_its_layout():
    device = gpu()
    k, v = buffers(device)
    linker = kd.DirectLinker(k, v, page_tokens=PAGE_TOKENS, store_pages=8)
    assert linker.layout["device"] == "cuda:0"
    assert linker.layout["device_pages"] == k[0].shape[0] // PAGE_TOKENS
    linker.close()
