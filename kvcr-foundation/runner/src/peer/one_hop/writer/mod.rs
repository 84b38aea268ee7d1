//! The one-hop writer: the thread that copies one-hop writes from our KVCR
//! DRAM into a target's imported device regions, and the schedule it
//! follows ([`Stream`]).
//!
//! The schedule streams: each step first copies the lead spans (a
//! layer-first page's layer 0) of every write that arrived since the last
//! step, in one pass, and reports them landed; then it copies the rest of
//! the oldest writes, at most [`CHUNK_BYTES`] in one pass (a piece of the
//! oldest one's, if that alone is more), and reports those writes done.
//! So a restore's first layer waits only for its writes to arrive, not
//! for the writes before them to finish, and the target hears completions
//! (and checks and commits them) while later bytes are still crossing,
//! rather than all at the end.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use kvcr_runner_core::CopySpan;
use tokio::sync::mpsc::UnboundedSender;

use super::{Copies, DeviceRoutes, Job, Pages};
use crate::copy::device::DeviceCopier;

/// Most bytes one pass over the writes' remaining spans copies when no
/// write arrived since the last: about 80 ms at the PCIe rate. A pass
/// costs one synchronisation and a gap of tens of microseconds, and its
/// spans go as 2D copies of one row per page: on an H100 the copy engines
/// moved 1 GiB passes at 0.976 × the contiguous host-to-device rate and
/// 4 GiB passes at 0.99 × (traced; `BENCH-HISTORY.md`). Completions still
/// flow back while the next pass copies, and the target checks each
/// pass's pages in one launch whatever their number.
pub(super) const CHUNK_BYTES: u64 = 4 << 30;

/// Most bytes of a pass while writes are arriving (a restore's writes
/// reach us over many turns): about 0.3 ms, so a write that arrives
/// meanwhile waits at most that long for its lead to be copied, and the
/// copy engines never wait for the arrivals to end. With 64 MiB (1.2 ms)
/// a pass every other step cost the leads more copy time than the writes
/// took to arrive, and the last lead pass ended 4.7 ms after the last
/// write came (traced on an H100 host).
pub(super) const ARRIVING_CHUNK_BYTES: u64 = 16 << 20;

/// Longest a pass over the rest waits behind newly queued writes' leads
/// (ns). While writes with leads keep coming, the copy engines copy only
/// leads, which costs the restore nothing (they are busy either way) and
/// lands the first layer soonest; the bound keeps the rest moving under
/// an endless stream of writes.
pub(super) const MAX_CHUNK_DEFERRAL_NS: u64 = 10_000_000;

/// Writes are taken as still arriving until none has for this long: a
/// restore's reach us in groups with gaps of up to ~4 ms (the source's
/// peer thread checks them between reads; traced on an H100 host). A
/// long pass started in such a gap held the next group's leads, and the
/// restore's first layer, for its whole 78 ms.
pub(super) const ARRIVALS_QUIET_NS: u64 = 10_000_000;

/// Writes a turn queues before they are handed over mid-turn: a turn that
/// takes a restore's burst of `start_write`s (128 at a time, ~30 µs each
/// on the GPU host's source, traced) hands them on in groups, so the first
/// leads copy while the rest are still being checked, and the last group's
/// lead pass is short.
const HAND_OVER_WRITES: usize = 32;

/// The thread that runs one-hop writes. The peer thread hands it each
/// turn's writes together ([`OneHopWriter::flush`] at the turn's end, or
/// every [`HAND_OVER_WRITES`]): the writes handed together have their
/// leads copied in one pass.
pub(in crate::peer) struct OneHopWriter {
    worker: Option<Worker>,
    /// This turn's writes, not yet handed over.
    turn: Vec<Job>,
    /// Copy passes run and time spent in them (the runner's counters).
    passes: Arc<PassCounters>,
}

struct Worker {
    tx: mpsc::Sender<Vec<Job>>,
    /// Where a write the thread can no longer take is reported failed.
    done: UnboundedSender<(u64, bool)>,
    thread: JoinHandle<()>,
}

impl OneHopWriter {
    /// A writer counting its copy passes in `passes`; its thread starts
    /// with the first write.
    pub(in crate::peer) fn new(passes: Arc<PassCounters>) -> Self {
        Self {
            worker: None,
            turn: Vec::new(),
            passes,
        }
    }

    /// Queues a write's copies for this turn's hand-over; `leads` hears a
    /// write whose lead landed (while the rest copies), `done` hears
    /// `(write, ok)` once no copy of it can touch memory any more, in that
    /// order. `false` if the thread cannot be started (the write then
    /// fails at once).
    pub(super) fn submit(
        &mut self,
        job: Job,
        done: &UnboundedSender<(u64, bool)>,
        leads: &UnboundedSender<u64>,
    ) -> bool {
        if self.worker.is_none() {
            let (tx, rx) = mpsc::channel::<Vec<Job>>();
            let reports = done.clone();
            let leads = leads.clone();
            let passes = Arc::clone(&self.passes);
            // Said from the writer's thread, never under the core's lock
            // (the runner's drop holds that lock while it detaches the
            // copier).
            let spawned = std::thread::Builder::new()
                .name("kvcr-one-hop".into())
                .spawn(move || {
                    let mut stream = Stream::new(
                        CHUNK_BYTES,
                        ARRIVING_CHUNK_BYTES,
                        ARRIVALS_QUIET_NS,
                        MAX_CHUNK_DEFERRAL_NS,
                    );
                    // The schedule's clock (the stream itself is sans-I/O).
                    #[allow(clippy::disallowed_methods)]
                    let began = std::time::Instant::now();
                    let mut said = Said {
                        lead: &|write| {
                            let _ = leads.send(write);
                        },
                        done: &|write, ok| {
                            let _ = reports.send((write, ok));
                        },
                        passes: &passes,
                    };
                    // Writes taken while the last step looked for more.
                    let mut early: Vec<Job> = Vec::new();
                    loop {
                        // Block only with nothing left to copy; otherwise
                        // take what arrived and go on.
                        let mut jobs = std::mem::take(&mut early);
                        if jobs.is_empty() && stream.is_idle() {
                            match rx.recv() {
                                Ok(more) => jobs = more,
                                Err(_) => break,
                            }
                        }
                        while let Ok(more) = rx.try_recv() {
                            jobs.extend(more);
                        }
                        let now = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
                        // Whether writes that ask a lead came meanwhile
                        // (only their leads are worth a chunk's wait).
                        let mut queued = || {
                            while let Ok(more) = rx.try_recv() {
                                early.extend(more);
                            }
                            early.iter().any(|job| job.lead > 0)
                        };
                        stream.step(jobs, now, &mut said, &mut queued);
                    }
                });
            match spawned {
                Ok(thread) => {
                    self.worker = Some(Worker {
                        tx,
                        done: done.clone(),
                        thread,
                    });
                }
                Err(_) => return false,
            }
        }
        self.turn.push(job);
        if self.turn.len() >= HAND_OVER_WRITES {
            self.flush();
        }
        true
    }

    /// Hands this turn's writes to the thread, together. A write the thread
    /// can no longer take (it is gone) is reported failed: its copies never
    /// started.
    pub(in crate::peer) fn flush(&mut self) {
        if self.turn.is_empty() {
            return;
        }
        let jobs = std::mem::take(&mut self.turn);
        crate::timeline::mark("writer_handed", jobs.len() as u64);
        let Some(worker) = &self.worker else {
            return;
        };
        if let Err(mpsc::SendError(jobs)) = worker.tx.send(jobs) {
            for job in jobs {
                let _ = worker.done.send((job.write, false));
            }
        }
    }
}

impl Drop for OneHopWriter {
    /// Hands over what this turn queued, then joins the thread once it has
    /// run every write (their copies read our pools, unmapped after this).
    fn drop(&mut self) {
        self.flush();
        if let Some(Worker { tx, thread, .. }) = self.worker.take() {
            drop(tx);
            if thread.join().is_err() {
                eprintln!("kvcr: one-hop writer panicked");
            }
        }
    }
}

/// The writer's copy passes: how many ran (`one_hop_passes`) and the time
/// spent inside them (`one_hop_copy_ns`). Against a restore's wall time,
/// the time shows what the copy engines were given and what went between
/// passes.
#[derive(Debug, Default)]
pub(crate) struct PassCounters {
    pub(crate) passes: AtomicU64,
    pub(crate) busy_ns: AtomicU64,
}

impl PassCounters {
    /// Runs one copy pass, counted and timed; its outcome.
    fn run(&self, pass: impl FnOnce() -> bool) -> bool {
        self.passes.fetch_add(1, Ordering::Relaxed);
        #[allow(clippy::disallowed_methods)] // time spent, reported; never a threshold
        let began = std::time::Instant::now();
        let ok = pass();
        let spent = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.busy_ns.fetch_add(spent, Ordering::Relaxed);
        ok
    }
}

/// Where the schedule says what happened: a write's lead landed, a write
/// ended (`ok`: every copy landed); and where its passes are counted.
struct Said<'a> {
    lead: &'a dyn Fn(u64),
    done: &'a dyn Fn(u64, bool),
    passes: &'a PassCounters,
}

/// A write whose lead has landed (or that asked none), its remaining spans
/// still to copy. It holds its job, and with it its imports, open.
struct Streamed {
    job: Job,
    /// The first span index of each page not copied yet: the lead's end,
    /// then past each piece of the rest ([`Stream::copy_piece`]).
    next: usize,
}

impl Streamed {
    /// A write that has just arrived: its rest starts after its lead.
    fn new(job: Job) -> Self {
        let next = job.lead;
        Self { job, next }
    }

    /// The write's pages, every destination an address (only such a write
    /// streams).
    fn pages(&self) -> &[Vec<CopySpan>] {
        match &self.job.pages {
            Pages::Addressed(pages) => pages,
            Pages::ByRegion(_) => &[],
        }
    }

    /// Span indices `from .. to` of each page (those it has).
    fn spans(&self, from: usize, to: usize) -> impl Iterator<Item = &[CopySpan]> {
        self.pages()
            .iter()
            .map(move |p| p.get(from.min(p.len())..to.min(p.len())).unwrap_or(&[]))
            .filter(|p| !p.is_empty())
    }

    /// Each page's lead spans (none for a write that asked no lead).
    fn lead(&self) -> impl Iterator<Item = &[CopySpan]> {
        self.spans(0, self.job.lead)
    }

    /// Each page's spans not copied yet.
    fn rest(&self) -> impl Iterator<Item = &[CopySpan]> {
        self.spans(self.next, usize::MAX)
    }

    fn rest_bytes(&self) -> u64 {
        self.rest().flatten().map(|s| s.len).sum()
    }

    /// How many span indices from `next` the next piece takes: as many as
    /// fit in `bytes` across the pages, at least one.
    fn piece_len(&self, bytes: u64) -> usize {
        let longest = self.pages().iter().map(Vec::len).max().unwrap_or(0);
        let mut taken = 0;
        let mut piece = 0;
        for index in self.next..longest {
            let size: u64 = self.spans(index, index + 1).flatten().map(|s| s.len).sum();
            if taken > 0 && piece + size > bytes {
                break;
            }
            piece += size;
            taken += 1;
        }
        taken
    }
}

/// The writer's schedule (see the module's doc): the writes whose rest is
/// still to copy, oldest first. Sans-I/O apart from the copier it calls.
struct Stream {
    rest: VecDeque<Streamed>,
    chunk_bytes: u64,
    arriving_chunk_bytes: u64,
    arrivals_quiet_ns: u64,
    /// Most time a chunk waits behind queued leads (ns).
    max_chunk_deferral_ns: u64,
    /// When the last step that took writes ran (ns, the caller's clock).
    last_arrival: Option<u64>,
    /// Since when steps have left their chunk for writes queued behind
    /// them (ns); `None` once a chunk was copied.
    deferring_since: Option<u64>,
}

impl Stream {
    /// Passes over the rest of at most `chunk_bytes`, or
    /// `arriving_chunk_bytes` while writes are arriving: in a step that
    /// took some, or within `arrivals_quiet_ns` of the last that did. A
    /// chunk waits behind queued leads for at most `max_chunk_deferral_ns`.
    fn new(
        chunk_bytes: u64,
        arriving_chunk_bytes: u64,
        arrivals_quiet_ns: u64,
        max_chunk_deferral_ns: u64,
    ) -> Self {
        Self {
            rest: VecDeque::new(),
            chunk_bytes,
            arriving_chunk_bytes,
            arrivals_quiet_ns,
            max_chunk_deferral_ns,
            last_arrival: None,
            deferring_since: None,
        }
    }

    /// Nothing left to copy.
    fn is_idle(&self) -> bool {
        self.rest.is_empty()
    }

    /// One step at `now` (ns): `jobs` (newly arrived) have their leads
    /// copied and join the stream; then one chunk of the oldest writes'
    /// rest is copied, a short one while writes are arriving (more may
    /// follow, whose leads should not wait long). If `queued` says writes
    /// with leads came meanwhile, the chunk waits for the next step, so
    /// their leads go first; for at most `max_chunk_deferral_ns` in a row,
    /// so the rest always moves.
    fn step(
        &mut self,
        jobs: Vec<Job>,
        now: u64,
        said: &mut Said<'_>,
        queued: &mut dyn FnMut() -> bool,
    ) {
        if !jobs.is_empty() {
            self.last_arrival = Some(now);
        }
        let arriving = self
            .last_arrival
            .is_some_and(|at| now.saturating_sub(at) < self.arrivals_quiet_ns);
        let chunk = if arriving {
            self.arriving_chunk_bytes
        } else {
            self.chunk_bytes
        };
        self.take(jobs, said);
        if !self.rest.is_empty() && queued() {
            let since = *self.deferring_since.get_or_insert(now);
            if now.saturating_sub(since) < self.max_chunk_deferral_ns {
                return;
            }
        }
        self.deferring_since = None;
        self.copy_chunk(chunk, said);
    }

    /// Newly arrived `jobs` join the stream, their leads copied. A write
    /// that cannot stream (imports not addressed, or another copier than
    /// the stream's) is run whole, alone.
    fn take(&mut self, jobs: Vec<Job>, said: &mut Said<'_>) {
        let mut arrived = Vec::new();
        for job in jobs {
            let joins = self.copier().is_none_or(|c| Arc::ptr_eq(c, &job.copier));
            match &job.pages {
                Pages::Addressed(_) if joins => arrived.push(Streamed::new(job)),
                Pages::Addressed(pages) => {
                    let ok = said.passes.run(|| copy_pages(job.copier.as_ref(), pages));
                    (said.done)(job.write, ok);
                }
                Pages::ByRegion(copies) => {
                    let ok = said.passes.run(|| copy_by_region(&job.routes, copies));
                    (said.done)(job.write, ok);
                }
            }
        }
        self.copy_leads(arrived, said);
    }

    /// The copier of the writes streaming now (they share one).
    fn copier(&self) -> Option<&Arc<dyn DeviceCopier>> {
        self.rest.front().map(|s| &s.job.copier)
    }

    /// Copies the leads of `arrived` in one pass and reports each landed;
    /// they then wait for their rest. If the pass fails, each write that
    /// asked a lead is run whole, alone, and says nothing early (its bytes
    /// are unknown until then).
    fn copy_leads(&mut self, arrived: Vec<Streamed>, said: &mut Said<'_>) {
        let Some(copier) = arrived.first().map(|s| Arc::clone(&s.job.copier)) else {
            return;
        };
        let leads: Vec<&[CopySpan]> = arrived.iter().flat_map(Streamed::lead).collect();
        crate::timeline::mark("leads_pass", arrived.len() as u64);
        let landed = leads.is_empty() || said.passes.run(|| copier.copy_to_imports(&leads).is_ok());
        crate::timeline::mark("leads_pass_end", leads.len() as u64);
        for streamed in arrived {
            if streamed.job.lead == 0 {
                self.rest.push_back(streamed);
            } else if landed {
                (said.lead)(streamed.job.write);
                self.rest.push_back(streamed);
            } else {
                let ok = copy_pages(streamed.job.copier.as_ref(), streamed.pages());
                (said.done)(streamed.job.write, ok);
            }
        }
    }

    /// Copies the rest of the oldest writes, at most `chunk_bytes`, in one
    /// pass, and reports them done; if the oldest write's rest alone is
    /// more, a piece of it ([`Self::copy_piece`]). If the pass fails, each
    /// is run again alone (its slots stay granted until we report, and the
    /// bytes are the same), so one bad write never fails another.
    fn copy_chunk(&mut self, chunk_bytes: u64, said: &mut Said<'_>) {
        let mut bytes = 0;
        let mut taken = 0;
        for streamed in &self.rest {
            let size = streamed.rest_bytes();
            if bytes + size > chunk_bytes {
                break;
            }
            bytes += size;
            taken += 1;
        }
        if taken == 0 {
            self.copy_piece(chunk_bytes, said);
            return;
        }
        let chunk: Vec<Streamed> = self.rest.drain(..taken).collect();
        let Some(copier) = chunk.first().map(|s| Arc::clone(&s.job.copier)) else {
            return;
        };
        let keys: Vec<&[CopySpan]> = chunk.iter().flat_map(Streamed::rest).collect();
        crate::timeline::mark("chunk_pass", bytes);
        let copied = keys.is_empty() || said.passes.run(|| copier.copy_to_imports(&keys).is_ok());
        crate::timeline::mark("chunk_pass_end", chunk.len() as u64);
        for streamed in &chunk {
            let ok = copied || {
                let keys: Vec<&[CopySpan]> = streamed.rest().collect();
                copier.copy_to_imports(&keys).is_ok()
            };
            (said.done)(streamed.job.write, ok);
        }
    }

    /// The oldest write's rest is more than `chunk_bytes`: copies the next
    /// span indices of its pages, as many as fit (at least one), in one
    /// pass, and reports the write done after its last piece. A whole
    /// write's rest is ~64 MiB, over a millisecond of the copy engines,
    /// and a restore's later leads waited behind it (traced on an H100
    /// host); a piece is a short chunk's time. A failed piece is run once
    /// more alone (the same bytes, into slots still granted); failed
    /// again, the write fails.
    fn copy_piece(&mut self, chunk_bytes: u64, said: &mut Said<'_>) {
        let Some(front) = self.rest.front() else {
            return;
        };
        let (from, to) = (front.next, front.next + front.piece_len(chunk_bytes));
        let keys: Vec<&[CopySpan]> = front.spans(from, to).collect();
        let bytes = keys.iter().flat_map(|k| k.iter()).map(|s| s.len).sum();
        let copier = Arc::clone(&front.job.copier);
        crate::timeline::mark("chunk_pass", bytes);
        let copied = said.passes.run(|| copier.copy_to_imports(&keys).is_ok())
            || copier.copy_to_imports(&keys).is_ok();
        crate::timeline::mark("chunk_pass_end", 1);
        let finished = match self.rest.front_mut() {
            Some(front) if copied => {
                front.next = to;
                front.rest_bytes() == 0
            }
            _ => true,
        };
        if finished && let Some(front) = self.rest.pop_front() {
            (said.done)(front.job.write, copied);
        }
    }
}

/// One write's addressed pages in one pass: the copier issues span index i
/// of every page together (a layer-first page's first spans are layer 0's
/// K and V, which so land first), as it does a job.
fn copy_pages(copier: &dyn DeviceCopier, pages: &[Vec<CopySpan>]) -> bool {
    let keys: Vec<&[CopySpan]> = pages.iter().map(Vec::as_slice).collect();
    copier.copy_to_imports(&keys).is_ok()
}

/// One write whose imports were not addressed, through `routes`: import by
/// import (one synchronisation per region).
fn copy_by_region(routes: &DeviceRoutes, copies: &Copies) -> bool {
    let mut by_region: Vec<(usize, Vec<CopySpan>)> = Vec::new();
    for (position, span) in copies.iter().flatten() {
        match by_region.iter_mut().find(|(p, _)| p == position) {
            Some((_, spans)) => spans.push(*span),
            None => by_region.push((*position, vec![*span])),
        }
    }
    by_region.iter().all(|(position, spans)| {
        routes
            .at(*position)
            .is_some_and(|route| route.import.copy_into(&[spans.as_slice()]).is_ok())
    })
}

#[cfg(test)]
mod tests;
