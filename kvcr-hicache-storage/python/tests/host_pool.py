"""A host KV pool with the byte arithmetic of SGLang's MHA host pool.

SGLang's real ``MHATokenToKVPoolHost`` imports the engine's CUDA kernels, so
the tests use this stand-in. It keeps the attributes and methods a storage
backend and the cache controller touch (``kv_buffer``, ``layout``,
``page_size``, ``size``, ``layer_num``, ``head_num``, ``head_dim``, ``dtype``;
``get_page_buffer_meta``, ``get_data_page``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page``), with the buffer shapes of SGLang 0.5.23's
``pool_host/mha.py`` for each layout.
"""

from __future__ import annotations

import torch


class MhaHostPool:
    def __init__(self, *, pages, page_size, layer_num, head_num, head_dim,
                 layout="page_first", dtype=torch.bfloat16):
        self.page_size = page_size
        self.page_num = pages
        self.size = pages * page_size
        self.layer_num = layer_num
        self.head_num = head_num
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout = layout
        shapes = {
            "layer_first": (2, layer_num, self.size, head_num, head_dim),
            "page_first": (2, self.size, layer_num, head_num, head_dim),
            "page_first_direct": (2, pages, layer_num, page_size, head_num, head_dim),
            "page_head": (2, pages, head_num, page_size, layer_num, head_dim),
        }
        if layout not in shapes:
            raise ValueError(f"Unsupported layout: {layout}")
        self.kv_buffer = torch.zeros(shapes[layout], dtype=dtype)

    @property
    def page_bytes(self) -> int:
        """K and V of every layer of one page."""
        return 2 * self.layer_num * self.page_size * self.head_num * self.head_dim * self.dtype.itemsize

    def token_indices(self, pages) -> torch.Tensor:
        """The host_indices the controller passes for these host pages."""
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size)
                          for p in pages]).to(torch.int64)

    def get_page_buffer_meta(self, indices):
        """Per-page spans for zero-copy I/O (only the page-major layouts)."""
        if self.layout == "layer_first":
            raise ValueError("this stand-in gives zero-copy spans for page-major layouts")
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs = []
        for token in indices.tolist()[:: self.page_size]:
            k_ptr = base + token * self.layer_num * self.head_num * self.head_dim * item
            ptrs += [k_ptr, k_ptr + v_offset]
        span = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [span] * len(ptrs)

    def _page_view(self, index, buffer=None):
        buffer = self.kv_buffer if buffer is None else buffer
        if self.layout == "layer_first":
            return buffer[:, :, index : index + self.page_size]
        if self.layout == "page_first":
            return buffer[:, index : index + self.page_size]
        page = index // self.page_size
        return buffer[:, page : page + 1]

    def _page_bytes_view(self, page):
        # The same page as raw bytes (random bf16 bit patterns include NaNs;
        # copying them as uint8 keeps every bit).
        return self._page_view(page * self.page_size, self.kv_buffer.view(torch.uint8))

    def get_data_page(self, index, flat=True):
        page = self._page_view(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.page_bytes // self.dtype.itemsize, dtype=self.dtype)

    def set_from_flat_data_page(self, index, data_page):
        view = self._page_view(index)
        view.copy_(data_page.reshape(view.shape))

    def fill_pages(self, pages, seed):
        """Distinct, reproducible bytes in the given host pages."""
        gen = torch.Generator().manual_seed(seed)
        for p in pages:
            view = self._page_bytes_view(p)
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))

    def page_bytes_of(self, page):
        """A copy of one page's bytes, in flat-page order."""
        return self._page_bytes_view(page).flatten().clone()

    def clear_pages(self, pages):
        for p in pages:
            self._page_bytes_view(p).zero_()
