//! The CUDA copier: runs the runner's device copy jobs (KVCR DRAM ↔ GPU KV
//! pages) as batched gather/scatter kernels over the pinned, device-mapped
//! runner pools, or — as the anchor the batched path is measured against —
//! one driver copy per span.
//!
//! Spans are issued span-index-major: span 0 of every page, then span 1, and
//! so on. For a layer-first pool that is layer 0's K of every page, then its
//! V, then layer 1: the first layer lands first, so an engine can start
//! computing while the rest streams in (the job's profile reports when the
//! first group of spans landed).
//!
//! Unsafe here is limited to issuing the [`crate::cuda`] calls whose
//! contracts the runner's job guarantees (each block says how).
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvcr_foundation::runner::{CopySpan, timeline};

use crate::cuda::{
    CopyKernel, DIGEST_BLOCK_BYTES, Device, DigestKernel, Event, PinnedBuffer, PinnedRegistration,
    Stream,
};
use crate::error::{Error, Result};
use crate::rows;

mod seam;

/// How the copier moves a job's spans.
///
/// Measured on an H200 restoring 30 GB of Qwen3-32B pages (128 KiB spans):
/// driver batch 55.1 GB/s of GPU time (the contiguous pinned copy: 55.3),
/// kernel 50.6, one copy per span 23.4; offload 53.7 / 47.3 GB/s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum CopyMode {
    /// One gather/scatter kernel launch per span index over all pages,
    /// reading or writing the mapped pinned pool (any driver).
    Batched,
    /// One driver copy call per span (the naive path, kept as an anchor).
    PerSpan,
    /// One `cuMemcpyBatchAsync` per span index: the copy engines do the
    /// scatter, the SMs stay free for compute (the default; needs a CUDA 12.8
    /// or newer driver, see [`CopyMode::best_for`]). A run of spans with
    /// constant strides on both sides (consecutive slots) goes as one 2D
    /// copy instead ([`CudaCopier::set_row_copies`]).
    #[default]
    DriverBatch,
}

/// What the last job did, timed on the GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CopyProfile {
    /// Bytes moved.
    pub bytes: u64,
    /// Spans moved.
    pub spans: u64,
    /// Kernel launches or driver copies issued.
    pub operations: u64,
    /// Of those, 2D copies, each a run of spans with constant strides.
    pub row_copies: u64,
    /// Pages whose digest the device took as they were copied (a deposit's;
    /// the runner hashed the others in DRAM).
    pub digested: u64,
    /// GPU milliseconds from the first operation to the last.
    pub total_ms: f32,
    /// GPU milliseconds until the first `first_group` span indices of every
    /// page had landed (layer 0's K and V with the default group of 2).
    pub first_group_ms: f32,
    /// CPU milliseconds spent building descriptors (overlapped with copies).
    pub host_ms: f32,
    /// Wall milliseconds of the whole call, sync included.
    pub wall_ms: f32,
}

/// State behind the copier's lock: one job at a time (the runner's copy
/// thread is the only caller; the lock makes that a rule, not an accident).
#[derive(Debug)]
struct Engine {
    stream: Stream,
    descriptors: PinnedBuffer,
    /// The digest kernel's page and span lists and its digests.
    digest_words: PinnedBuffer,
    /// The digest kernel runs here, beside the copies (both only read the
    /// device's bytes): the SMs hash while the copy engines move.
    digest_stream: Stream,
    start: Event,
    first: Event,
    end: Event,
    words: Vec<u64>,
    profile: CopyProfile,
}

/// Jobs of at least this many bytes (~150 µs of copying at 55 GB/s) wait
/// for the GPU asleep; a wake-up costs tens of microseconds, a small share.
const SLEEPING_WAIT_BYTES: u64 = 8 << 20;

/// The runner's device copier ([`kvcr_foundation::runner::DeviceCopier`],
/// in `seam`) for one GPU. Its state is shared with the peer extents it
/// imports ([`crate::one_hop::CudaImport`]), which copy on its streams and
/// keep it alive until they are dropped.
#[derive(Debug)]
pub struct CudaCopier {
    pub(crate) core: Arc<Core>,
}

/// What a copier and its imports share.
///
/// Field order is drop order: the engine (stream, events, descriptor memory)
/// and the pool registrations go before the kernel and the device context.
#[derive(Debug)]
pub(crate) struct Core {
    engine: Mutex<Engine>,
    pinned: Mutex<Vec<PinnedRegistration>>,
    kernel: CopyKernel,
    /// Takes a deposit's page digests on the device (`None`: it did not
    /// load; the runner hashes the pages in DRAM then).
    digest_kernel: Option<DigestKernel>,
    device: Arc<Device>,
    /// The [`CopyMode`], as `mode_code` numbers it (switchable for A/B
    /// measurements on one pool).
    mode: AtomicU8,
    /// Whether the driver-batch mode takes strided runs as 2D copies.
    row_copies: AtomicBool,
    /// The device's widest 2D copy pitch (0: no row copies).
    max_pitch: u64,
    first_group: usize,
    /// The device extents of the imports open now (`[start, end)` in this
    /// process's address space, one entry per import): what a copy to
    /// imports (`DeviceCopier::copy_to_imports`) may write.
    open_imports: Mutex<Vec<(u64, u64)>>,
}

/// The first driver version with `cuMemcpyBatchAsync`.
const DRIVER_BATCH_VERSION: u32 = 12080;

impl CopyMode {
    /// The fastest mode `device`'s driver supports.
    pub fn best_for(device: &Device) -> Result<Self> {
        Ok(if device.driver_version()? >= DRIVER_BATCH_VERSION {
            Self::DriverBatch
        } else {
            Self::Batched
        })
    }
}

fn mode_code(mode: CopyMode) -> u8 {
    match mode {
        CopyMode::Batched => 0,
        CopyMode::PerSpan => 1,
        CopyMode::DriverBatch => 2,
    }
}

/// Whether the digest kernel can hash `key`'s spans as they are: each
/// 16-byte aligned and whole digest blocks, at least one block in all.
fn whole_digest_blocks(key: &[CopySpan]) -> bool {
    let total: u64 = key.iter().map(|s| s.len).sum();
    total >= DIGEST_BLOCK_BYTES
        && key
            .iter()
            .all(|s| s.src % 16 == 0 && s.len % DIGEST_BLOCK_BYTES == 0)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic under the lock leaves plain data behind; keep serving.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CudaCopier {
    /// A copier for `device`, loading the copy kernel. `first_group` span
    /// indices make up the "first layer" the profile times (2: K and V).
    pub fn new(device: &Arc<Device>, mode: CopyMode, first_group: usize) -> Result<Self> {
        Self::check_mode(device, mode)?;
        let kernel = CopyKernel::load(device)?;
        let digest_kernel = DigestKernel::load(device).ok();
        let engine = Engine {
            stream: Stream::new(device)?,
            descriptors: PinnedBuffer::allocate(device, 1 << 20)?,
            digest_words: PinnedBuffer::allocate(device, 1 << 16)?,
            digest_stream: Stream::new(device)?,
            start: Event::new(device)?,
            first: Event::new(device)?,
            end: Event::blocking(device)?,
            words: Vec::new(),
            profile: CopyProfile::default(),
        };
        let core = Core {
            engine: Mutex::new(engine),
            pinned: Mutex::new(Vec::new()),
            kernel,
            digest_kernel,
            device: Arc::clone(device),
            mode: AtomicU8::new(mode_code(mode)),
            row_copies: AtomicBool::new(true),
            // Without the limit, no 2D copies: the batches move everything.
            max_pitch: device.max_pitch().unwrap_or(0),
            first_group: first_group.max(1),
            open_imports: Mutex::new(Vec::new()),
        };
        Ok(Self {
            core: Arc::new(core),
        })
    }

    /// The device it copies to and from.
    pub fn device(&self) -> &Arc<Device> {
        &self.core.device
    }

    /// How it copies.
    pub fn mode(&self) -> CopyMode {
        self.core.mode()
    }

    /// Switches how later jobs copy (benchmarks compare modes on one pool).
    pub fn set_mode(&self, mode: CopyMode) -> Result<()> {
        Self::check_mode(&self.core.device, mode)?;
        self.core.mode.store(mode_code(mode), Ordering::Relaxed);
        Ok(())
    }

    /// Whether the driver-batch mode moves a run of spans with constant
    /// strides on both sides as one 2D copy (on by default; off, for
    /// measurements, every span goes in the batches).
    pub fn set_row_copies(&self, on: bool) {
        self.core.row_copies.store(on, Ordering::Relaxed);
    }

    /// Refuses the driver batch on a driver without it (calling a symbol
    /// the driver lacks would abort inside the loader).
    fn check_mode(device: &Device, mode: CopyMode) -> Result<()> {
        let version = device.driver_version()?;
        if mode == CopyMode::DriverBatch && version < DRIVER_BATCH_VERSION {
            return Err(Error::Unsupported {
                what: "CopyMode::DriverBatch (cuMemcpyBatchAsync)",
                needs: DRIVER_BATCH_VERSION,
                driver: version,
            });
        }
        Ok(())
    }

    /// The last job's profile.
    pub fn last_profile(&self) -> CopyProfile {
        lock(&self.core.engine).profile
    }

    /// Pools pinned now (0 before attach and after detach).
    pub fn pinned_pools(&self) -> usize {
        lock(&self.core.pinned).len()
    }
}

impl Core {
    fn mode(&self) -> CopyMode {
        match self.mode.load(Ordering::Relaxed) {
            0 => CopyMode::Batched,
            1 => CopyMode::PerSpan,
            _ => CopyMode::DriverBatch,
        }
    }

    /// The device it copies to and from.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The extents of the imports open now.
    pub(crate) fn open_imports(&self) -> MutexGuard<'_, Vec<(u64, u64)>> {
        lock(&self.open_imports)
    }

    /// The attached pools' registrations (locked: no detach meanwhile).
    pub(crate) fn pinned(&self) -> MutexGuard<'_, Vec<PinnedRegistration>> {
        lock(&self.pinned)
    }

    /// Rewrites the host side of `span` to its device-mapped address; the
    /// other side must be device memory (outside every attached pool).
    /// Returns `(src, dst, host_to_device)`.
    fn map_span(pinned: &[PinnedRegistration], span: &CopySpan) -> Result<(u64, u64, bool)> {
        let src = pinned.iter().find_map(|p| p.translate(span.src, span.len));
        let dst = pinned.iter().find_map(|p| p.translate(span.dst, span.len));
        match (src, dst) {
            (Some(src), None) => Ok((src, span.dst, true)),
            (None, Some(dst)) => Ok((span.src, dst, false)),
            _ => Err(Error::UnattachedSpan {
                src: span.src,
                dst: span.dst,
                len: span.len,
            }),
        }
    }

    /// Whether the device takes the page digests of `key` (one page's
    /// spans): device to host throughout, each span 16-byte aligned on the
    /// device and a whole number of digest blocks.
    fn digestible(pinned: &[PinnedRegistration], key: &[CopySpan]) -> bool {
        whole_digest_blocks(key)
            && key
                .iter()
                .all(|span| matches!(Self::map_span(pinned, span), Ok((_, _, false))))
    }

    /// Queues the digest kernel over the digestible pages of `keys` on
    /// `stream` (before their copies: both only read the device's bytes).
    /// Returns which keys it hashes and where their digests will be: the
    /// word index in `words` of the first.
    fn queue_digests(
        &self,
        pinned: &[PinnedRegistration],
        keys: &[&[CopySpan]],
        stream: &Stream,
        words: &mut PinnedBuffer,
    ) -> Result<Option<(Vec<usize>, usize)>> {
        let Some(kernel) = &self.digest_kernel else {
            return Ok(None);
        };
        let hashed: Vec<usize> = (0..keys.len())
            .filter(|&k| keys.get(k).is_some_and(|key| Self::digestible(pinned, key)))
            .collect();
        let out_at = self.launch_digests(kernel, keys, &hashed, stream, words)?;
        Ok(Some((hashed, out_at)))
    }

    /// Queues the digest kernel over the keys `hashed` of `keys` (each
    /// span device memory, 16-byte aligned, whole digest blocks: checked by
    /// the caller) on `stream`; returns the word index in `words` of the
    /// first digest.
    fn launch_digests(
        &self,
        kernel: &DigestKernel,
        keys: &[&[CopySpan]],
        hashed: &[usize],
        stream: &Stream,
        words: &mut PinnedBuffer,
    ) -> Result<usize> {
        let spans: usize = hashed
            .iter()
            .filter_map(|&k| keys.get(k))
            .map(|k| k.len())
            .sum();
        // Layout: 3 words per page, then 2 per span, then 1 per digest.
        let (pages_at, spans_at, out_at) = (0, 3 * hashed.len(), 3 * hashed.len() + 2 * spans);
        let needed = 8 * (out_at + hashed.len());
        if needed > words.len() {
            *words = PinnedBuffer::allocate(&self.device, needed.next_power_of_two())?;
        }
        let mut page_words = Vec::with_capacity(3 * hashed.len());
        let mut span_words = Vec::with_capacity(2 * spans);
        for &k in hashed {
            let key = keys.get(k).copied().unwrap_or_default();
            let list = words.mapped() + 8 * (spans_at + span_words.len()) as u64;
            let total: u64 = key.iter().map(|s| s.len).sum();
            page_words.extend_from_slice(&[list, key.len() as u64, total]);
            for span in key {
                span_words.extend_from_slice(&[span.src, span.len]);
            }
        }
        words.write_words(pages_at, &page_words)?;
        words.write_words(spans_at, &span_words)?;
        let count = u32::try_from(hashed.len()).map_err(|_| Error::Layout {
            field: "job",
            why: "has more than 2^32 pages",
        })?;
        // SAFETY: the lists were just written to words no queued kernel
        // reads and stay unchanged until the stream is synchronised (the
        // engine lock is held throughout); every span is device memory the
        // engine registered and the runner bounds-checked, which nothing
        // writes during the job, 16-byte aligned and whole blocks long
        // (`digestible`, `digest_device`); the digests go to words of this
        // buffer.
        unsafe {
            kernel.launch(
                stream,
                words.mapped() + 8 * pages_at as u64,
                count,
                words.mapped() + 8 * out_at as u64,
            )?;
        }
        Ok(out_at)
    }

    /// Each key's page digest, hashed on the device from device memory
    /// (what a one-hop write landed); `None` without the digest kernel or
    /// where a span is not 16-byte aligned or not whole digest blocks.
    pub(crate) fn digest_device(&self, keys: &[&[CopySpan]]) -> Result<Option<Vec<u64>>> {
        let Some(kernel) = &self.digest_kernel else {
            return Ok(None);
        };
        let pinned = lock(&self.pinned);
        for key in keys {
            if !whole_digest_blocks(key) {
                return Ok(None);
            }
            // The kernel reads device addresses: a span in an attached
            // (host) pool would fault the context.
            if let Some(span) = key
                .iter()
                .find(|s| pinned.iter().any(|p| p.translate(s.src, 1).is_some()))
            {
                return Err(Error::UnattachedSpan {
                    src: span.src,
                    dst: span.dst,
                    len: span.len,
                });
            }
        }
        drop(pinned);
        if keys.is_empty() {
            return Ok(Some(Vec::new()));
        }
        self.device.bind()?;
        let mut engine = lock(&self.engine);
        let Engine {
            digest_words,
            digest_stream,
            ..
        } = &mut *engine;
        let hashed: Vec<usize> = (0..keys.len()).collect();
        let launched = self.launch_digests(kernel, keys, &hashed, digest_stream, digest_words);
        // The kernel reads the device's pages: it has ended before this
        // returns, whatever happened.
        let synced = digest_stream.synchronize();
        let out_at = launched?;
        synced?;
        digest_words.read_words(out_at, keys.len()).map(Some)
    }

    pub(crate) fn run(&self, keys: &[&[CopySpan]], digest: bool) -> Result<Vec<Option<u64>>> {
        self.run_led(keys, digest, None)
    }

    /// As [`Self::run`]; with `lead`, its first `.0` span indices are the
    /// job's first group, and `.1` is called once they have landed (and
    /// only then), before the rest has.
    pub(crate) fn run_led(
        &self,
        keys: &[&[CopySpan]],
        digest: bool,
        lead: Option<(usize, &mut dyn FnMut())>,
    ) -> Result<Vec<Option<u64>>> {
        self.device.bind()?;
        // Profiling only: how long the CPU spends building descriptors.
        #[allow(clippy::disallowed_methods)]
        let started = std::time::Instant::now();
        let pinned = lock(&self.pinned);
        let mut engine = lock(&self.engine);
        let widest = keys.iter().map(|k| k.len()).max().unwrap_or(0);
        let total: usize = keys.iter().map(|k| k.len()).sum();
        let mode = self.mode();
        let (first_group, mut lead_landed) = match lead {
            Some((spans, landed)) if spans > 0 => (spans.min(widest), Some(landed)),
            _ => (self.first_group.min(widest), None),
        };
        let mut profile = CopyProfile::default();
        let mut host_ns = 0u128;
        let Engine {
            stream,
            descriptors,
            digest_words,
            digest_stream,
            start,
            first,
            end,
            words,
            ..
        } = &mut *engine;
        if total * 24 > descriptors.len() {
            *descriptors = PinnedBuffer::allocate(&self.device, (total * 24).next_power_of_two())?;
        }
        let digests = if digest {
            self.queue_digests(&pinned, keys, digest_stream, digest_words)
        } else {
            Ok(None)
        };
        // Groups (one span index over every page) are built and issued one
        // after the other, so building group i+1 overlaps the GPU copying
        // group i. Each group's descriptors go to fresh words of the buffer.
        let mut issue = || -> Result<()> {
            start.record(stream)?;
            let mut at = 0usize;
            for index in 0..widest {
                #[allow(clippy::disallowed_methods)]
                let building = std::time::Instant::now();
                words.clear();
                let mut aligned = true;
                let mut host_to_device = true;
                for key in keys {
                    let Some(span) = key.get(index) else { continue };
                    let (src, dst, to_device) = Self::map_span(&pinned, span)?;
                    aligned &= (src | dst | span.len) % 16 == 0;
                    host_to_device = to_device;
                    words.extend_from_slice(&[src, dst, span.len]);
                    profile.bytes += span.len;
                    profile.spans += 1;
                }
                // The kernel moves 16-byte vectors: a group with an unaligned
                // span takes the per-span path.
                let group_mode = if aligned { mode } else { CopyMode::PerSpan };
                let runs = if group_mode == CopyMode::DriverBatch
                    && self.row_copies.load(Ordering::Relaxed)
                {
                    rows::take_rows(words, self.max_pitch)
                } else {
                    Vec::new()
                };
                let count = words.len() / 3;
                host_ns += building.elapsed().as_nanos();
                for run in &runs {
                    // SAFETY: every row is one of the group's spans, each
                    // valid until the sync below, as for the kernel below.
                    unsafe {
                        stream.copy_rows_async(
                            (run.dst, run.dst_pitch),
                            (run.src, run.src_pitch),
                            run.width,
                            run.height,
                        )?;
                    }
                    profile.operations += 1;
                    profile.row_copies += 1;
                }
                match group_mode {
                    _ if count == 0 => {}
                    CopyMode::Batched => {
                        descriptors.write_words(at * 3, words)?;
                        let count = u32::try_from(count).map_err(|_| Error::Layout {
                            field: "job",
                            why: "has more than 2^32 spans of one index",
                        })?;
                        // SAFETY: these descriptors were just written to words
                        // no queued kernel reads, and stay unchanged until the
                        // stream is synchronised below (the engine lock is held
                        // throughout); each names a runner pool range the
                        // runner bounds-checked and keeps valid for the job
                        // (pinned and mapped: `pinned` is locked, so no detach
                        // runs concurrently) and a device range the engine
                        // registered or a peer's imported extent (checked by
                        // `CudaImport::copy`, open while it copies); alignment
                        // was checked above.
                        unsafe {
                            self.kernel.launch(
                                stream,
                                descriptors.mapped() + (at * 24) as u64,
                                count,
                            )?;
                        }
                        profile.operations += 1;
                    }
                    CopyMode::DriverBatch => {
                        let (mut dsts, mut srcs, mut sizes) = (
                            Vec::with_capacity(count),
                            Vec::with_capacity(count),
                            Vec::with_capacity(count),
                        );
                        for d in words.chunks_exact(3) {
                            let &[src, dst, len] = d else { continue };
                            srcs.push(src);
                            dsts.push(dst);
                            sizes.push(len as usize);
                        }
                        // SAFETY: as for the kernel: every range is valid and
                        // untouched by anyone else until the sync below.
                        unsafe {
                            stream.copy_batch_async(
                                &self.device,
                                &mut dsts,
                                &mut srcs,
                                &mut sizes,
                                host_to_device,
                            )?;
                        }
                        profile.operations += 1;
                    }
                    CopyMode::PerSpan => {
                        for d in words.chunks_exact(3) {
                            let &[src, dst, len] = d else { continue };
                            // SAFETY: as for the kernel above.
                            unsafe { stream.copy_async(dst, src, len)? };
                            profile.operations += 1;
                        }
                    }
                }
                at += count;
                if index + 1 == first_group {
                    first.record(stream)?;
                }
            }
            end.record(stream)
        };
        let issued = digests.and_then(|digests| issue().map(|()| digests));
        // The first group's event, asleep like the end's: its copies have
        // landed when it fires (the stream runs in order), whatever the
        // rest is doing. Said only when everything was issued and it fired.
        if let Some(landed) = lead_landed.as_mut()
            && issued.is_ok()
            && first_group > 0
            && first.synchronize().is_ok()
        {
            landed();
        }
        // Returning means no copy of this job touches memory any more (the
        // runner frees or reuses slots right after), so the stream is
        // synchronised even when issuing failed halfway. A large job waits
        // asleep on its last event (recorded after every copy): the context
        // may spin, and a spinning copy thread takes a core from the peer
        // lanes that are filling the next batch (measured on the H200 host:
        // pipelined peer restore 0.74 of its slower hop with a spinning
        // wait); a small one keeps the driver's low-latency wait.
        let synced = if issued.is_ok() && profile.bytes >= SLEEPING_WAIT_BYTES {
            end.synchronize()
        } else {
            stream.synchronize()
        };
        // The digest kernel reads the engine's pages too: it has ended
        // before this returns, whatever happened to the copies.
        let hashed = digest_stream.synchronize();
        let digests = issued?;
        synced?;
        hashed?;
        profile.total_ms = end.since(start)?;
        profile.first_group_ms = if first_group > 0 {
            first.since(start)?
        } else {
            profile.total_ms
        };
        profile.host_ms = host_ns as f32 / 1e6;
        profile.wall_ms = started.elapsed().as_secs_f32() * 1e3;
        // With `KVCR_TIMELINE` on: the GPU's time for the pass beside the
        // caller's (what the copy engines took, and what issuing and the
        // wait added).
        if timeline::enabled() {
            timeline::mark("copier_gpu_us", (profile.total_ms * 1e3) as u64);
            timeline::mark("copier_bytes", profile.bytes);
        }
        engine.profile = profile;
        let mut found = vec![None; keys.len()];
        if let Some((hashed, out_at)) = digests {
            engine.profile.digested = hashed.len() as u64;
            let words = engine.digest_words.read_words(out_at, hashed.len())?;
            for (k, digest) in hashed.into_iter().zip(words) {
                if let Some(slot) = found.get_mut(k) {
                    *slot = Some(digest);
                }
            }
        }
        Ok(found)
    }
}
