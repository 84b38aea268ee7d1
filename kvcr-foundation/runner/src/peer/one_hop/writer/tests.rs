//! The schedule over a recording copier (no memory is touched: the
//! plan is what is under test; the byte-level route runs between
//! processes in `tests/it/one_hop.rs`, and on a GPU in the direct
//! linker's `one_hop_peer` tests).

use std::sync::Mutex;

use super::super::{DeviceRoute, DeviceRoutes};
use super::*;
use crate::copy::device::DeviceImport;
use kvcr_contracts::protocol::RegionId;
use kvcr_runner_core::PoolRange;

/// An import whose extent starts at address `base` (`None`: it cannot be
/// addressed, and is copied into by offset).
struct Extent {
    base: Option<u64>,
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
        (offset.checked_add(len)? <= self.len).then_some(self.base? + offset)
    }
}

/// Records each pass's sources, in issue order; refuses a pass naming
/// `poison` as a source.
#[derive(Default)]
struct Recorder {
    passes: Mutex<Vec<Vec<u64>>>,
    poison: u64,
}

impl Recorder {
    fn passes(&self) -> Vec<Vec<u64>> {
        self.passes.lock().unwrap().clone()
    }
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
        let sources: Vec<u64> = keys.iter().flat_map(|k| k.iter()).map(|s| s.src).collect();
        let poisoned = sources.contains(&self.poison);
        self.passes.lock().unwrap().push(sources);
        if poisoned {
            return Err(crate::error::Error::runner(
                kvcr_runner_core::RunnerReason::DeviceCopy(kvcr_contracts::error::Echo::new(
                    "poisoned",
                )),
            ));
        }
        Ok(())
    }
}

/// Write `id`: `pages` pages of `spans` 16-byte spans each, span `i` of
/// page `p` read from source `src + 10 p + i`; its first `lead` spans
/// per page are its lead.
fn write(
    id: u64,
    (pages, spans): (u64, u64),
    src: u64,
    lead: usize,
    (import, copier): &(Arc<dyn DeviceImport>, Arc<Recorder>),
) -> Job {
    let route = DeviceRoute::new(0, Arc::clone(import));
    // As the plan names them: addresses where the import has one.
    let at = route.address;
    let copies: Copies = (0..pages)
        .map(|p| {
            (0..spans)
                .map(|i| {
                    (
                        0,
                        CopySpan {
                            src: src + 10 * p + i,
                            dst: (p * spans + i) * 16,
                            len: 16,
                        },
                    )
                })
                .collect()
        })
        .collect();
    let pages = match at {
        Some(at) => Pages::Addressed(
            copies
                .iter()
                .map(|page| {
                    page.iter()
                        .map(|(_, s)| CopySpan {
                            dst: at + s.dst,
                            ..*s
                        })
                        .collect()
                })
                .collect(),
        ),
        None => Pages::ByRegion(copies),
    };
    Job {
        write: id,
        routes: Arc::new(
            DeviceRoutes::new(vec![(RegionId(0), route)], Arc::clone(copier) as _).unwrap(),
        ),
        pages,
        copier: Arc::clone(copier) as Arc<dyn DeviceCopier>,
        lead,
    }
}

/// An import of `len` bytes at address 1 MiB, and a recording copier
/// that refuses any pass reading source `poison`.
fn setup(len: u64, poison: u64) -> (Arc<dyn DeviceImport>, Arc<Recorder>) {
    setup_at(Some(1 << 20), len, poison)
}

/// [`setup`], the import at address `base` (`None`: not addressed).
fn setup_at(base: Option<u64>, len: u64, poison: u64) -> (Arc<dyn DeviceImport>, Arc<Recorder>) {
    let import: Arc<dyn DeviceImport> = Arc::new(Extent { base, len });
    let copier = Arc::new(Recorder {
        poison,
        ..Recorder::default()
    });
    (import, copier)
}

/// What a schedule said, in order: `Lead(write)` or `Done(write, ok)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heard {
    Lead(u64),
    Done(u64, bool),
}

/// The tests' quiet period (ns).
const QUIET: u64 = 1_000_000;

/// The tests' longest chunk deferral (ns).
const DEFERRAL: u64 = 3_000_000;

/// Steps `stream` once with `jobs`, a second after its last step (long
/// past any quiet period the tests set); what it said and the passes it
/// counted.
fn step(stream: &mut Stream, jobs: Vec<Job>) -> (Vec<Heard>, u64) {
    let now = stream.last_arrival.map_or(0, |at| at + 1_000_000_000);
    step_at(stream, jobs, now)
}

/// As [`step`], at `now` (ns).
fn step_at(stream: &mut Stream, jobs: Vec<Job>, now: u64) -> (Vec<Heard>, u64) {
    step_with(stream, jobs, now, &mut || false)
}

/// As [`step_at`], `queued` saying whether writes came meanwhile.
fn step_with(
    stream: &mut Stream,
    jobs: Vec<Job>,
    now: u64,
    queued: &mut dyn FnMut() -> bool,
) -> (Vec<Heard>, u64) {
    let heard = Mutex::new(Vec::new());
    let passes = PassCounters::default();
    let mut said = Said {
        lead: &|w| heard.lock().unwrap().push(Heard::Lead(w)),
        done: &|w, ok| heard.lock().unwrap().push(Heard::Done(w, ok)),
        passes: &passes,
    };
    stream.step(jobs, now, &mut said, queued);
    (heard.into_inner().unwrap(), passes.passes.into_inner())
}

/// Writes that ask no lead go in one pass of every page, in span-index
/// order across pages, and end together.
#[test]
fn writes_without_a_lead_share_one_pass() {
    let setup = setup(1 << 10, u64::MAX);
    let mut stream = Stream::new(CHUNK_BYTES, CHUNK_BYTES, QUIET, DEFERRAL);
    let jobs = vec![
        write(1, (2, 2), 100, 0, &setup),
        write(2, (1, 2), 200, 0, &setup),
    ];
    let (heard, passes) = step(&mut stream, jobs);
    assert_eq!(heard, [Heard::Done(1, true), Heard::Done(2, true)]);
    assert_eq!(passes, 1);
    assert_eq!(setup.1.passes(), [vec![100, 101, 110, 111, 200, 201]]);
    assert!(stream.is_idle());
}

/// The leads of every write that arrived go first, together, and are
/// reported; the rest follows chunk by chunk, oldest first; a write
/// that arrives meanwhile has its lead copied before the older
/// writes' rest goes on.
#[test]
fn new_writes_leads_go_before_older_writes_rest() {
    let setup = setup(1 << 10, u64::MAX);
    // A chunk holds one write's rest (two pages of two 16-byte spans).
    let mut stream = Stream::new(64, 64, QUIET, DEFERRAL);
    let (heard, passes) = step(
        &mut stream,
        vec![
            write(1, (2, 3), 100, 1, &setup),
            write(2, (2, 3), 200, 1, &setup),
        ],
    );
    assert_eq!(
        heard,
        [Heard::Lead(1), Heard::Lead(2), Heard::Done(1, true)]
    );
    assert_eq!(passes, 2);
    let (heard, _) = step(&mut stream, vec![write(3, (1, 3), 300, 1, &setup)]);
    assert_eq!(heard, [Heard::Lead(3), Heard::Done(2, true)]);
    let (heard, _) = step(&mut stream, Vec::new());
    assert_eq!(heard, [Heard::Done(3, true)]);
    assert!(stream.is_idle());
    assert_eq!(
        setup.1.passes(),
        [
            vec![100, 110, 200, 210],
            vec![101, 102, 111, 112],
            vec![300],
            vec![201, 202, 211, 212],
            vec![301, 302],
        ]
    );
}

/// A step that took new writes copies a short chunk of the rest (more
/// writes may be arriving, whose leads then wait less); a step that
/// took none copies a long one.
#[test]
fn a_step_that_took_writes_copies_a_short_chunk() {
    let setup = setup(1 << 10, u64::MAX);
    let mut stream = Stream::new(1 << 10, 32, QUIET, DEFERRAL);
    let jobs = (1..=3)
        .map(|id| write(id, (1, 3), id * 100, 1, &setup))
        .collect();
    let (heard, _) = step(&mut stream, jobs);
    assert_eq!(
        heard,
        [
            Heard::Lead(1),
            Heard::Lead(2),
            Heard::Lead(3),
            Heard::Done(1, true)
        ]
    );
    let (heard, _) = step(&mut stream, Vec::new());
    assert_eq!(heard, [Heard::Done(2, true), Heard::Done(3, true)]);
    assert_eq!(
        setup.1.passes(),
        [
            vec![100, 200, 300],
            vec![101, 102],
            vec![201, 202, 301, 302]
        ]
    );
}

/// Within the quiet period after writes arrived, a step that took none
/// still copies a short chunk (the restore's next writes may be a turn
/// away); after it, a long one.
#[test]
fn chunks_stay_short_until_arrivals_go_quiet() {
    let setup = setup(1 << 10, u64::MAX);
    // A short chunk holds one write's rest (one page of two 16-byte spans).
    let mut stream = Stream::new(1 << 10, 32, QUIET, DEFERRAL);
    let jobs = (1..=3)
        .map(|id| write(id, (1, 2), id * 100, 0, &setup))
        .collect();
    let (heard, _) = step_at(&mut stream, jobs, 1_000);
    assert_eq!(heard, [Heard::Done(1, true)], "arriving: one write's rest");
    let (heard, _) = step_at(&mut stream, Vec::new(), 1_000 + QUIET - 1);
    assert_eq!(
        heard,
        [Heard::Done(2, true)],
        "still within the quiet period"
    );
    let job = write(4, (1, 2), 400, 0, &setup);
    let (heard, _) = step_at(&mut stream, vec![job], 1_000 + QUIET);
    assert_eq!(heard, [Heard::Done(3, true)], "a new arrival restarts it");
    let (heard, _) = step_at(&mut stream, Vec::new(), 1_000 + 2 * QUIET);
    assert_eq!(heard, [Heard::Done(4, true)]);
    assert!(stream.is_idle());
    let jobs = (5..=8)
        .map(|id| write(id, (1, 2), id * 100, 0, &setup))
        .collect();
    let (heard, _) = step_at(&mut stream, jobs, 10 * QUIET);
    assert_eq!(heard, [Heard::Done(5, true)]);
    let (heard, _) = step_at(&mut stream, Vec::new(), 10 * QUIET + QUIET / 2);
    assert_eq!(heard, [Heard::Done(6, true)]);
    let (heard, _) = step_at(&mut stream, Vec::new(), 11 * QUIET);
    assert_eq!(
        heard,
        [Heard::Done(7, true), Heard::Done(8, true)],
        "quiet: one long chunk takes the rest"
    );
}

/// A write whose rest is more than a chunk goes in pieces of span indices
/// across its pages, a lead that arrives meanwhile between them, and is
/// done after its last piece.
#[test]
fn a_write_longer_than_a_chunk_goes_in_pieces() {
    let setup = setup(1 << 10, u64::MAX);
    // Short chunks of 32 bytes: one span index of a two-page write.
    let mut stream = Stream::new(1 << 10, 32, QUIET, DEFERRAL);
    let (heard, passes) = step(&mut stream, vec![write(1, (2, 4), 100, 1, &setup)]);
    assert_eq!(
        heard,
        [Heard::Lead(1)],
        "one piece copied, the write not done"
    );
    assert_eq!(passes, 2);
    let (heard, _) = step(&mut stream, vec![write(2, (1, 2), 200, 1, &setup)]);
    assert_eq!(heard, [Heard::Lead(2)], "a lead, then the next piece");
    let (heard, _) = step(&mut stream, Vec::new());
    assert_eq!(
        heard,
        [Heard::Done(1, true), Heard::Done(2, true)],
        "quiet: a long chunk takes what is left of both"
    );
    assert!(stream.is_idle());
    assert_eq!(
        setup.1.passes(),
        [
            vec![100, 110],
            vec![101, 111],
            vec![200],
            vec![102, 112],
            vec![103, 113, 201]
        ]
    );
}

/// A piece whose pass fails is run once more alone; failed again, its
/// write fails and leaves the stream.
#[test]
fn a_failed_piece_is_run_again_then_fails_its_write() {
    let setup = setup(1 << 10, 111);
    let mut stream = Stream::new(1 << 10, 32, QUIET, DEFERRAL);
    let (heard, passes) = step(&mut stream, vec![write(1, (2, 4), 100, 1, &setup)]);
    assert_eq!(heard, [Heard::Lead(1), Heard::Done(1, false)]);
    assert_eq!(passes, 2, "the retry is not a pass of the stream");
    assert!(stream.is_idle());
    assert_eq!(
        setup.1.passes(),
        [vec![100, 110], vec![101, 111], vec![101, 111]]
    );
}

/// Writes queued behind a step's lead pass have their leads copied
/// before its chunk, step after step, for at most the deferral bound in a
/// row: then the chunk is copied whatever is queued, so the rest never
/// starves, and the bound starts afresh.
#[test]
fn queued_writes_leads_go_before_a_chunk_for_a_bounded_time() {
    let setup = setup(1 << 10, u64::MAX);
    let mut stream = Stream::new(1 << 10, 1 << 10, QUIET, DEFERRAL);
    let queued = &mut || true;
    let first = vec![write(1, (1, 2), 100, 1, &setup)];
    let (heard, _) = step_with(&mut stream, first, 0, queued);
    assert_eq!(heard, [Heard::Lead(1)], "chunk deferred");
    let second = vec![write(2, (1, 2), 200, 1, &setup)];
    let (heard, _) = step_with(&mut stream, second, DEFERRAL - 1, queued);
    assert_eq!(heard, [Heard::Lead(2)], "deferred again, within the bound");
    let third = vec![write(3, (1, 2), 300, 1, &setup)];
    let (heard, _) = step_with(&mut stream, third, DEFERRAL, queued);
    assert_eq!(
        heard,
        [
            Heard::Lead(3),
            Heard::Done(1, true),
            Heard::Done(2, true),
            Heard::Done(3, true)
        ],
        "at the bound the chunk goes though more are queued"
    );
    let fourth = vec![write(4, (1, 2), 400, 1, &setup)];
    let (heard, _) = step_with(&mut stream, fourth, DEFERRAL + 1, queued);
    assert_eq!(heard, [Heard::Lead(4)], "the bound starts afresh");
    let (heard, _) = step_with(&mut stream, Vec::new(), DEFERRAL + 2, &mut || false);
    assert_eq!(
        heard,
        [Heard::Done(4, true)],
        "nothing queued: the chunk goes"
    );
    assert_eq!(
        setup.1.passes(),
        [
            vec![100],
            vec![200],
            vec![300],
            vec![101, 201, 301],
            vec![400],
            vec![401]
        ]
    );
}

/// A failed lead pass reports no lead (the bytes are unknown): each
/// write that asked one is run whole, alone, and ends as its own pass
/// did.
#[test]
fn a_failed_lead_pass_reports_no_lead() {
    let setup = setup(1 << 10, 100);
    let mut stream = Stream::new(CHUNK_BYTES, CHUNK_BYTES, QUIET, DEFERRAL);
    let (heard, _) = step(
        &mut stream,
        vec![
            write(1, (1, 2), 100, 1, &setup),
            write(2, (1, 2), 200, 1, &setup),
        ],
    );
    assert_eq!(heard, [Heard::Done(1, false), Heard::Done(2, true)]);
    assert!(stream.is_idle());
}

/// A failed chunk is run again write by write (the slots stay granted
/// until we report, and the bytes are the same): only the bad write
/// fails.
#[test]
fn a_failed_chunk_is_run_again_write_by_write() {
    let setup = setup(1 << 10, 301);
    let mut stream = Stream::new(CHUNK_BYTES, CHUNK_BYTES, QUIET, DEFERRAL);
    let jobs = vec![
        write(1, (2, 2), 100, 0, &setup),
        write(2, (1, 2), 300, 0, &setup),
        write(3, (1, 2), 500, 0, &setup),
    ];
    let (heard, passes) = step(&mut stream, jobs);
    assert_eq!(
        heard,
        [
            Heard::Done(1, true),
            Heard::Done(2, false),
            Heard::Done(3, true)
        ]
    );
    assert_eq!(passes, 1, "the retries are not passes of the stream");
    assert_eq!(setup.1.passes().len(), 4);
}

/// A write through an import that cannot be addressed runs alone, import
/// by import, and never joins the stream's passes.
#[test]
fn a_write_no_import_addresses_goes_alone() {
    let setup = setup(1 << 10, u64::MAX);
    let unaddressed = (setup_at(None, 1 << 10, u64::MAX).0, Arc::clone(&setup.1));
    let mut stream = Stream::new(CHUNK_BYTES, CHUNK_BYTES, QUIET, DEFERRAL);
    let jobs = vec![
        write(1, (1, 2), 100, 0, &setup),
        write(2, (2, 2), 200, 0, &unaddressed),
    ];
    let (heard, _) = step(&mut stream, jobs);
    assert_eq!(heard, [Heard::Done(2, true), Heard::Done(1, true)]);
    assert_eq!(setup.1.passes(), [vec![100, 101]], "only write 1 passes");
}

/// The writer hands a turn's writes over only at [`OneHopWriter::flush`],
/// and their leads go in one pass, each reported before its write's end.
#[test]
fn a_turns_writes_go_to_the_writer_together() {
    let setup = setup(1 << 10, u64::MAX);
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
    let (leads_tx, mut leads) = tokio::sync::mpsc::unbounded_channel();
    let passes = Arc::new(PassCounters::default());
    let mut writer = OneHopWriter::new(Arc::clone(&passes));
    for id in 1..=3 {
        let job = write(id, (2, 2), id * 100, 1, &setup);
        assert!(writer.submit(job, &done_tx, &leads_tx));
    }
    assert!(
        setup.1.passes().is_empty(),
        "nothing copies before the turn ends"
    );
    writer.flush();
    let mut outcomes: Vec<(u64, bool)> = (0..3).map(|_| done.blocking_recv().unwrap()).collect();
    outcomes.sort_unstable();
    assert_eq!(outcomes, [(1, true), (2, true), (3, true)]);
    let mut reported: Vec<u64> = std::iter::from_fn(|| leads.try_recv().ok()).collect();
    reported.sort_unstable();
    assert_eq!(reported, [1, 2, 3], "each lead, before the ends");
    assert_eq!(
        setup.1.passes(),
        [
            vec![100, 110, 200, 210, 300, 310],
            vec![101, 111, 201, 211, 301, 311]
        ],
        "one pass of the leads, one of the rest"
    );
    assert_eq!(passes.passes.load(Ordering::Relaxed), 2);
    assert!(
        passes.busy_ns.load(Ordering::Relaxed) > 0,
        "the time inside the passes is counted"
    );
    drop(writer);
    assert!(done.try_recv().is_err(), "each write reported once");
}

/// A turn that queues [`HAND_OVER_WRITES`] writes hands them over then,
/// without waiting for its end; one fewer waits for the flush.
#[test]
fn a_long_turn_hands_its_writes_over_in_groups() {
    let setup = setup(1 << 16, u64::MAX);
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
    let (leads_tx, _leads) = tokio::sync::mpsc::unbounded_channel();
    let mut writer = OneHopWriter::new(Arc::default());
    let group = HAND_OVER_WRITES as u64;
    for id in 1..group {
        assert!(writer.submit(write(id, (1, 1), id * 100, 0, &setup), &done_tx, &leads_tx));
    }
    assert!(setup.1.passes().is_empty(), "one short of a group: held");
    assert!(writer.submit(
        write(group, (1, 1), group * 100, 0, &setup),
        &done_tx,
        &leads_tx
    ));
    let mut outcomes: Vec<(u64, bool)> =
        (0..group).map(|_| done.blocking_recv().unwrap()).collect();
    outcomes.sort_unstable();
    let expected: Vec<(u64, bool)> = (1..=group).map(|id| (id, true)).collect();
    assert_eq!(outcomes, expected, "the group ran before any flush");
    assert!(writer.submit(
        write(group + 1, (1, 1), 9_000, 0, &setup),
        &done_tx,
        &leads_tx
    ));
    writer.flush();
    assert_eq!(done.blocking_recv(), Some((group + 1, true)));
}

/// A write queued as the writer drops is still run, not lost.
#[test]
fn a_write_queued_at_drop_is_run() {
    let setup = setup(1 << 10, u64::MAX);
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
    let (leads_tx, _leads) = tokio::sync::mpsc::unbounded_channel();
    let mut writer = OneHopWriter::new(Arc::default());
    assert!(writer.submit(write(7, (2, 1), 100, 0, &setup), &done_tx, &leads_tx));
    drop(writer);
    assert_eq!(done.try_recv().ok(), Some((7, true)));
    assert_eq!(setup.1.passes(), [vec![100, 110]]);
}
