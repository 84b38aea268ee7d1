"""``DirectLinker``: one rank's direct linker over the engine's KV pool, and
what it reports (events as frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcr_direct import _native
from kvcr_direct.pool import check_pool


@dataclass(frozen=True)
class OffloadDone:
    """An offload landed (outcomes come in submission order)."""

    ticket: int
    success: bool


@dataclass(frozen=True)
class LoadDone:
    """A ``load`` landed; ``success`` means every page is on the device."""

    attempt: _native.Attempt
    ticket: int
    success: bool


@dataclass(frozen=True)
class RestoreDone:
    """A ``restore_hinted`` landed: its first ``restored`` of ``pages`` pages
    are on the device, byte exact; the engine recomputes the rest."""

    attempt: _native.Attempt
    ticket: int
    restored: int
    pages: int


@dataclass(frozen=True)
class FirstLayerLanded:
    """A restore's or load's first layer is on the GPU for its first
    ``pages`` pages (copied first from KVCR DRAM, or by a same-host peer in
    one hop), ahead of the rest: layer 0 of those pages may start. Its
    ``RestoreDone`` or ``LoadDone`` (which always follows) says which pages
    landed byte exact; work on a page it does not count is thrown away."""

    attempt: _native.Attempt
    ticket: int
    pages: int


@dataclass(frozen=True)
class Evicted:
    """KVCR DRAM evicted pages: ``(namespace, key)`` pairs."""

    incarnation: int
    tier: str
    keys: list


@dataclass(frozen=True)
class Queued:
    """An offload was accepted; its ``OffloadDone`` carries ``ticket``."""

    ticket: int


@dataclass(frozen=True)
class Declined:
    """An offload was declined (``over_capacity`` or ``unhealthy``); nothing
    changed and the engine keeps the pages."""

    reason: str


_EVENTS = {
    "offload_done": OffloadDone,
    "load_done": LoadDone,
    "restore_done": RestoreDone,
    "first_layer_landed": FirstLayerLanded,
    "evicted": Evicted,
}


def _events(raw):
    return [_EVENTS[e.pop("kind")](**e) for e in raw]


class DirectLinker:
    """One rank's direct linker (mode B) over the engine's KV pool.

    ``k_buffers[l]`` and ``v_buffers[l]`` are layer ``l``'s K and V tensors,
    each contiguous and shaped ``(*token_dims, kv_heads, head_dim)`` (SGLang's
    ``(tokens, heads, head_dim)``, or ``(pages, page_tokens, heads,
    head_dim)``); page slot ``s`` is tokens ``s * page_tokens`` onwards. They
    must be CUDA tensors on one device, or CPU tensors with ``host=True``.
    ``store_pages`` pages of KVCR DRAM hold what is offloaded. ``peer=True``
    joins the peer protocol on loopback (hinted restores from another
    process's KVCR DRAM; ``endpoint`` is what hints name).

    The engine's promises: the tensors are never resized or re-pointed while
    the linker lives (it holds a reference to each); a page is written before
    it is offloaded (the linker copies on its own CUDA stream, so synchronize
    the engine's stream first); and a slot named by an accepted offload, load
    or restore is left alone until its event arrives.
    """

    def __init__(
        self,
        k_buffers,
        v_buffers,
        *,
        page_tokens,
        store_pages,
        tp_rank=0,
        tp_size=1,
        operation_timeout_s=30.0,
        incarnation=None,
        peer=False,
        peer_tls=None,
        peer_secret=None,
        prefault=False,
        host=False,
    ):
        device = check_pool(k_buffers, v_buffers, page_tokens, host=host)
        self._native = _native.DirectLinker(
            list(k_buffers),
            list(v_buffers),
            page_tokens=page_tokens,
            store_pages=store_pages,
            device=device,
            tp_rank=tp_rank,
            tp_size=tp_size,
            operation_timeout_s=operation_timeout_s,
            incarnation=incarnation,
            peer=peer,
            peer_tls=peer_tls,
            peer_secret=peer_secret,
            prefault=prefault,
        )

    @classmethod
    def from_fused(cls, kv_buffers, **kwargs):
        """A linker over per-layer fused buffers (vLLM's layout): layer
        ``l``'s tensor is shaped ``(2, *token_dims, kv_heads, head_dim)``,
        K at ``[0]`` and V at ``[1]``."""
        import torch

        if isinstance(kv_buffers, (str, bytes)) or not hasattr(kv_buffers, "__len__"):
            raise _native.LayoutError("KV pool: kv_buffers must be a sequence of tensors")
        layers = list(kv_buffers)
        for i, t in enumerate(layers):
            if type(t) is not torch.Tensor or t.dim() < 1 or t.shape[0] != 2:
                raise _native.LayoutError(
                    f"KV pool: kv_buffers[{i}] must be a tensor with a leading K/V dimension of 2"
                )
        return cls([t[0] for t in layers], [t[1] for t in layers], **kwargs)

    # Request hooks (kvcr-linker-contracts' RequestHooks) and the attempt ledger.

    def begin(self, request_id, *, namespace, device_prefix_pages, tail, hints=()):
        """Begins an attempt of ``request_id`` (superseding its live one) and
        returns its frozen ``RequestContext``. ``tail``: the page keys after
        the engine's ``device_prefix_pages`` device pages; ``hints``: router
        hints as JSON texts (``kv.fetch@1.0`` envelopes or the compact
        ``{"source_control_endpoint", "block_hashes"}`` form)."""
        return self._native.begin(
            request_id,
            namespace=namespace,
            device_prefix_pages=device_prefix_pages,
            tail=list(tail) if not isinstance(tail, (str, bytes)) else tail,
            hints=list(hints) if not isinstance(hints, (str, bytes)) else hints,
        )

    def request_started(self, context):
        """The attempt was enqueued: prepare its tail (claims what KVCR DRAM
        holds; admission waits while ``preparation`` is ``fetching``)."""
        self._native.request_started(context)

    def request_finished(self, attempt):
        """The attempt completed: release what it holds."""
        self._native.request_finished(attempt)

    def request_aborted(self, attempt):
        """The attempt was cancelled, preempted or retried: release what it
        holds (accepted transfers still land)."""
        self._native.request_aborted(attempt)

    def end_attempt(self, attempt):
        """Ends the attempt in the linker's attempt ledger alone, for an
        attempt no hook saw (one that only used ``restore_hinted``); returns
        whether it was the live attempt of its request id.
        ``request_finished`` and ``request_aborted`` end it there too."""
        return self._native.end_attempt(attempt)

    def reset(self, next_incarnation):
        """The engine reset its cache: a fresh, empty store opens as
        ``next_incarnation``. Refused while transfers are in flight."""
        self._native.reset(next_incarnation)

    # The linker contract.

    def offload(self, namespace, pages):
        """Queues device pages (``(key, slot)`` pairs in chain order) for
        KVCR DRAM, after the ranks agreed to: ``Queued`` or ``Declined``."""
        outcome = self._native.offload(namespace, list(pages))
        if "queued" in outcome:
            return Queued(outcome["queued"])
        return Declined(outcome["declined"])

    def preparation(self, attempt):
        """``fetching``, ``ready``, ``loaded`` or ``retired:<Reason>``."""
        return self._native.preparation(attempt)

    def lookup(self, attempt, device_prefix_pages, tail):
        """The prefix lengths (pages, ascending) this rank can restore now."""
        return self._native.lookup(attempt, device_prefix_pages, list(tail))

    def load(self, attempt, slots):
        """Loads the first ``len(slots)`` prepared pages into ``slots``
        (device slots the engine allocated); returns the ticket of its
        ``LoadDone``."""
        return self._native.load(attempt, list(slots))

    def restore_hinted(self, context, slots):
        """Restores the context's whole tail into ``slots`` (one per page),
        from KVCR DRAM and, on a hint, from the hinted peer, pipelined; no
        preparation. Returns the ticket of its ``RestoreDone``."""
        return self._native.restore_hinted(context, list(slots))

    def poll(self):
        """Lands what completed; returns the events."""
        return _events(self._native.poll())

    def settle(self, timeout_s=30.0):
        """Waits (GIL released) until nothing is in flight or ``timeout_s``
        passed; returns every event that landed."""
        return _events(self._native.settle(timeout_s))

    def accounting(self):
        """``claims_held``, ``transfers_in_flight``, ``live_attempts``."""
        return self._native.accounting()

    def peer_stats(self):
        """The peer protocol's counters (``None`` without ``peer=True``):
        ``writes_requested``, ``keys_received``, ``keys_sent``,
        ``digest_mismatches``, and how device restores went:
        ``one_hop_writes``, ``one_hop_pages`` (landed in the GPU straight from
        a same-host source's KVCR DRAM, checked there), ``one_hop_fallbacks``
        (through this rank's KVCR DRAM), ``one_hop_refused``, and
        ``metadata_resent`` (a source that stays silent towards us)."""
        return self._native.peer_stats()

    def stores(self, namespace, key):
        """Whether KVCR DRAM holds the page."""
        return self._native.stores(namespace, key)

    def close(self):
        """Stops the linker now; later calls raise ``KvcrError``."""
        self._native.close()

    @property
    def endpoint(self):
        """The peer endpoint hints name (``None`` without ``peer=True``)."""
        return self._native.endpoint

    @property
    def incarnation(self):
        """The store's live incarnation."""
        return self._native.incarnation

    @property
    def layout(self):
        """The registered pool: geometry, ``device_pages``, bytes, device."""
        return self._native.layout

    @property
    def prepares_requests(self):
        """``True``: call ``request_started`` at enqueue."""
        return self._native.prepares_requests
