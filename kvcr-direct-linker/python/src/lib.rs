//! `kvcr_direct._native`: kvcr's direct linker (mode B,
//! [`kvcr_direct_linker::DirectLinker`]) over an engine's KV pool given as
//! torch tensors, for engines that schedule in Python.
//!
//! One [`PyDirectLinker`] serves one rank: its own runner (KVCR DRAM), the
//! engine's per-layer K and V buffers registered by address once (read and
//! checked from the tensors by [`pool`], and on a GPU confirmed by the driver
//! to be mapped device memory of the pool's device), and an attempt
//! ledger that numbers each request's attempts. The calls mirror the Rust
//! API one for one: `begin` (the ledger) and the request hooks
//! (`request_started`, `request_finished`, `request_aborted`, `reset`), the
//! linker contract (`offload`, `preparation`, `lookup`, `load`, `poll`,
//! `accounting`), and the direct linker's own `restore_hinted`, `settle` and
//! `stores`.
//!
//! Every call releases the GIL while it runs (the linker's lock is taken with
//! the GIL released too, so a thread waiting in `settle` never blocks another
//! thread's Python). Every refusal raises a subclass of `KvcrError`
//! ([`error`]); arguments are read by [`args`], not by PyO3's conversion.

mod args;
mod error;
mod events;
mod pool;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvcr_direct_linker::cuda::Device;
use kvcr_direct_linker::{
    CopyMode, CudaCopier, DirectLinker, DirectLinkerConfig, KvLayout, KvMemory,
};
use kvcr_foundation::runner::PeerOptions;
use kvcr_foundation::{AttemptId, AttemptLedger, Incarnation, RequestId};
use kvcr_linker_contracts::{
    Linker, OffloadBatch, PrefixQuery, RequestContext, RequestHooks, RestorableLengths,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

use crate::error::{Error, Result};
use crate::events::Attempt;
use crate::pool::Placement;

/// The linker and the engine-side ledger that numbers attempts.
struct Inner {
    linker: DirectLinker,
    ledger: AttemptLedger,
}

/// One rank's direct linker (see the module docs).
///
/// Drop order is load-bearing: `inner` (the linker, whose runner may still be
/// copying into the registered buffers) drops before `tensors` (the
/// references that keep those buffers allocated), because fields drop in
/// declaration order.
#[pyclass(frozen, name = "DirectLinker", module = "kvcr_direct._native")]
pub struct PyDirectLinker {
    inner: Mutex<Option<Inner>>,
    tensors: Vec<Py<PyAny>>,
    layout: KvLayout,
    placement: Placement,
    endpoint: Option<String>,
}

/// One attempt's frozen request context: its id, the router hints it started
/// with, and the tail (after the engine's device prefix) to prepare or
/// restore. Made by `DirectLinker.begin`.
#[pyclass(frozen, name = "RequestContext", module = "kvcr_direct._native")]
pub struct PyRequestContext {
    context: RequestContext,
    superseded: Option<Attempt>,
}

#[pymethods]
impl PyRequestContext {
    /// The attempt.
    #[getter]
    fn attempt(&self) -> Attempt {
        Attempt::from(self.context.attempt())
    }

    /// The attempt of the same request id this one superseded, if any.
    #[getter]
    fn superseded(&self) -> Option<Attempt> {
        self.superseded.clone()
    }

    /// The namespace of the tail's pages.
    #[getter]
    fn namespace(&self) -> u64 {
        self.context.query().namespace.0
    }

    /// Pages the engine held on its device when the attempt began.
    #[getter]
    fn device_prefix_pages(&self) -> u32 {
        self.context.query().device_prefix_pages
    }

    /// The tail's page keys (unsigned form).
    #[getter]
    fn tail(&self) -> Vec<u64> {
        self.context
            .query()
            .tail
            .iter()
            .map(|k| k.as_u64())
            .collect()
    }

    /// The router hints' source endpoints, in order.
    #[getter]
    fn hint_sources(&self) -> Vec<String> {
        self.context
            .hints()
            .iter()
            .map(|h| h.source.to_string())
            .collect()
    }
}

fn seq<'py>(obj: &Bound<'py, PyAny>, what: &str) -> Result<Vec<Bound<'py, PyAny>>> {
    obj.extract::<Vec<Bound<'py, PyAny>>>()
        .map_err(|_| Error::Layout(format!("{what} must be a sequence of tensors")))
}

/// An optional argument that is given and not `None`.
fn present<'py>(o: Option<&Bound<'py, PyAny>>) -> Option<Bound<'py, PyAny>> {
    o.filter(|o| !o.is_none()).cloned()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn flag(obj: &Bound<'_, PyAny>, what: &str) -> Result<bool> {
    obj.cast::<PyBool>()
        .map(|b| b.is_true())
        .map_err(|_| Error::Argument(format!("{what} must be a bool")))
}

fn attempt_id(obj: &Bound<'_, PyAny>) -> Result<AttemptId> {
    obj.cast::<Attempt>()
        .map(|a| AttemptId::from(a.get()))
        .map_err(|_| Error::Argument("attempt must be a kvcr_direct.Attempt".to_owned()))
}

fn context(obj: &Bound<'_, PyAny>) -> Result<RequestContext> {
    obj.cast::<PyRequestContext>()
        .map(|c| c.get().context.clone())
        .map_err(|_| Error::Argument("context must be a kvcr_direct.RequestContext".to_owned()))
}

fn peer_options(
    tls: Option<&Bound<'_, PyAny>>,
    secret: Option<&Bound<'_, PyAny>>,
) -> Result<PeerOptions> {
    let mut options = PeerOptions::loopback();
    if let Some(tls) = tls.filter(|t| !t.is_none()) {
        let tls: String = tls
            .extract()
            .map_err(|_| Error::Argument("peer_tls must be a str".to_owned()))?;
        options.ucx_tls = Some(tls);
    }
    if let Some(secret) = secret.filter(|s| !s.is_none()) {
        let secret: Vec<u8> = secret
            .cast::<pyo3::types::PyBytes>()
            .map(|b| b.as_bytes().to_vec())
            .map_err(|_| Error::Argument("peer_secret must be bytes".to_owned()))?;
        options = options.with_secret(secret);
    }
    Ok(options)
}

/// The constructor's arguments, read.
struct Setup {
    placement: Placement,
    page_tokens: u32,
    store_pages: u32,
    tp_rank: u32,
    tp_size: u32,
    operation_timeout: std::time::Duration,
    incarnation: Incarnation,
    peer: Option<PeerOptions>,
    prefault: bool,
}

impl PyDirectLinker {
    /// Runs `f` on the live linker with the GIL released.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Inner) -> Result<R> + Send,
    ) -> Result<R> {
        py.detach(|| {
            let mut guard = lock(&self.inner);
            let inner = guard.as_mut().ok_or(Error::Closed)?;
            f(inner)
        })
    }

    fn build(
        py: Python<'_>,
        setup: &Setup,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> Result<(DirectLinker, Vec<Py<PyAny>>, KvLayout)> {
        // The device first: without a driver nothing below is looked at.
        let device = match setup.placement {
            Placement::Cuda(ordinal) => Some(py.detach(|| Device::open(ordinal))?),
            Placement::Host => None,
        };
        let (k_objs, v_objs) = (seq(k, "k_buffers")?, seq(v, "v_buffers")?);
        let k_read: Vec<pool::Buffer> = k_objs.iter().map(pool::read).collect::<Result<_>>()?;
        let v_read: Vec<pool::Buffer> = v_objs.iter().map(pool::read).collect::<Result<_>>()?;
        let mut checked = pool::check(&k_read, &v_read, setup.page_tokens, setup.placement)?;
        checked.layout.tp_rank = setup.tp_rank;
        checked.layout.tp_size = setup.tp_size;
        checked.layout.validate()?;
        let memory = match &device {
            Some(device) => {
                let bases = checked.layout.k_bases.iter().chain(&checked.layout.v_bases);
                for base in bases {
                    device.check_allocation(*base, checked.buffer_bytes)?;
                }
                let mode = CopyMode::best_for(device)?;
                // 2: K and V of layer 0 make up the first group the copier times.
                KvMemory::Cuda(Arc::new(CudaCopier::new(device, mode, 2)?))
            }
            None => KvMemory::Host,
        };
        let config = DirectLinkerConfig {
            layout: checked.layout.clone(),
            store_pages: setup.store_pages,
            operation_timeout: setup.operation_timeout,
            incarnation: setup.incarnation,
            peer: setup.peer.clone(),
            prefault: setup.prefault,
        };
        let tensors: Vec<Py<PyAny>> = k_objs
            .iter()
            .chain(&v_objs)
            .map(|t| t.clone().unbind())
            .collect();
        let linker = py.detach(|| {
            // SAFETY: every K/V buffer is a torch tensor's memory, inside its
            // own storage and (on a GPU) device memory of the pool's device,
            // mapped throughout, no two sharing a byte (`pool::check`,
            // `Device::check_allocation`). The returned `tensors` keep each
            // allocated, and `PyDirectLinker` drops the linker before them.
            // Not touching a slot while an accepted offload or restore of it
            // is in flight is the engine's promise, stated on the Python API.
            #[allow(unsafe_code)]
            unsafe {
                DirectLinker::new(config, memory)
            }
        })?;
        Ok((linker, tensors, checked.layout))
    }
}

#[pymethods]
impl PyDirectLinker {
    /// Starts a linker over the engine's KV pool: `k_buffers[l]` and
    /// `v_buffers[l]` are layer `l`'s K and V tensors, each contiguous and
    /// shaped `(*token_dims, kv_heads, head_dim)`; `device` is the CUDA
    /// ordinal they live on, or `None` for a pool in host memory.
    #[new]
    #[pyo3(signature = (
        k_buffers, v_buffers, *, page_tokens, store_pages, device=None, tp_rank=None,
        tp_size=None, operation_timeout_s=None, incarnation=None, peer=None, peer_tls=None, peer_secret=None,
        prefault=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        k_buffers: &Bound<'_, PyAny>,
        v_buffers: &Bound<'_, PyAny>,
        page_tokens: &Bound<'_, PyAny>,
        store_pages: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
        tp_rank: Option<&Bound<'_, PyAny>>,
        tp_size: Option<&Bound<'_, PyAny>>,
        operation_timeout_s: Option<&Bound<'_, PyAny>>,
        incarnation: Option<&Bound<'_, PyAny>>,
        peer: Option<&Bound<'_, PyAny>>,
        peer_tls: Option<&Bound<'_, PyAny>>,
        peer_secret: Option<&Bound<'_, PyAny>>,
        prefault: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let u32_or = |o: Option<&Bound<'_, PyAny>>, what: &str, default: u32| match present(o) {
            Some(o) => args::u32_arg(&o, what),
            None => Ok(default),
        };
        let flag_or = |o: Option<&Bound<'_, PyAny>>, what: &str| match present(o) {
            Some(o) => flag(&o, what),
            None => Ok(false),
        };
        let placement = match present(device) {
            Some(d) => Placement::Cuda(args::u32_arg(&d, "device")?),
            None => Placement::Host,
        };
        let incarnation = match present(incarnation) {
            Some(i) => {
                let raw: u128 = i
                    .extract()
                    .map_err(|_| Error::Argument("incarnation must be an int".to_owned()))?;
                Incarnation::from_raw(raw)
                    .ok_or_else(|| Error::Argument("incarnation must be non-zero".to_owned()))?
            }
            None => Incarnation::generate(),
        };
        let setup = Setup {
            placement,
            page_tokens: args::u32_arg(page_tokens, "page_tokens")?,
            store_pages: args::u32_arg(store_pages, "store_pages")?,
            tp_rank: u32_or(tp_rank, "tp_rank", 0)?,
            tp_size: u32_or(tp_size, "tp_size", 1)?,
            operation_timeout: match present(operation_timeout_s) {
                Some(t) => args::seconds(&t, "operation_timeout_s")?,
                None => std::time::Duration::from_secs(30),
            },
            incarnation,
            peer: if flag_or(peer, "peer")? {
                Some(peer_options(peer_tls, peer_secret)?)
            } else {
                None
            },
            prefault: flag_or(prefault, "prefault")?,
        };
        let (linker, tensors, layout) = Self::build(py, &setup, k_buffers, v_buffers)?;
        let endpoint = linker.runner().peers().endpoint().map(ToString::to_string);
        Ok(Self {
            inner: Mutex::new(Some(Inner {
                linker,
                ledger: AttemptLedger::new(),
            })),
            tensors,
            layout,
            placement,
            endpoint,
        })
    }

    /// Begins an attempt of `request_id` in the linker's attempt ledger
    /// (superseding the live one of that id) and freezes its context: the
    /// tail after the engine's `device_prefix_pages` device pages, in
    /// `namespace`, and the router `hints` (JSON texts) it carries.
    #[pyo3(signature = (request_id, *, namespace, device_prefix_pages, tail, hints=None))]
    fn begin(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        namespace: &Bound<'_, PyAny>,
        device_prefix_pages: &Bound<'_, PyAny>,
        tail: &Bound<'_, PyAny>,
        hints: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRequestContext> {
        let request: String = request_id
            .extract()
            .map_err(|_| Error::Argument("request_id must be a str".to_owned()))?;
        let query = PrefixQuery {
            namespace: args::namespace(namespace)?,
            device_prefix_pages: args::u32_arg(device_prefix_pages, "device_prefix_pages")?,
            tail: args::keys(tail)?,
        };
        let hints = match hints.filter(|h| !h.is_none()) {
            Some(h) => args::hints(h)?,
            None => Vec::new(),
        };
        let (context, superseded) = self.with(py, move |inner| {
            Ok(RequestContext::begin(
                &mut inner.ledger,
                RequestId(request),
                hints,
                query,
            ))
        })?;
        Ok(PyRequestContext {
            context,
            superseded: superseded.as_ref().map(Attempt::from),
        })
    }

    /// The request hook: the attempt was enqueued; the linker starts
    /// preparing its tail (a fetch that claims each resident page, hinted
    /// when the linker takes part in the peer protocol).
    fn request_started(&self, py: Python<'_>, context: &Bound<'_, PyAny>) -> PyResult<()> {
        let context = self::context(context)?;
        Ok(self.with(py, move |inner| {
            Ok(inner.linker.request_started(&context)?)
        })?)
    }

    /// The request hook: the attempt completed; what it holds is released.
    /// The attempt also ends in the ledger, even when the linker refuses
    /// (a stale attempt ending there changes nothing).
    fn request_finished(&self, py: Python<'_>, attempt: &Bound<'_, PyAny>) -> PyResult<()> {
        let attempt = attempt_id(attempt)?;
        Ok(self.with(py, move |inner| {
            let hook = inner.linker.request_finished(&attempt);
            inner.ledger.finish(&attempt);
            hook.map_err(Error::from)
        })?)
    }

    /// The request hook: the attempt was cancelled, preempted or retried;
    /// what it holds is released (accepted transfers still land). It also
    /// ends in the ledger, as for `request_finished`.
    fn request_aborted(&self, py: Python<'_>, attempt: &Bound<'_, PyAny>) -> PyResult<()> {
        let attempt = attempt_id(attempt)?;
        Ok(self.with(py, move |inner| {
            let hook = inner.linker.request_aborted(&attempt);
            inner.ledger.finish(&attempt);
            hook.map_err(Error::from)
        })?)
    }

    /// Ends the attempt in the ledger alone (`AttemptLedger::finish`), for an
    /// attempt the linker never saw (one that only used `restore_hinted`):
    /// whether it was the live attempt of its request id.
    fn end_attempt(&self, py: Python<'_>, attempt: &Bound<'_, PyAny>) -> PyResult<bool> {
        let attempt = attempt_id(attempt)?;
        Ok(self.with(py, move |inner| Ok(inner.ledger.finish(&attempt)))?)
    }

    /// The request hook: the engine reset its cache; a fresh store opens as
    /// incarnation `next_incarnation`. Refused while transfers are in flight.
    fn reset(&self, py: Python<'_>, next_incarnation: &Bound<'_, PyAny>) -> PyResult<()> {
        let raw: u128 = next_incarnation
            .extract()
            .map_err(|_| Error::Argument("next_incarnation must be an int".to_owned()))?;
        let next = Incarnation::from_raw(raw)
            .ok_or_else(|| Error::Argument("next_incarnation must be non-zero".to_owned()))?;
        Ok(self.with(py, move |inner| Ok(inner.linker.reset(next)?))?)
    }

    /// Queues device pages (`(key, slot)` pairs, in chain order) for KVCR
    /// DRAM: `{"queued": ticket}`, or `{"declined": reason}` (nothing
    /// changed). The engine keeps the slots untouched until `offload_done`.
    fn offload<'py>(
        &self,
        py: Python<'py>,
        namespace: &Bound<'py, PyAny>,
        pages: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let batch = OffloadBatch {
            namespace: args::namespace(namespace)?,
            pages: args::offload_pages(pages)?,
        };
        let outcome = self.with(py, move |inner| Ok(inner.linker.offload(batch)?))?;
        events::offload(py, outcome)
    }

    /// Where the live attempt's preparation stands: `fetching`, `ready`,
    /// `loaded` or `retired:<Reason>`.
    fn preparation(&self, py: Python<'_>, attempt: &Bound<'_, PyAny>) -> PyResult<String> {
        let attempt = attempt_id(attempt)?;
        let state = self.with(py, move |inner| Ok(inner.linker.preparation(&attempt)?))?;
        Ok(events::preparation(state))
    }

    /// The prefix lengths (in pages, ascending) this rank can restore for the
    /// live attempt now that the engine holds `device_prefix_pages` pages and
    /// asks about `tail`.
    fn lookup(
        &self,
        py: Python<'_>,
        attempt: &Bound<'_, PyAny>,
        device_prefix_pages: &Bound<'_, PyAny>,
        tail: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let attempt = attempt_id(attempt)?;
        let prefix = args::u32_arg(device_prefix_pages, "device_prefix_pages")?;
        let tail = args::keys(tail)?;
        let lengths = self.with(py, move |inner| {
            Ok(inner.linker.lookup(&attempt, prefix, &tail)?)
        })?;
        Ok(lengths.iter().collect())
    }

    /// Queues the load of the first `len(slots)` prepared pages into `slots`
    /// (device slots the engine allocated); returns the ticket its
    /// `load_done` event carries.
    fn load(
        &self,
        py: Python<'_>,
        attempt: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let attempt = attempt_id(attempt)?;
        let slots = args::slots(slots)?;
        let ticket = self.with(py, move |inner| Ok(inner.linker.load(&attempt, &slots)?))?;
        Ok(ticket.0)
    }

    /// Restores the context's tail straight into `slots` (page `i` into
    /// `slots[i]`, one slot per tail page, none twice), pipelined, from KVCR
    /// DRAM and (on a hint, with `peer=True`) from the hinted peer. No
    /// preparation, no claims; `restore_done` says how many leading pages
    /// landed. Returns the ticket.
    fn restore_hinted(
        &self,
        py: Python<'_>,
        context: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let context = self::context(context)?;
        let slots = args::slots(slots)?;
        let ticket = self.with(py, move |inner| {
            Ok(inner.linker.restore_hinted(&context, &slots)?)
        })?;
        Ok(ticket.0)
    }

    /// Lands whatever completed and returns the events (dicts with a
    /// `kind`).
    fn poll<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let landed = self.with(py, |inner| Ok(inner.linker.poll()))?;
        events::events(py, &landed)
    }

    /// Waits (GIL released) until nothing is in flight or `timeout_s` has
    /// passed, and returns every event that landed.
    fn settle<'py>(
        &self,
        py: Python<'py>,
        timeout_s: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let timeout = args::seconds(timeout_s, "timeout_s")?;
        let landed = self.with(py, move |inner| Ok(inner.linker.settle(timeout)))?;
        events::events(py, &landed)
    }

    /// Claim and transfer counts (`claims_held`, `transfers_in_flight`,
    /// `live_attempts`).
    fn accounting<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counts = self.with(py, |inner| Ok(inner.linker.accounting()))?;
        events::accounting(py, counts)
    }

    /// The peer protocol's counters for this rank (`None` without
    /// `peer=True`): what it asked of sources and received, and how its
    /// device restores went (in one hop, or through KVCR DRAM).
    fn peer_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        if self.endpoint.is_none() {
            return Ok(None);
        }
        let c = self.with(py, |inner| {
            Ok(inner.linker.runner().peers().stats().counters)
        })?;
        let out = PyDict::new(py);
        for (name, value) in [
            ("writes_requested", c.writes_requested),
            ("keys_received", c.keys_received),
            ("keys_sent", c.keys_sent),
            ("digest_mismatches", c.digest_mismatches),
            ("one_hop_writes", c.one_hop_writes),
            ("one_hop_pages", c.one_hop_pages),
            ("one_hop_fallbacks", c.one_hop_fallbacks),
            ("one_hop_refused", c.one_hop_refused),
            ("metadata_resent", c.metadata_resent),
        ] {
            out.set_item(name, value)?;
        }
        Ok(Some(out))
    }

    /// Whether KVCR DRAM holds the page `key` of `namespace`.
    fn stores(
        &self,
        py: Python<'_>,
        namespace: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let namespace = args::namespace(namespace)?;
        let key = args::key(key)?;
        Ok(self.with(py, move |inner| Ok(inner.linker.stores(namespace, key)))?)
    }

    /// The store's live incarnation.
    #[getter]
    fn incarnation(&self, py: Python<'_>) -> PyResult<u128> {
        Ok(self.with(py, |inner| Ok(inner.linker.incarnation().raw()))?)
    }

    /// This runner's peer endpoint (`None` without `peer=True`): what a
    /// router hint names as `source_control_endpoint`.
    #[getter]
    fn endpoint(&self) -> Option<String> {
        self.endpoint.clone()
    }

    /// The registered tensors: every K buffer, then every V buffer (the
    /// linker holds these references, so the buffers stay allocated).
    #[getter]
    fn buffers(&self, py: Python<'_>) -> Vec<Py<PyAny>> {
        self.tensors.iter().map(|t| t.clone_ref(py)).collect()
    }

    /// Always `True`: the engine calls `request_started` at enqueue and
    /// gates admission on the preparation.
    #[getter]
    fn prepares_requests(&self) -> bool {
        true
    }

    /// The pool as the linker registered it (geometry, slots, bytes).
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = &self.layout;
        let d = PyDict::new(py);
        d.set_item("layers", l.layers)?;
        d.set_item("page_tokens", l.page_tokens)?;
        d.set_item("kv_heads", l.kv_heads)?;
        d.set_item("head_dim", l.head_dim)?;
        d.set_item("dtype_bytes", l.dtype_bytes)?;
        d.set_item("device_pages", l.device_pages)?;
        d.set_item("tp_rank", l.tp_rank)?;
        d.set_item("tp_size", l.tp_size)?;
        d.set_item("span_bytes", l.span_bytes())?;
        d.set_item("page_bytes", l.page_bytes())?;
        let device = match self.placement {
            Placement::Host => "cpu".to_owned(),
            Placement::Cuda(ordinal) => format!("cuda:{ordinal}"),
        };
        d.set_item("device", device)?;
        Ok(d)
    }

    /// Stops the linker (its runner, its KVCR DRAM) now; later calls raise
    /// `KvcrError`. Transfers in flight are waited for by the runner's stop.
    fn close(&self, py: Python<'_>) {
        py.detach(|| drop(lock(&self.inner).take()));
    }
}

/// The largest prefix length (in pages) every rank can restore, from each
/// rank's `lookup` answer (`reports[rank]`); 0 when they share none.
#[pyfunction]
fn agree_restorable_prefix(reports: &Bound<'_, PyAny>, ranks: &Bound<'_, PyAny>) -> PyResult<u32> {
    let reports: Vec<Bound<'_, PyAny>> = reports
        .extract()
        .map_err(|_| Error::Argument("reports must be a sequence".to_owned()))?;
    let reports = reports
        .iter()
        .map(|r| {
            let lengths: Vec<Bound<'_, PyAny>> = r
                .extract()
                .map_err(|_| Error::Argument("a report must be a sequence".to_owned()))?;
            let lengths = lengths
                .iter()
                .map(|l| args::u32_arg(l, "a length"))
                .collect::<Result<Vec<u32>>>()?;
            Ok(RestorableLengths::new(lengths))
        })
        .collect::<Result<Vec<_>>>()?;
    let ranks = args::u32_arg(ranks, "ranks")? as usize;
    Ok(kvcr_linker_contracts::agree_restorable_prefix(&reports, ranks).map_err(Error::from)?)
}

/// Opens CUDA device `ordinal` and returns its name: `NoGpuError` when this
/// machine has no driver or no such device (never a crash).
#[pyfunction]
fn cuda_device_name(py: Python<'_>, ordinal: &Bound<'_, PyAny>) -> PyResult<String> {
    let ordinal = args::u32_arg(ordinal, "ordinal")?;
    let device = py.detach(|| Device::open(ordinal)).map_err(Error::from)?;
    Ok(device.name().to_owned())
}

/// The extension module `kvcr_direct._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyDirectLinker>()?;
    m.add_class::<PyRequestContext>()?;
    m.add_class::<Attempt>()?;
    m.add_function(wrap_pyfunction!(agree_restorable_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_name, m)?)?;
    m.add("KvcrError", py.get_type::<error::KvcrError>())?;
    m.add("LayoutError", py.get_type::<error::LayoutError>())?;
    m.add("NoGpuError", py.get_type::<error::NoGpuError>())?;
    m.add("CudaError", py.get_type::<error::CudaError>())?;
    m.add("ContractError", py.get_type::<error::ContractError>())?;
    m.add("HintError", py.get_type::<error::HintError>())?;
    m.add("ArgumentError", py.get_type::<error::ArgumentError>())?;
    m.add("RunnerError", py.get_type::<error::RunnerError>())?;
    m.add("MAX_LAYERS", pool::MAX_LAYERS)?;
    Ok(())
}
