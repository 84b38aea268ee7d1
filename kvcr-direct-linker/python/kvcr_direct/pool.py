"""The engine's KV pool as torch tensors, checked before anything reaches the
extension (which checks the same again, reading the tensors itself).

A pool is one K and one V tensor per layer, all on one CUDA device (or all on
the CPU for a pool in host memory), one dtype of 1, 2 or 4 bytes, one shape
``(*token_dims, kv_heads, head_dim)`` with positive dimensions, contiguous,
inside its own storage, 16-byte aligned, no two sharing a byte, and the
tokens a whole number of pages.
"""

from __future__ import annotations

from kvcr_direct._native import MAX_LAYERS, LayoutError


def _as_list(buffers, what):
    if isinstance(buffers, (str, bytes)) or not hasattr(buffers, "__len__"):
        raise LayoutError(f"KV pool: {what} must be a sequence of tensors")
    return list(buffers)


def _extent(tensor):
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def check_pool(k_buffers, v_buffers, page_tokens, host=False):
    """Checks the pool (see the module docs) and returns the CUDA ordinal it
    lives on, or ``None`` for a host pool. Raises ``LayoutError``."""
    import torch

    k, v = _as_list(k_buffers, "k_buffers"), _as_list(v_buffers, "v_buffers")
    if not k or len(k) != len(v) or len(k) > MAX_LAYERS:
        raise LayoutError(
            f"KV pool: need one K and one V buffer per layer, 1..={MAX_LAYERS} layers; "
            f"got {len(k)} K and {len(v)} V"
        )
    if type(page_tokens) is not int or page_tokens <= 0:
        raise LayoutError(f"KV pool: page_tokens must be a positive int, got {page_tokens!r}")
    named = [(f"k_buffers[{i}]", t) for i, t in enumerate(k)]
    named += [(f"v_buffers[{i}]", t) for i, t in enumerate(v)]
    for name, t in named:
        if type(t) is not torch.Tensor:
            raise LayoutError(f"KV pool: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise LayoutError(f"KV pool: {name} must have the strided layout")
    first = k[0]
    want = "cpu" if host else "cuda"
    if first.device.type != want:
        hint = "" if host else " (host=True for a pool in host memory)"
        raise LayoutError(f"KV pool: k_buffers[0] is on {first.device}; need {want}{hint}")
    extents = []
    for name, t in named:
        if t.device != first.device:
            raise LayoutError(f"KV pool: {name} is on {t.device}, k_buffers[0] on {first.device}")
        if t.dtype != first.dtype or tuple(t.shape) != tuple(first.shape):
            raise LayoutError(
                f"KV pool: {name} is {t.dtype} {tuple(t.shape)}, k_buffers[0] is "
                f"{first.dtype} {tuple(first.shape)}: every buffer must match"
            )
        if not t.is_contiguous():
            raise LayoutError(
                f"KV pool: {name} is not contiguous (shape {tuple(t.shape)}, "
                f"strides {t.stride()})"
            )
        start, end = _extent(t)
        if start == end:
            raise LayoutError(f"KV pool: {name} has no bytes")
        if start % 16:
            raise LayoutError(f"KV pool: {name} is not 16-byte aligned")
        storage = t.untyped_storage()
        if start < storage.data_ptr() or end > storage.data_ptr() + storage.nbytes():
            raise LayoutError(f"KV pool: {name} reaches outside its own storage")
        extents.append((start, end, name))
    extents.sort()
    for (_, a_end, a), (b_start, _, b) in zip(extents, extents[1:]):
        if a_end > b_start:
            raise LayoutError(f"KV pool: {a} and {b} share memory")
    if first.element_size() not in (1, 2, 4):
        raise LayoutError(f"KV pool: dtype {first.dtype} is not of 1, 2 or 4 bytes")
    if first.dim() < 3:
        raise LayoutError(
            "KV pool: a buffer must be shaped (*token_dims, kv_heads, head_dim), "
            f"got {tuple(first.shape)}"
        )
    tokens = first.numel() // (first.shape[-1] * first.shape[-2])
    if tokens % page_tokens:
        raise LayoutError(
            f"KV pool: {tokens} tokens per buffer are not a whole number of "
            f"{page_tokens}-token pages"
        )
    return None if host else first.device.index if first.device.index is not None else 0
