//! The one-hop route, source side: a same-host target's device regions,
//! opened with our device copier ([`DeviceCopier::import_device`]), and the
//! writes into them, copied from our KVCR DRAM by the copier
//! ([`DeviceImport::copy_into`]) on a thread of their own (never the peer
//! thread), then reported like any put.
//!
//! Drop order: a route holds its imports (`Arc`), and so does every write
//! queued or copying through one; an import closes when the route is gone
//! and the writer has finished every write through it. The writer is a
//! field of the peer thread's state beside the lanes, joined (after its
//! queued writes) before the pools its copies read are unmapped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::protocol::{DeviceRegionAdvert, RegionId};
use kvcr_runner_core::{CopySpan, PutSpan};
use tokio::sync::mpsc::UnboundedSender;

use super::State;
use super::routes::Route;
use crate::copy::device::{DeviceCopier, DeviceImport};
use crate::shared::Shared;

/// One opened device region of a target: where its element 0 is in the
/// target's address space (the export's first byte), and the import.
#[derive(Clone)]
pub(super) struct DeviceRoute {
    base: u64,
    import: Arc<dyn DeviceImport>,
}

/// Per device region id, the opened import.
pub(super) type DeviceRoutes = HashMap<RegionId, DeviceRoute>;

/// One copy of a one-hop write: the region it lands in, that region's
/// import, and the span (`src` in our pool, `dst` an offset in the import).
type Copy = (RegionId, Arc<dyn DeviceImport>, CopySpan);

/// A write's copies, page by page, each page's in layout order.
type Copies = Vec<Vec<Copy>>;

/// A one-hop write the writer runs.
struct Job {
    write: u64,
    copies: Copies,
    /// The copier that opened the copies' imports.
    copier: Arc<dyn DeviceCopier>,
    /// Leading spans per page whose landing the core hears of ahead of the
    /// rest (`Core::handle_put_lead_landed`); 0: none.
    lead: usize,
}

/// Most queued writes one copy pass takes together.
const MERGED_WRITES: usize = 1024;

/// The thread that runs one-hop writes. The peer thread hands it each
/// turn's writes together ([`OneHopWriter::flush`] at the turn's end), and
/// it copies every write queued when it takes the next in one pass: a
/// deliver's writes arrive in one turn, so its layer 0 lands first over all
/// of them rather than over whichever writes the thread woke to, and the
/// copier synchronises once, not per write.
#[derive(Default)]
pub(super) struct OneHopWriter {
    worker: Option<Worker>,
    /// This turn's writes, not yet handed over.
    turn: Vec<Job>,
    /// Copy passes run (the runner's `one_hop_passes` counter).
    passes: Arc<AtomicU64>,
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
    pub(super) fn new(passes: Arc<AtomicU64>) -> Self {
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
    fn submit(
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
            // Said from inside the copier's call, which holds its locks:
            // a message, never the core's lock (the runner's drop holds
            // that lock while it detaches the copier).
            let lead_landed = move |write: u64| {
                let _ = leads.send(write);
            };
            let spawned = std::thread::Builder::new()
                .name("kvcr-one-hop".into())
                .spawn(move || {
                    while let Ok(mut jobs) = rx.recv() {
                        while jobs.len() < MERGED_WRITES {
                            match rx.try_recv() {
                                Ok(more) => jobs.extend(more),
                                Err(_) => break,
                            }
                        }
                        for pass in jobs.chunks(MERGED_WRITES) {
                            passes.fetch_add(1, Ordering::Relaxed);
                            for (write, ok) in copy_writes(pass, &lead_landed) {
                                let _ = reports.send((write, ok));
                            }
                        }
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
        true
    }

    /// Hands this turn's writes to the thread, together. A write the thread
    /// can no longer take (it is gone) is reported failed: its copies never
    /// started.
    pub(super) fn flush(&mut self) {
        if self.turn.is_empty() {
            return;
        }
        let jobs = std::mem::take(&mut self.turn);
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

/// Runs queued writes: those whose spans every import resolves and that
/// share the first such write's copier and lead in one pass, the rest one
/// by one; per write, whether all its copies landed. `lead_landed` hears
/// each write whose lead spans landed ahead of the rest (a pass's writes
/// together; a write run alone says nothing early). A pass that fails is
/// run again write by write (the slots stay granted until we report, and
/// the bytes are the same), so one target's bad write never fails
/// another's. The imports the writes name stay open until this returns.
fn copy_writes(jobs: &[Job], lead_landed: &dyn Fn(u64)) -> Vec<(u64, bool)> {
    let mut merged: Vec<(u64, Vec<Vec<CopySpan>>)> = Vec::new();
    let mut alone: Vec<(&Job, Option<Vec<Vec<CopySpan>>>)> = Vec::new();
    let mut pass: Option<(&Arc<dyn DeviceCopier>, usize)> = None;
    for job in jobs {
        let pages = resolve(&job.copies);
        let joins = pass.is_none_or(|(c, lead)| Arc::ptr_eq(c, &job.copier) && lead == job.lead);
        match pages {
            Some(pages) if joins => {
                pass = Some((&job.copier, job.lead));
                merged.push((job.write, pages));
            }
            pages => alone.push((job, pages)),
        }
    }
    let mut outcomes = Vec::with_capacity(jobs.len());
    if let Some((copier, lead)) = pass {
        let keys: Vec<&[CopySpan]> = merged
            .iter()
            .flat_map(|(_, pages)| pages.iter().map(Vec::as_slice))
            .collect();
        let mut landed = || {
            for (write, _) in &merged {
                lead_landed(*write);
            }
        };
        if copier.copy_to_imports_led(&keys, lead, &mut landed).is_ok() {
            outcomes.extend(merged.iter().map(|(write, _)| (*write, true)));
        } else {
            for (write, pages) in &merged {
                outcomes.push((*write, copy_pages(copier.as_ref(), pages)));
            }
        }
    }
    for (job, pages) in alone {
        let ok = match pages {
            Some(pages) => copy_pages(job.copier.as_ref(), &pages),
            None => copy_by_region(&job.copies),
        };
        outcomes.push((job.write, ok));
    }
    outcomes
}

/// A write's copies with each destination resolved to an address, page
/// by page; `None` if an import cannot resolve one.
fn resolve(copies: &Copies) -> Option<Vec<Vec<CopySpan>>> {
    copies
        .iter()
        .map(|page| {
            page.iter()
                .map(|(_, import, s)| {
                    import.resolve(s.dst, s.len).map(|dst| CopySpan {
                        src: s.src,
                        dst,
                        len: s.len,
                    })
                })
                .collect()
        })
        .collect()
}

/// One write's resolved pages in one pass: the copier issues span index i
/// of every page together (a layer-first page's first spans are layer 0's
/// K and V, which so land first), as it does a job.
fn copy_pages(copier: &dyn DeviceCopier, pages: &[Vec<CopySpan>]) -> bool {
    let keys: Vec<&[CopySpan]> = pages.iter().map(Vec::as_slice).collect();
    copier.copy_to_imports(&keys).is_ok()
}

/// One write whose imports cannot resolve its spans: import by import
/// (one synchronisation per region).
fn copy_by_region(copies: &Copies) -> bool {
    let mut by_region: Vec<(RegionId, &Arc<dyn DeviceImport>, Vec<CopySpan>)> = Vec::new();
    for (region, import, span) in copies.iter().flatten() {
        match by_region.iter_mut().find(|(r, ..)| r == region) {
            Some((_, _, spans)) => spans.push(*span),
            None => by_region.push((*region, import, vec![*span])),
        }
    }
    by_region
        .iter()
        .all(|(_, import, spans)| import.copy_into(&[spans.as_slice()]).is_ok())
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

impl State {
    /// Opens every device region `peer` advertised, over a route that maps
    /// its pools (same host, proven its own). All or nothing: any refusal
    /// (no copier, another GPU, a driver error) leaves the route without
    /// the one-hop route, said once here; a restore then takes two hops.
    pub(super) fn open_device_regions(
        &self,
        shared: &Arc<Shared>,
        peer: &ControlEndpoint,
        regions: &[DeviceRegionAdvert],
    ) -> DeviceRoutes {
        if regions.is_empty() {
            return DeviceRoutes::new();
        }
        let copier: Option<Arc<dyn DeviceCopier>> = shared.lock().device.clone();
        let Some(copier) = copier else {
            eprintln!("kvcr: no one-hop route to {peer}: no device copier here");
            return DeviceRoutes::new();
        };
        let mut opened = DeviceRoutes::new();
        for region in regions {
            let Some(extent) = region.extent() else {
                return DeviceRoutes::new();
            };
            match copier.import_device(&region.export, extent) {
                Ok(import) if import.len() >= extent => {
                    let import: Arc<dyn DeviceImport> = Arc::from(import);
                    opened.insert(
                        region.id,
                        DeviceRoute {
                            base: region.base,
                            import,
                        },
                    );
                }
                Ok(_) => {
                    eprintln!("kvcr: no one-hop route to {peer}: an import is short");
                    return DeviceRoutes::new();
                }
                Err(e) => {
                    eprintln!("kvcr: no one-hop route to {peer}: {e}");
                    return DeviceRoutes::new();
                }
            }
        }
        opened
    }

    /// A one-hop write the core asked for: each span's destination turned
    /// into an offset in its region's import (the core checked it against
    /// the advert; the import checks it against the export again), copied
    /// on the writer's thread.
    pub(super) fn write_device(
        &mut self,
        shared: &Arc<Shared>,
        write: u64,
        route: Option<&Route>,
        spans: &[PutSpan],
        lead: usize,
    ) {
        let plan = route.and_then(|route| device_plan(&route.device, spans));
        let copier: Option<Arc<dyn DeviceCopier>> = shared.lock().device.clone();
        let queued = match (plan, copier) {
            (Some(copies), Some(copier)) => {
                let job = Job {
                    write,
                    copies,
                    copier,
                    lead,
                };
                self.one_hop
                    .submit(job, &self.lane_done_tx, &self.leads_landed_tx)
            }
            _ => false,
        };
        if !queued {
            shared.with_core_now(|core, now| core.handle_put_done(now, write, false));
        }
    }
}

/// The copies of a one-hop write, page by page: `src` in our pool, `dst`
/// the offset from the region's base. A page ends where a region recurs
/// (a page names each of its elements' regions once, in layout order).
/// `None` if a span names a region this route did not open, or lies
/// before its base.
fn device_plan(opened: &DeviceRoutes, spans: &[PutSpan]) -> Option<Copies> {
    let mut pages: Copies = Vec::new();
    let mut page: Vec<Copy> = Vec::new();
    for span in spans {
        let route = opened.get(&span.region)?;
        let dst = span.remote.checked_sub(route.base)?;
        if page.iter().any(|(r, ..)| *r == span.region) {
            pages.push(std::mem::take(&mut page));
        }
        page.push((
            span.region,
            Arc::clone(&route.import),
            CopySpan {
                src: span.local,
                dst,
                len: span.len,
            },
        ));
    }
    if !page.is_empty() {
        pages.push(page);
    }
    Some(pages)
}

#[cfg(test)]
mod tests {
    //! `copy_writes` over a recording copier (no memory is touched: the
    //! plan is what is under test; the byte-level route runs between
    //! processes in `tests/it/one_hop.rs`).

    use std::sync::Mutex;

    use super::*;
    use kvcr_runner_core::PoolRange;

    /// An import whose extent starts at address `base`.
    struct Extent {
        base: u64,
        len: u64,
    }

    impl DeviceImport for Extent {
        fn len(&self) -> u64 {
            self.len
        }
        fn copy_into(&self, _: &[&[CopySpan]]) -> crate::error::Result<()> {
            Ok(())
        }
        fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
            (offset.checked_add(len)? <= self.len).then_some(self.base + offset)
        }
    }

    /// Records each pass's keys; refuses a pass naming `poison` as a source.
    #[derive(Default)]
    struct Recorder {
        passes: Mutex<Vec<usize>>,
        poison: u64,
    }

    impl DeviceCopier for Recorder {
        fn attach(&self, _: &[PoolRange]) -> crate::error::Result<()> {
            Ok(())
        }
        fn copy(&self, _: &[&[CopySpan]]) -> crate::error::Result<()> {
            Ok(())
        }
        fn detach(&self, _: &[PoolRange]) {}
        fn copy_to_imports(&self, keys: &[&[CopySpan]]) -> crate::error::Result<()> {
            self.passes.lock().unwrap().push(keys.len());
            if keys
                .iter()
                .flat_map(|k| k.iter())
                .any(|s| s.src == self.poison)
            {
                return Err(crate::error::Error::runner(
                    kvcr_runner_core::RunnerReason::DeviceCopy(kvcr_contracts::error::Echo::new(
                        "poisoned",
                    )),
                ));
            }
            Ok(())
        }
    }

    /// Write `id` of `pages` pages, page `p` from source `src + p`.
    fn job(
        id: u64,
        pages: u64,
        src: u64,
        import: &Arc<dyn DeviceImport>,
        copier: &Arc<Recorder>,
    ) -> Job {
        led(id, pages, src, import, copier, 0)
    }

    /// As [`job`], asking a report of each page's first `lead` spans.
    fn led(
        id: u64,
        pages: u64,
        src: u64,
        import: &Arc<dyn DeviceImport>,
        copier: &Arc<Recorder>,
        lead: usize,
    ) -> Job {
        let copies = (0..pages)
            .map(|p| {
                vec![(
                    RegionId(0),
                    Arc::clone(import),
                    CopySpan {
                        src: src + p,
                        dst: p * 16,
                        len: 16,
                    },
                )]
            })
            .collect();
        let copier: Arc<dyn DeviceCopier> = Arc::clone(copier) as Arc<dyn DeviceCopier>;
        Job {
            write: id,
            copies,
            copier,
            lead,
        }
    }

    /// An import of `len` bytes at address 1 MiB, and a recording copier
    /// that refuses any pass reading source `poison`.
    fn setup(len: u64, poison: u64) -> (Arc<dyn DeviceImport>, Arc<Recorder>) {
        let import: Arc<dyn DeviceImport> = Arc::new(Extent { base: 1 << 20, len });
        let copier = Arc::new(Recorder {
            poison,
            ..Recorder::default()
        });
        (import, copier)
    }

    /// Runs `jobs`, returning each write's outcome (sorted) and the writes
    /// whose lead was reported.
    fn run(jobs: &[Job]) -> (Vec<(u64, bool)>, Vec<u64>) {
        let leads = Mutex::new(Vec::new());
        let mut outcomes = copy_writes(jobs, &|write| leads.lock().unwrap().push(write));
        outcomes.sort_unstable();
        (outcomes, leads.into_inner().unwrap())
    }

    #[test]
    fn queued_writes_share_one_pass() {
        let (import, copier) = setup(1 << 10, u64::MAX);
        let jobs = [
            job(1, 4, 100, &import, &copier),
            job(2, 3, 200, &import, &copier),
        ];
        let (outcomes, leads) = run(&jobs);
        assert!(leads.is_empty(), "no lead asked, none reported");
        assert_eq!(outcomes, [(1, true), (2, true)]);
        assert_eq!(
            *copier.passes.lock().unwrap(),
            [7],
            "one pass of every page"
        );
    }

    /// Writes asking the same lead share a pass and each hears its lead
    /// landed; one asking another lead runs alone, and a write run alone
    /// says nothing early (its own `write_done` says it all).
    #[test]
    fn a_pass_reports_its_writes_leads() {
        let (import, copier) = setup(1 << 10, u64::MAX);
        let jobs = [
            led(1, 2, 100, &import, &copier, 2),
            led(2, 3, 200, &import, &copier, 1),
            led(3, 1, 300, &import, &copier, 2),
        ];
        let (outcomes, leads) = run(&jobs);
        assert_eq!(outcomes, [(1, true), (2, true), (3, true)]);
        assert_eq!(leads, [1, 3]);
        assert_eq!(*copier.passes.lock().unwrap(), [3, 3]);
    }

    /// The writer hands a turn's writes over only at [`OneHopWriter::flush`],
    /// and they go in one pass with every lead reported before its write's
    /// end (however soon its thread would have woken to the first).
    #[test]
    fn a_turns_writes_go_to_the_writer_together() {
        let (import, copier) = setup(1 << 10, u64::MAX);
        let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
        let (leads_tx, mut leads) = tokio::sync::mpsc::unbounded_channel();
        let passes = Arc::new(AtomicU64::new(0));
        let mut writer = OneHopWriter::new(Arc::clone(&passes));
        for (id, pages) in [(1, 2), (2, 3), (3, 1)] {
            let job = led(id, pages, id * 100, &import, &copier, 1);
            assert!(writer.submit(job, &done_tx, &leads_tx));
        }
        assert!(
            copier.passes.lock().unwrap().is_empty(),
            "nothing copies before the turn ends"
        );
        writer.flush();
        let mut outcomes: Vec<(u64, bool)> =
            (0..3).map(|_| done.blocking_recv().unwrap()).collect();
        outcomes.sort_unstable();
        assert_eq!(outcomes, [(1, true), (2, true), (3, true)]);
        let mut reported: Vec<u64> = std::iter::from_fn(|| leads.try_recv().ok()).collect();
        reported.sort_unstable();
        assert_eq!(reported, [1, 2, 3], "each lead, before the ends");
        assert_eq!(*copier.passes.lock().unwrap(), [6], "one pass");
        assert_eq!(passes.load(Ordering::Relaxed), 1, "counted once");
        drop(writer);
        assert!(done.try_recv().is_err(), "each write reported once");
    }

    /// A write queued as the writer drops is still run, not lost.
    #[test]
    fn a_write_queued_at_drop_is_run() {
        let (import, copier) = setup(1 << 10, u64::MAX);
        let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
        let (leads_tx, _leads) = tokio::sync::mpsc::unbounded_channel();
        let mut writer = OneHopWriter::default();
        assert!(writer.submit(job(7, 2, 100, &import, &copier), &done_tx, &leads_tx));
        drop(writer);
        assert_eq!(done.try_recv().ok(), Some((7, true)));
        assert_eq!(*copier.passes.lock().unwrap(), [2]);
    }

    /// A pass that fails reports no lead (its copies' bytes are unknown).
    #[test]
    fn a_failed_pass_reports_no_lead() {
        let (import, copier) = setup(1 << 10, 100);
        let (outcomes, leads) = run(&[led(1, 2, 100, &import, &copier, 2)]);
        assert_eq!(outcomes, [(1, false)]);
        assert!(leads.is_empty(), "{leads:?}");
    }

    #[test]
    fn a_failed_pass_is_run_again_write_by_write() {
        let (import, copier) = setup(1 << 10, 301);
        let jobs = [
            job(1, 2, 100, &import, &copier),
            job(2, 2, 300, &import, &copier),
            job(3, 1, 500, &import, &copier),
        ];
        let (outcomes, leads) = run(&jobs);
        assert!(leads.is_empty(), "no lead asked, none reported");
        assert_eq!(outcomes, [(1, true), (2, false), (3, true)]);
        assert_eq!(*copier.passes.lock().unwrap(), [5, 2, 2, 1]);
    }

    #[test]
    fn a_write_no_import_resolves_goes_alone() {
        let (import, copier) = setup(32, u64::MAX);
        // Write 2's third page lies past the 32-byte extent: it cannot join
        // the pass, and its import-by-import copy is the import's call.
        let jobs = [
            job(1, 2, 100, &import, &copier),
            job(2, 3, 200, &import, &copier),
        ];
        let (outcomes, leads) = run(&jobs);
        assert!(leads.is_empty(), "no lead asked, none reported");
        assert_eq!(outcomes, [(1, true), (2, true)]);
        assert_eq!(
            *copier.passes.lock().unwrap(),
            [2],
            "only write 1 in the pass"
        );
    }
}
