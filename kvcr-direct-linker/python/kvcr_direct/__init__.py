"""kvcr's direct linker (mode B) for Python inference engines.

``kvcr_direct.DirectLinker`` is one engine rank's linker between the engine's
KV pool on the GPU (per-layer K and V torch tensors) and KVCR DRAM, a
rank-local store the linker's runner owns: offload device pages after the
ranks agree, restore them into slots the engine allocated (``load`` after a
preparation, or ``restore_hinted`` straight from the request's context, from
KVCR DRAM or a hinted peer), and the request hooks that number and end each
attempt. Calls return at once; ``poll`` and ``settle`` (which waits with the
GIL released) report what landed. Every refusal is a ``KvcrError`` subclass::

    KvcrError
    +-- LayoutError    the pool's tensors (device, dtype, contiguity, shapes,
    |                  overlap, alignment, sizes)
    +-- NoGpuError     no CUDA driver, or no such device
    +-- CudaError      a driver call failed
    +-- ContractError  the linker contract refused (attempt, slot, claims, ...)
    +-- HintError      a router hint that does not parse
    +-- ArgumentError  an argument of the wrong type or out of range
    +-- RunnerError    the runner (KVCR DRAM, peers) refused or failed
"""

try:
    from kvcr_direct._native import (
        MAX_LAYERS,
        ArgumentError,
        Attempt,
        ContractError,
        CudaError,
        HintError,
        KvcrError,
        LayoutError,
        NoGpuError,
        RequestContext,
        RunnerError,
        agree_restorable_prefix,
        cuda_device_name,
    )
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "kvcr_direct's Rust extension (kvcr_direct._native) is not built or does not "
        "load; build it with `maturin build --release` in kvcr-direct-linker/python "
        f"(cargo xtask python does) and install the wheel: {e}"
    ) from e

from kvcr_direct.linker import (
    Declined,
    DirectLinker,
    Evicted,
    FirstLayerLanded,
    LoadDone,
    OffloadDone,
    Queued,
    RestoreDone,
)
from kvcr_direct.pool import check_pool

__all__ = [
    "MAX_LAYERS",
    "ArgumentError",
    "Attempt",
    "ContractError",
    "CudaError",
    "Declined",
    "DirectLinker",
    "Evicted",
    "FirstLayerLanded",
    "HintError",
    "KvcrError",
    "LayoutError",
    "LoadDone",
    "NoGpuError",
    "OffloadDone",
    "Queued",
    "RequestContext",
    "RestoreDone",
    "RunnerError",
    "agree_restorable_prefix",
    "check_pool",
    "cuda_device_name",
]
