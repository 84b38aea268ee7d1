//! A deterministic simulator for the peer protocol: sans-I/O cores on a
//! virtual network with seeded faults. Each run has two targets (which pull)
//! and two sources (which hold pages; their key sets overlap):
//! * each request's router hint names either source, so both targets pull
//!   from one source at once, the same keys too, by fetch and by deliver;
//! * write batching: each target cuts an operation's missing keys into
//!   `start_write`s of `write_batch_bytes` (per target and seed: 0, one
//!   write per operation; or 1 page, 2½ pages (2 keys), 3 pages), each
//!   landing on its own;
//! * copy lanes: each source runs its writes on 1..=4 lanes (per source and
//!   seed), a write cut into pieces over several lanes, the pieces of a lane
//!   one after the other; so several writes are in progress at once and
//!   their `handle_put_done` reports arrive in any order;
//! * faults on every peer: drops, duplicates and delays (hence reorders) of
//!   messages; failed pieces (the slot then holds garbage) and late ones;
//!   failed connects; a source's process stopped a while (past an operation
//!   timeout it finds itself stalled, refuses what waited meanwhile and
//!   serves again after its drain, as its driver does once the sessions
//!   opened before the stall are closed); crashes and restarts of either source
//!   at the same address (its old puts may still land; the targets may or
//!   may not see the connection drop); half of those crashes are
//!   guard-confirmed deaths: the guard saw the process exit (its pidfd), so
//!   each put it had in flight landed or did not at the crash, nothing of it
//!   lands later, and the restarted source is told the old incarnation dead
//!   (`set_dead_incarnations`, the guard's list of that address) and reports
//!   it in its probe answers; a hostile member that sends what nobody asked
//!   for (death reports too), and bursts of metadata that change every
//!   time (route churn);
//! * G3, the file tier, in half the seeds: each source holds 8 keys over a
//!   pool of 4 or 5 slots and 5 to 8 G3 slots (its policy moving victims to
//!   G3, spilling ahead or not), so some keys live only in G3 and a
//!   `start_write` naming them is prepared first (`SourcePrepare`: filled
//!   back into the pool, moving other pages to G3); the engine beside a
//!   source deposits its keys again now and then (more spills, G3
//!   evictions); each target has G3 half the time (its evictions spill, its
//!   fetches fill from G3, its delivers read G3 straight into the
//!   destination). A G3 job runs in virtual time and is reported after a
//!   seeded delay, in any order with everything else; a write fails (a full
//!   disk), a read fails (an I/O error), a cancelled key is skipped or not,
//!   and a source crashes mid-spill: each write it had in flight landed, or
//!   did not, or did in part, and the new process opens the same files with
//!   G3 empty.
//!
//! Virtual time moves event by event: messages arrive, pieces land, G3 jobs
//! end and each driver runs its turn (`handle_tick`) when due, as the real
//! driver sleeps until `peer_wake_at`; between events, requests and faults
//! are injected.
//!
//! After every step it checks the invariants of the design:
//! * every core's structural invariants (index, slots, claims, and G3's:
//!   `check_invariants` runs `check_g3`);
//! * per target, a slot that a put may still write is never free (no reuse
//!   before proof, and a quarantined destination stays owned however long),
//!   no two writes are ever in flight into one slot, and every put lands in
//!   the pool of the target that granted it;
//! * on every node, nothing reads a place (a pool slot, a G3 slot, a deliver
//!   destination) that a put or G3 transfer in flight writes, nor writes one
//!   that such a transfer reads or writes, and no slot a transfer of a live
//!   process still touches is free;
//! * every page a target commits holds the bytes of that key, checked when
//!   the commit happens, when a fetch returns the page and when a deliver
//!   copies it out (or reads it from G3). The model knows, per pool slot and
//!   G3 slot of every node, the key whose bytes are there: a deposit writes
//!   its key's, a spill copies a pool slot's into its G3 slot, a fill a G3
//!   slot's into a pool slot, a put a source slot's into the target slot; a
//!   failed transfer leaves garbage, and a failed read leaves its G3 slot
//!   garbage too (bytes G3 could not read are never to be served). So a
//!   page served from a G3 copy whose write failed, whose read failed (the
//!   copy is poisoned), or that an earlier process left in the files
//!   (garbage, another key's bytes) shows up as wrong bytes at the target;
//! * a write ended after its operation's deadline (the target probed it)
//!   never commits; an operation completes exactly once; a key failed by
//!   deadline is never reported a success;
//! * a source builds routes to a target no faster than its route budget
//!   (`RouteBudget`): in any window, at most the burst plus one per refill.
//!
//! So a death report believed for an incarnation that may still write (a
//! crash the guard did not confirm, another endpoint's claim, another
//! incarnation than the op's) frees a slot one of its late puts then lands
//! in, and the run fails.
//!
//! The many-seeds test also counts what happened (operations split into
//! several writes, reports out of order, writes of both sources, commits on
//! both targets, spills, fills on sources and targets, failed spills and
//! fills, crashes mid-spill, guard-confirmed deaths, quarantined slots freed
//! by a death report, ...) and fails when some of it never did.
//!
//! A failing seed is reproducible from its number:
//! `KVCR_SIM_SEED=<n> cargo test -p kvcr-runner-core --lib sim::`.

mod checks;
mod device;
mod faults;
mod g3;
mod memory;
mod net;
mod node;
mod puts;
mod scenarios;
mod world;

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::machine::{
    Action, CopyOutcome, Core, CoreConfig, G3Config, G3Direction, G3Transfer, JobId, PeerConfig,
    PutSpan,
};
use crate::policy::{G3Lru, Lru};
use crate::*;
use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::hint::{FetchHint, FetchMode, RequestId};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::key::{BlockKey, CompatDigest, Namespace, NamespaceId, ScopedKey};
use kvcr_contracts::protocol::{
    Body, CompletedIndices, DoorbellAdvert, ElementRef, Header, Message, OpHandle, RegionAdvert,
    RegionId, RouteGeneration, SegmentAdvert, SharedMemoryAdvert, WriteOutcome,
};
use kvcr_contracts::tier::{InventoryEvent, Medium};

use node::*;

const BLOCK: u64 = 64;
const SLOTS: u32 = 8;
const TIMEOUT: u64 = 1_000_000; // 1 ms of virtual time
/// Every core's route budget ([`RouteBudget`]), scaled to virtual time.
const ROUTE_BURST: u32 = 2;
const ROUTE_REFILL: u64 = TIMEOUT / 5;
/// Target `t`'s pool is at `TARGET_POOL + t * POOL_STEP`, source `s`'s at
/// `SOURCE_POOL + s * POOL_STEP`.
const TARGET_POOL: u64 = 0x1000_0000;
const SOURCE_POOL: u64 = 0x2000_0000;
const POOL_STEP: u64 = 0x0100_0000;
/// A source's host region (the engine's memory it deposits from): element
/// `i` holds the bytes of the source's key `first + i`.
const SOURCE_HOST: u64 = 0x3000_0000;
const SOURCE_HOST_ELEMENTS: u64 = 64;
/// The targets' framework region, where delivers copy pages to.
const FRAMEWORK: u64 = 0x4000_0000;
const FRAMEWORK_ELEMENTS: u64 = 1 << 16;
const TARGET_PORTS: [u16; 2] = [1, 3];
const SOURCE_PORTS: [u16; 2] = [2, 4];
/// Source `s` holds keys `SOURCE_FIRST_KEY[s]..+SOURCE_KEYS` (4..8 on both).
const SOURCE_FIRST_KEY: [u64; 2] = [0, 4];
const SOURCE_KEYS: u64 = 8;
/// Requests name keys below this (the last ones on no source).
const KEYS: u64 = 14;
/// The port of the misbehaving member.
const HOSTILE: u16 = 9;
/// What a slot holds after a failed piece or G3 transfer wrote it, and what
/// a slot nothing ever wrote holds.
const GARBAGE: u64 = u64::MAX;

// The simulator's state. Its types live here, above the files that read
// and change it (one file per part of the simulator), so that their fields
// stay private to the simulator as a whole.

struct Rng(u64);

/// A node's memory tiers: its pool's slots, and G3 under them when set (its
/// policy then moves victims to G3, as the runner's default does).
#[derive(Debug, Clone, Copy)]
struct Tiers {
    slots: u32,
    g3: Option<G3Config>,
}

/// What the model knows a node's memory holds: per pool slot and per G3
/// slot, the key whose bytes are there (`GARBAGE`: bytes of no key). G3's
/// files outlive a source's process: a restarted source opens the same
/// files, whose old contents it must never serve.
#[derive(Debug, Default)]
struct Contents {
    dram: HashMap<u64, u64>,
    files: HashMap<u32, u64>,
}

/// One piece of a write in flight from a source into a target slot.
/// A write sent as one message (bytes and completion together): the
/// target copies it into the operation's landing spans and takes it as the
/// `write_done`, or drops it.
#[derive(Debug)]
struct InFlightMessage {
    source: usize,
    incarnation: u128,
    target: usize,
    op: OpHandle,
    keys: u32,
    /// The (target slot, key) pairs the source addressed, in order.
    pieces: Vec<(u64, u64)>,
    arrives_at: u64,
    lost: bool,
}

#[derive(Debug, Clone, Copy)]
struct InFlightPut {
    source: usize,
    incarnation: u128,
    write: u64,
    target: usize,
    slot: u64,
    /// The source's pool slot it reads.
    from: u64,
    /// The key whose bytes it carries (what `from` held when it started;
    /// nothing may write `from` until it landed).
    key: u64,
    done_at: u64,
    ok: bool,
    seq: u64,
}

/// A write (an `Action::Put`) whose pieces have not all landed.
#[derive(Debug, Clone, Copy)]
struct WriteTrack {
    target: usize,
    left: usize,
    ok: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    Target(usize),
    Source(usize),
}

/// A place a G3 transfer reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// A pool slot.
    Dram(u64),
    /// A G3 slot.
    File(u32),
    /// An element of a target's framework region (a direct deliver).
    Element(u64),
}

/// One span of a G3 job in flight: it reads `from` and writes `to`,
/// carrying the key whose bytes `from` held when it started (nothing may
/// write `from`, nor touch `to`, until the job is reported).
#[derive(Debug, Clone, Copy)]
struct G3Span {
    from: Place,
    to: Place,
    bytes: u64,
    ok: bool,
    store: bool,
}

/// An `Action::G3` job in flight on one node (a source's, of the
/// incarnation that issued it), reported after a seeded delay.
#[derive(Debug, Clone)]
struct InFlightG3 {
    peer: Peer,
    incarnation: u128,
    job: JobId,
    /// Per key, its spans.
    keys: Vec<Vec<G3Span>>,
    /// Keys the core cancelled (the driver may skip them, or not).
    cancelled: Vec<bool>,
    done_at: u64,
    seq: u64,
}

/// A destination, and what the model knows about its memory.
struct Target {
    core: Core,
    endpoint: ControlEndpoint,
    pool: u64,
    tiers: Tiers,
    framework: RegionId,
    /// `dram`: the last key whose bytes landed in each slot, by a put or a
    /// G3 fill (`GARBAGE`: a failed one's); `files`: each G3 slot's.
    memory: Contents,
    /// Per target operation, the (key, slot) pairs its `start_write` granted.
    grants: HashMap<OpHandle, Vec<(u64, u64)>>,
    /// Target operations probed (past their deadline): they never commit.
    probed: HashSet<OpHandle>,
    /// Framework element -> the key a deliver wants there, and whether a
    /// copy of that key's bytes reached it.
    deliveries: HashMap<u64, (u64, bool)>,
    /// Deliver ops: (op, key) -> framework element.
    deliver_elements: HashMap<(OpHandle, u64), u64>,
    next_element: u64,
    completed_ops: HashSet<OpHandle>,
    timed_out: HashSet<(OpHandle, ScopedKey)>,
    /// Keys this target committed (some run).
    committed: HashSet<u64>,
}

/// A source: its core, its memory, and its driver's lanes and routes.
struct Source {
    core: Core,
    endpoint: ControlEndpoint,
    pool: u64,
    tiers: Tiers,
    /// Its host region (deposits copy from it).
    host: RegionId,
    incarnation: u128,
    restarts: u128,
    /// What each pool slot and each G3 slot holds.
    memory: Contents,
    /// Pool slots whose bytes a G3 fill brought (until a deposit rewrites
    /// them).
    filled_from_g3: HashSet<u64>,
    /// When each copy lane is next free.
    lane_free_at: Vec<u64>,
    next_lane: usize,
    /// The driver's route per target: the generation it connected.
    routes: HashMap<ControlEndpoint, u64>,
    /// When this process's driver was asked to build each route, per
    /// target.
    route_builds: HashMap<ControlEndpoint, Vec<u64>>,
    /// Highest write reported by this incarnation.
    max_reported: u64,
    /// Its process is stopped until then: no driver turn, no message handled,
    /// no put or G3 job reported.
    asleep_until: u64,
}

/// What a run exercised: the many-seeds test sums these and checks that the
/// new coverage happened.
#[derive(Debug, Default, Clone, Copy)]
struct Coverage {
    /// Fetches and delivers.
    requests: u64,
    /// Requests whose missing keys went out as more than one `start_write`.
    split_requests: u64,
    /// Puts started, per source.
    writes: [u64; 2],
    /// Puts cut into pieces on several lanes.
    multi_lane_writes: u64,
    /// Puts started while the same source had another write in progress.
    concurrent_writes: u64,
    /// Puts started while the same source wrote for the other target.
    shared_source_writes: u64,
    /// Put reports with a lower write id than one already reported.
    out_of_order_reports: u64,
    /// Pages committed, per target.
    committed: [u64; 2],
    /// Keys committed on both targets (per run).
    overlapping_keys: u64,
    /// Fetch and deliver successes, per target.
    successes: [u64; 2],
    /// Deliver entries that succeeded (their copies checked).
    delivered: u64,
    /// Write ends the target received after probing the op.
    late_ends: u64,
    failed_pieces: u64,
    late_pieces: u64,
    crashes: u64,
    /// Source processes stopped past an operation timeout.
    stalls: u64,
    /// Sources that served again after a stall (their drain over).
    stall_recoveries: u64,
    quarantined: u64,
    timeouts: u64,
    /// Runs whose sources had G3 under a pool smaller than their keys.
    g3_runs: u64,
    /// Spans written into G3 (spills, moves and ahead), and those that
    /// failed (a full disk).
    spills: u64,
    failed_spills: u64,
    /// Spans a source read back from G3 to serve a `start_write`
    /// (`SourcePrepare`), a target read into its pool, or read straight into
    /// a deliver's destination; and reads that failed.
    source_fills: u64,
    target_fills: u64,
    g3_delivers: u64,
    failed_fills: u64,
    /// Pages put to a target from a pool slot a G3 fill wrote.
    served_from_g3: u64,
    /// Source crashes while it was writing into G3.
    crashes_mid_spill: u64,
    /// G3 pages evicted for room (by the cores' counters).
    g3_evictions: u64,
    /// Source crashes the guard confirmed (the old puts resolved at once).
    guarded_crashes: u64,
    /// Puts in flight at a guard-confirmed crash (each landed or not then).
    guard_resolved_puts: u64,
    /// Probes a source answered with a death report.
    dead_reported: u64,
    /// Target ops ended by a death report (by the targets' counters), and
    /// quarantined ones among them (each with its quiesced notice).
    dead_freed: u64,
    dead_freed_quarantined: u64,
    /// Death reports that ended more than one op (the incarnation's others).
    dead_reports_ending_several: u64,
    /// Death reports the targets did not believe (the hostile member's).
    dead_ignored: u64,
    /// Quarantined ops probed again on a fresh metadata ack.
    reprobes: u64,
    /// Route changes a source refused (a target over its budget, or no
    /// mappings left), by the live sources' counters.
    routes_refused: u64,
    /// Writes sent as one message; those a target took, and those it
    /// dropped (its operation had ended, or the sender was restarted).
    message_writes: u64,
    messages_taken: u64,
    messages_dropped: u64,
}

struct Sim {
    rng: Rng,
    seed: u64,
    now: u64,
    ns: NamespaceId,
    targets: Vec<Target>,
    sources: Vec<Source>,
    network: BTreeMap<(u64, u64), (ControlEndpoint, Message)>,
    /// Latest delivery time per (from, to): TCP keeps each direction in order.
    link_clock: HashMap<(ControlEndpoint, ControlEndpoint), u64>,
    seq: u64,
    puts: Vec<InFlightPut>,
    /// Writes sent as one message, in flight.
    messages: Vec<InFlightMessage>,
    /// How often a whole write leaves as one message rather than as puts.
    message_percent: u64,
    /// Writes with pieces in flight, by (source, incarnation, write).
    writes: HashMap<(usize, u128, u64), WriteTrack>,
    /// Writes whose pieces all landed, waiting for their source's driver.
    reports: Vec<((usize, u128, u64), bool)>,
    /// Invariant violations seen while moving things (reported by `check`).
    violations: Vec<String>,
    drop_percent: u64,
    put_fail_percent: u64,
    late_percent: u64,
    connect_fail_percent: u64,
    /// Longest delay of a message, and of a piece that is not late.
    max_delay: u64,
    /// How often a message is held up (up to an operation timeout).
    slow_percent: u64,
    max_put_time: u64,
    /// G3 jobs in flight, on every node.
    g3_jobs: Vec<InFlightG3>,
    /// How often a G3 span fails: a write (a full disk), a read (an I/O
    /// error, after which the model holds that G3 slot's bytes for garbage).
    g3_write_fail_percent: u64,
    g3_read_fail_percent: u64,
    /// Longest G3 job, and how often one takes up to two operation timeouts.
    max_g3_time: u64,
    g3_slow_percent: u64,
    /// Per source address, the incarnations its guard confirmed dead
    /// (oldest first): what each restarted process there is told.
    dead: [Vec<u128>; 2],
    seen: Coverage,
}
