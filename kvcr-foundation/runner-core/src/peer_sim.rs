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
//!   timeout it finds itself stalled); crashes and restarts of either source
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
//! `KVCR_SIM_SEED=<n> cargo test -p kvcr-runner-core --lib peer_sim`.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::machine::{
    Action, CopyOutcome, Core, CoreConfig, G3Config, G3Direction, G3Transfer, JobId, PeerConfig,
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

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn endpoint(port: u16) -> ControlEndpoint {
    ControlEndpoint::parse(&format!("tcp://10.0.0.1:{port}")).unwrap()
}

/// A node's memory tiers: its pool's slots, and G3 under them when set (its
/// policy then moves victims to G3, as the runner's default does).
#[derive(Debug, Clone, Copy)]
struct Tiers {
    slots: u32,
    g3: Option<G3Config>,
}

impl Tiers {
    const DRAM_ONLY: Self = Self {
        slots: SLOTS,
        g3: None,
    };

    /// A pool of `slots` over a G3 of `g3_slots`, spilling ahead or not.
    fn with_g3(slots: u32, g3_slots: u32, spill_ahead: bool) -> Self {
        Self {
            slots,
            g3: Some(G3Config {
                slots: g3_slots,
                slot_bytes: BLOCK,
                alignment: BLOCK,
                spill_ahead,
            }),
        }
    }
}

/// The pool slot at `address` of a pool of `slots` at `pool`.
fn slot_at(pool: u64, slots: u32, address: u64) -> Option<u64> {
    let offset = address.checked_sub(pool)?;
    (offset % BLOCK == 0 && offset / BLOCK < u64::from(slots)).then_some(offset / BLOCK)
}

fn new_core(pool_base: u64, port: u16, incarnation: u128) -> (Core, NamespaceId) {
    new_core_with(pool_base, port, incarnation, Tiers::DRAM_ONLY, |_| {})
}

/// A core of `tiers` whose peer configuration `adjust` may change
/// (allowlist, private namespaces, batching, shared memory).
fn new_core_with(
    pool_base: u64,
    port: u16,
    incarnation: u128,
    tiers: Tiers,
    adjust: impl FnOnce(&mut PeerConfig),
) -> (Core, NamespaceId) {
    let config = CoreConfig {
        pools: vec![("kv".into(), BLOCK, tiers.slots)],
        pool_bases: vec![pool_base],
        operation_timeout_ns: TIMEOUT,
        watermark_percent: 0,
        medium: Medium::CpuPinned,
        g3: tiers.g3,
    };
    let policy: Box<dyn CachePolicy> = match tiers.g3 {
        Some(_) => Box::new(G3Lru),
        None => Box::new(Lru),
    };
    let mut core = Core::new(&config, policy).unwrap();
    let ns = core.register_namespace(Namespace::base(CompatDigest(1)));
    let pool_region = RegionId(0);
    let mut config = PeerConfig {
        endpoint: endpoint(port),
        incarnation: Incarnation::from_raw(incarnation).unwrap(),
        worker_address: vec![port as u8; 4],
        rkeys: vec![(pool_region, vec![1, 2, 3])],
        abandon_timeout_ns: 3 * TIMEOUT,
        metadata_retry_ns: TIMEOUT / 10,
        allowed_peers: Vec::new(),
        private_namespaces: Vec::new(),
        shared_memory: None,
        write_batch_bytes: 0,
        // Scaled to virtual time: reconnects and restarts now and then come
        // faster than this, and the refused target re-sends its metadata.
        route_budget: RouteBudget {
            burst: ROUTE_BURST,
            refill_ns: ROUTE_REFILL,
        },
    };
    adjust(&mut config);
    core.enable_peer(config);
    (core, ns)
}

fn scoped(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
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

/// A source's host memory: the key whose bytes are at `address`.
fn host_key(first: u64, address: u64) -> Option<u64> {
    let offset = address.checked_sub(SOURCE_HOST)?;
    (offset % BLOCK == 0 && offset / BLOCK < SOURCE_HOST_ELEMENTS).then(|| first + offset / BLOCK)
}

/// Runs a source's copies and G3 transfers at once, all succeeding, and
/// writes what they carry into `contents` (setup only: the fault-injecting
/// path is `Sim::start_g3`).
fn run_at_once(
    core: &mut Core,
    now: u64,
    pool: u64,
    slots: u32,
    first: u64,
    contents: &mut Contents,
) {
    while let Some(action) = core.poll_action() {
        match action {
            Action::Copy { job, keys, .. } => {
                for span in keys.iter().flatten() {
                    if let Some(slot) = slot_at(pool, slots, span.dst) {
                        let bytes = host_key(first, span.src).unwrap_or(GARBAGE);
                        contents.dram.insert(slot, bytes);
                    }
                }
                core.handle_copy_done(now, job, &vec![CopyOutcome::Copied; keys.len()]);
            }
            Action::G3 { job, transfers, .. } => {
                for t in transfers.iter().flatten() {
                    let Some(slot) = slot_at(pool, slots, t.addr) else {
                        continue;
                    };
                    match t.direction {
                        G3Direction::Store => {
                            let bytes = contents.dram.get(&slot).copied().unwrap_or(GARBAGE);
                            contents.files.insert(t.slot, bytes);
                        }
                        G3Direction::Load => {
                            let bytes = contents.files.get(&t.slot).copied().unwrap_or(GARBAGE);
                            contents.dram.insert(slot, bytes);
                        }
                    }
                }
                core.handle_copy_done(now, job, &vec![CopyOutcome::Copied; transfers.len()]);
            }
            _ => {}
        }
    }
}

/// Deposits source keys `first..first + SOURCE_KEYS` one at a time (copies
/// and spills landing at once), so a pool smaller than that moves its older
/// pages to G3. Returns the host region; `contents` gets what landed where.
fn stock(
    core: &mut Core,
    now: u64,
    ns: NamespaceId,
    first: u64,
    tiers: Tiers,
    pool: u64,
    contents: &mut Contents,
) -> RegionId {
    let region = core
        .register_region(RegionDesc {
            label: "kv".into(),
            base: SOURCE_HOST,
            size: BLOCK,
            stride: 0,
            count: SOURCE_HOST_ELEMENTS,
        })
        .or_else(|_| core.region_by_label("kv").ok_or(()))
        .unwrap_or(RegionId(1));
    for i in 0..SOURCE_KEYS {
        let entry = DepositEntry {
            key: scoped(ns, first + i),
            spans: vec![ElementRef { region, index: i }],
            page: None,
        };
        core.deposit(now, vec![entry], false).unwrap();
        run_at_once(core, now, pool, tiers.slots, first, contents);
    }
    let mut done = Vec::new();
    core.drain_completed(&mut done);
    let held = (first..first + SOURCE_KEYS)
        .filter(|k| {
            let key = scoped(ns, *k);
            core.query(&key) == QueryStatus::Hit || core.g3_ready(&key)
        })
        .count();
    // Without G3 every key has a slot; with it, spills ahead may have taken
    // the G3 room a later move needed (the page then went).
    let least = match tiers.g3 {
        None => SOURCE_KEYS as usize,
        Some(_) => tiers.slots as usize,
    };
    assert!(held >= least, "{held} keys stocked");
    core.drain_events().for_each(drop);
    region
}

/// Source `s`'s incarnation after `restarts` restarts: unique per seed,
/// source and restart, and never a target's or the hostile member's.
fn source_incarnation(seed: u64, s: usize, restarts: u128) -> u128 {
    (u128::from(seed) << 32) | ((s as u128 + 1) << 16) | restarts
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

impl Target {
    fn new(
        t: usize,
        seed: u64,
        shared: bool,
        write_batch_bytes: u64,
        tiers: Tiers,
    ) -> (Self, NamespaceId) {
        let pool = TARGET_POOL + t as u64 * POOL_STEP;
        // With shared segments advertised, its sources ack with one copy now
        // and then (the driver decides).
        let (mut core, ns) = new_core_with(pool, TARGET_PORTS[t], t as u128 + 1, tiers, |c| {
            c.write_batch_bytes = write_batch_bytes;
            c.shared_memory = shared.then(|| SharedMemoryAdvert {
                boot_id: [1; 16],
                pid_namespace: 1,
                pid: 1 + t as u32,
                segments: vec![SegmentAdvert {
                    region: RegionId(0),
                    fd: 3,
                    token: [seed as u8 ^ t as u8; 16],
                }],
            });
        });
        core.handle_tick(0); // the driver's first turn
        let framework = core
            .register_region(RegionDesc {
                label: "kv".into(),
                base: FRAMEWORK,
                size: BLOCK,
                stride: 0,
                count: FRAMEWORK_ELEMENTS,
            })
            .unwrap();
        let target = Self {
            core,
            endpoint: endpoint(TARGET_PORTS[t]),
            pool,
            tiers,
            framework,
            memory: Contents::default(),
            grants: HashMap::new(),
            probed: HashSet::new(),
            deliveries: HashMap::new(),
            deliver_elements: HashMap::new(),
            next_element: 0,
            completed_ops: HashSet::new(),
            timed_out: HashSet::new(),
            committed: HashSet::new(),
        };
        (target, ns)
    }

    fn slot_of(&self, address: u64) -> Option<u64> {
        slot_at(self.pool, self.tiers.slots, address)
    }

    /// The framework element at `address`.
    fn element_of(address: u64) -> Option<u64> {
        let offset = address.checked_sub(FRAMEWORK)?;
        (offset % BLOCK == 0 && offset / BLOCK < FRAMEWORK_ELEMENTS).then_some(offset / BLOCK)
    }
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

impl Source {
    /// Incarnation `restarts` of source `s`, stocked with its keys. `files`:
    /// what its G3 files hold from earlier incarnations (a restart opens the
    /// same files, and its core starts with G3 empty).
    #[allow(clippy::too_many_arguments)]
    fn new(
        s: usize,
        seed: u64,
        restarts: u128,
        lanes: usize,
        now: u64,
        ns: NamespaceId,
        tiers: Tiers,
        files: HashMap<u32, u64>,
    ) -> Self {
        let pool = SOURCE_POOL + s as u64 * POOL_STEP;
        let incarnation = source_incarnation(seed, s, restarts);
        let (mut core, source_ns) =
            new_core_with(pool, SOURCE_PORTS[s], incarnation, tiers, |_| {});
        assert_eq!(source_ns, ns, "one namespace id on every core");
        let mut memory = Contents {
            dram: HashMap::new(),
            files,
        };
        let first = SOURCE_FIRST_KEY[s];
        let host = stock(&mut core, now, ns, first, tiers, pool, &mut memory);
        core.handle_tick(now); // the driver's first turn
        Self {
            core,
            endpoint: endpoint(SOURCE_PORTS[s]),
            pool,
            tiers,
            host,
            incarnation,
            restarts,
            memory,
            filled_from_g3: HashSet::new(),
            lane_free_at: vec![0; lanes.max(1)],
            next_lane: 0,
            routes: HashMap::new(),
            route_builds: HashMap::new(),
            max_reported: 0,
            asleep_until: 0,
        }
    }

    fn slot_of(&self, address: u64) -> Option<u64> {
        slot_at(self.pool, self.tiers.slots, address)
    }
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

impl Coverage {
    fn add(&mut self, o: &Self) {
        self.requests += o.requests;
        self.split_requests += o.split_requests;
        for (mine, theirs) in [
            (&mut self.writes, o.writes),
            (&mut self.committed, o.committed),
            (&mut self.successes, o.successes),
        ] {
            for (a, b) in mine.iter_mut().zip(theirs) {
                *a += b;
            }
        }
        self.multi_lane_writes += o.multi_lane_writes;
        self.concurrent_writes += o.concurrent_writes;
        self.shared_source_writes += o.shared_source_writes;
        self.out_of_order_reports += o.out_of_order_reports;
        self.overlapping_keys += o.overlapping_keys;
        self.delivered += o.delivered;
        self.late_ends += o.late_ends;
        self.failed_pieces += o.failed_pieces;
        self.late_pieces += o.late_pieces;
        self.crashes += o.crashes;
        self.stalls += o.stalls;
        self.quarantined += o.quarantined;
        self.timeouts += o.timeouts;
        self.g3_runs += o.g3_runs;
        self.spills += o.spills;
        self.failed_spills += o.failed_spills;
        self.source_fills += o.source_fills;
        self.target_fills += o.target_fills;
        self.g3_delivers += o.g3_delivers;
        self.failed_fills += o.failed_fills;
        self.served_from_g3 += o.served_from_g3;
        self.crashes_mid_spill += o.crashes_mid_spill;
        self.g3_evictions += o.g3_evictions;
        self.guarded_crashes += o.guarded_crashes;
        self.guard_resolved_puts += o.guard_resolved_puts;
        self.dead_reported += o.dead_reported;
        self.dead_freed += o.dead_freed;
        self.dead_freed_quarantined += o.dead_freed_quarantined;
        self.dead_reports_ending_several += o.dead_reports_ending_several;
        self.dead_ignored += o.dead_ignored;
        self.reprobes += o.reprobes;
        self.routes_refused += o.routes_refused;
        self.message_writes += o.message_writes;
        self.messages_taken += o.messages_taken;
        self.messages_dropped += o.messages_dropped;
    }
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

impl Sim {
    /// A run without G3 (the scripted tests).
    fn new(seed: u64) -> Self {
        Self::build(seed, 0)
    }

    /// A run whose nodes get G3 in `g3_percent` of the seeds: then both
    /// sources hold more keys than their pool has slots (the rest lives in
    /// G3 only, and a `start_write` naming them fills them back first), and
    /// each target has G3 under its pool half the time (its evictions spill,
    /// and it fills and delivers from its own G3).
    fn build(seed: u64, g3_percent: u64) -> Self {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let g3 = rng.chance(g3_percent);
        let mut targets = Vec::new();
        let mut ns = None;
        for t in 0..2 {
            let shared = rng.chance(50);
            // One write per operation, or writes of 1 page, of 2½ pages (2
            // keys) or of 3 pages.
            let batch = [0, BLOCK, 5 * BLOCK / 2, 3 * BLOCK][rng.below(4) as usize];
            let tiers = if g3 && rng.chance(50) {
                Tiers::with_g3(SLOTS, 4 + rng.below(5) as u32, rng.chance(50))
            } else {
                Tiers::DRAM_ONLY
            };
            let (target, target_ns) = Target::new(t, seed, shared, batch, tiers);
            assert!(ns.is_none_or(|n| n == target_ns));
            ns = Some(target_ns);
            targets.push(target);
        }
        let ns = ns.unwrap();
        let sources = (0..2)
            .map(|s| {
                let lanes = 1 + rng.below(4) as usize;
                // A pool of 4 or 5 slots (a write names at most 4 keys) over
                // 5 to 8 G3 slots, for 8 keys: some live only in G3, and G3
                // evicts now and then.
                let tiers = if g3 {
                    Tiers::with_g3(
                        4 + rng.below(2) as u32,
                        5 + rng.below(4) as u32,
                        rng.chance(50),
                    )
                } else {
                    Tiers::DRAM_ONLY
                };
                Source::new(s, seed, 0, lanes, 0, ns, tiers, HashMap::new())
            })
            .collect();
        Self {
            rng,
            seed,
            now: 0,
            ns,
            targets,
            sources,
            network: BTreeMap::new(),
            link_clock: HashMap::new(),
            seq: 0,
            puts: Vec::new(),
            messages: Vec::new(),
            message_percent: 30,
            writes: HashMap::new(),
            reports: Vec::new(),
            violations: Vec::new(),
            drop_percent: 5,
            put_fail_percent: 4,
            late_percent: 6,
            connect_fail_percent: 2,
            max_delay: TIMEOUT / 20,
            slow_percent: 10,
            max_put_time: TIMEOUT / 10,
            g3_jobs: Vec::new(),
            g3_write_fail_percent: 5,
            g3_read_fail_percent: 5,
            max_g3_time: TIMEOUT / 5,
            g3_slow_percent: 5,
            dead: [Vec::new(), Vec::new()],
            seen: Coverage {
                g3_runs: u64::from(g3),
                ..Coverage::default()
            },
        }
    }

    /// No faults, and quick messages and puts (for the scripted tests).
    fn quiet(&mut self) {
        // Scripted tests follow puts in flight; messages get their own.
        self.message_percent = 0;
        self.drop_percent = 0;
        self.put_fail_percent = 0;
        self.late_percent = 0;
        self.connect_fail_percent = 0;
        self.max_delay = TIMEOUT / 20;
        self.slow_percent = 0;
        self.max_put_time = TIMEOUT / 50;
        self.g3_write_fail_percent = 0;
        self.g3_read_fail_percent = 0;
        self.max_g3_time = TIMEOUT / 50;
        self.g3_slow_percent = 0;
    }

    fn key(&self, k: u64) -> ScopedKey {
        scoped(self.ns, k)
    }

    fn peer_of(&self, to: &ControlEndpoint) -> Option<Peer> {
        if let Some(t) = self.targets.iter().position(|t| t.endpoint == *to) {
            return Some(Peer::Target(t));
        }
        self.sources
            .iter()
            .position(|s| s.endpoint == *to)
            .map(Peer::Source)
    }

    fn core(&mut self, peer: Peer) -> &mut Core {
        match peer {
            Peer::Target(t) => &mut self.targets[t].core,
            Peer::Source(s) => &mut self.sources[s].core,
        }
    }

    fn violation(&mut self, what: String) {
        self.violations.push(what);
    }

    /// Source `s` crashes and restarts at the same address with a new
    /// incarnation (and fresh lanes and routes). Its in-flight puts may still
    /// land (we cannot know), so they stay in `puts`, never reported. Its G3
    /// jobs end with the process (the new one locks the files only once the
    /// old one is gone): each write landed, or did not, or did in part; the
    /// new incarnation opens the same files with G3 empty.
    fn restart_source(&mut self, s: usize) {
        if self.end_g3_jobs(s) {
            self.seen.crashes_mid_spill += 1;
        }
        let old = &mut self.sources[s];
        let (restarts, lanes, tiers) = (old.restarts + 1, old.lane_free_at.len(), old.tiers);
        let files = std::mem::take(&mut old.memory.files);
        self.sources[s] = Source::new(
            s, self.seed, restarts, lanes, self.now, self.ns, tiers, files,
        );
        // What the guard knows dead at this address (nothing without a
        // guard-confirmed crash): the new process reports it.
        let dead = self.dead[s]
            .iter()
            .map(|i| Incarnation::from_raw(*i).unwrap())
            .collect();
        self.sources[s].core.set_dead_incarnations(dead);
    }

    /// Source `s` crashes, the guard confirms the death by its pidfd, and it
    /// restarts at the same address: the process is gone, so each put it had
    /// in flight landed (its bytes, or garbage if it failed) or did not,
    /// now, and none lands later; the new incarnation is told the old one
    /// dead.
    fn restart_source_guarded(&mut self, s: usize) {
        let old = self.sources[s].incarnation;
        let (ended, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.puts)
            .into_iter()
            .partition(|p| p.source == s && p.incarnation == old);
        self.puts = kept;
        for put in ended {
            self.seen.guard_resolved_puts += 1;
            if !self.rng.chance(50) {
                continue; // never landed
            }
            let target = &mut self.targets[put.target];
            if target.core.slot_is_free(PoolId(0), put.slot as u32) {
                self.violations.push(format!(
                    "a put landed in target {}'s free slot {} ({put:?})",
                    put.target, put.slot
                ));
            }
            let bytes = if put.ok { put.key } else { GARBAGE };
            target.memory.dram.insert(put.slot, bytes);
        }
        self.writes
            .retain(|(ws, wi, _), _| !(*ws == s && *wi == old));
        self.reports
            .retain(|((ws, wi, _), _)| !(*ws == s && *wi == old));
        self.dead[s].push(old);
        self.seen.guarded_crashes += 1;
        self.restart_source(s);
    }

    /// Source `s`'s process ends: its G3 jobs stop where they are (a write
    /// leaves its G3 slot as it was, written, or half written). Returns
    /// whether one was writing.
    fn end_g3_jobs(&mut self, s: usize) -> bool {
        let (ended, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.g3_jobs)
            .into_iter()
            .partition(|j| j.peer == Peer::Source(s));
        self.g3_jobs = kept;
        let mut writing = false;
        for span in ended.iter().flat_map(|j| j.keys.iter().flatten()) {
            if let Place::File(slot) = span.to {
                writing = true;
                match self.rng.below(3) {
                    0 => {}
                    1 => {
                        self.sources[s].memory.files.insert(slot, span.bytes);
                    }
                    _ => {
                        self.sources[s].memory.files.insert(slot, GARBAGE);
                    }
                }
            }
        }
        writing
    }

    /// Replaces source `s`'s core by one whose configuration `adjust` changes.
    fn reconfigure_source(&mut self, s: usize, adjust: impl FnOnce(&mut PeerConfig)) {
        self.end_g3_jobs(s);
        let source = &mut self.sources[s];
        let (core, _) = new_core_with(
            source.pool,
            SOURCE_PORTS[s],
            source.incarnation,
            source.tiers,
            adjust,
        );
        source.core = core;
        source.memory.dram.clear();
        source.filled_from_g3.clear();
        source.host = stock(
            &mut source.core,
            self.now,
            self.ns,
            SOURCE_FIRST_KEY[s],
            source.tiers,
            source.pool,
            &mut source.memory,
        );
    }

    /// Runs every core's actions.
    fn flush(&mut self) {
        for t in 0..self.targets.len() {
            self.deliver_actions(Peer::Target(t));
        }
        for s in 0..self.sources.len() {
            self.deliver_actions(Peer::Source(s));
        }
    }

    /// Runs `peer`'s actions: sends go on the network, puts on the lanes,
    /// copies and connects are done at once.
    fn deliver_actions(&mut self, peer: Peer) {
        while let Some(action) = self.core(peer).poll_action() {
            match action {
                // Replies to the hostile member go nowhere.
                Action::Send { to, .. } if to == endpoint(HOSTILE) => {}
                Action::Send { to, message } => {
                    if let Peer::Target(t) = peer {
                        self.note_target_send(t, &message.body);
                    }
                    if let Body::WriteProbeAck {
                        dead_incarnation: Some(_),
                        ..
                    } = message.body
                    {
                        self.seen.dead_reported += 1;
                    }
                    self.send(to, message);
                }
                Action::Put {
                    write,
                    target,
                    generation,
                    spans,
                } => match peer {
                    Peer::Source(s) => self.start_put(s, write, &target, generation, &spans),
                    Peer::Target(t) => self.violation(format!("target {t} issued a put")),
                },
                Action::G3 { job, transfers, .. } => self.start_g3(peer, job, &transfers),
                Action::Copy { job, keys, .. } => {
                    match peer {
                        Peer::Target(t) => self.check_copy(t, &keys),
                        Peer::Source(s) => self.deposit_copy(s, &keys),
                    }
                    let now = self.now;
                    self.core(peer).handle_copy_done(
                        now,
                        job,
                        &vec![CopyOutcome::Copied; keys.len()],
                    );
                }
                Action::Connect {
                    peer: target,
                    generation,
                    shared_memory,
                    ..
                } => {
                    let Peer::Source(s) = peer else {
                        self.violation(format!("{peer:?} connected to {target:?}"));
                        continue;
                    };
                    self.check_route_rate(s, &target);
                    // The driver's connect: now and then UCX refuses it; a
                    // target with shared segments is mapped or not.
                    if self.rng.chance(self.connect_fail_percent) {
                        self.sources[s].routes.remove(&target);
                        let why = if self.rng.chance(50) {
                            ConnectFailure::Unusable
                        } else {
                            ConnectFailure::NoMappingsLeft
                        };
                        self.sources[s]
                            .core
                            .handle_connect_failed(&target, generation, why);
                    } else {
                        let one_copy = shared_memory.is_some() && self.rng.chance(50);
                        self.sources[s].routes.insert(target.clone(), generation);
                        self.sources[s]
                            .core
                            .handle_connected(&target, generation, one_copy);
                    }
                }
                // A copy is done at once (nothing left to cancel); a G3
                // job's key may be skipped when it is reported.
                Action::Cancel { job, key } => {
                    let cancelled = self
                        .g3_jobs
                        .iter_mut()
                        .find(|j| j.peer == peer && j.job == job)
                        .and_then(|j| j.cancelled.get_mut(key as usize));
                    if let Some(cancelled) = cancelled {
                        *cancelled = true;
                    }
                }
            }
        }
    }

    fn memory(&mut self, peer: Peer) -> &mut Contents {
        match peer {
            Peer::Target(t) => &mut self.targets[t].memory,
            Peer::Source(s) => &mut self.sources[s].memory,
        }
    }

    /// The pool slot of `peer` at `address`.
    fn pool_slot(&self, peer: Peer, address: u64) -> Option<u64> {
        match peer {
            Peer::Target(t) => self.targets[t].slot_of(address),
            Peer::Source(s) => self.sources[s].slot_of(address),
        }
    }

    fn slot_free(&self, peer: Peer, slot: u64) -> bool {
        let core = match peer {
            Peer::Target(t) => &self.targets[t].core,
            Peer::Source(s) => &self.sources[s].core,
        };
        core.slot_is_free(PoolId(0), slot as u32)
    }

    /// What the model holds at `place` of `peer`.
    fn bytes_at(&self, peer: Peer, place: Place) -> u64 {
        let memory = match peer {
            Peer::Target(t) => &self.targets[t].memory,
            Peer::Source(s) => &self.sources[s].memory,
        };
        let bytes = match place {
            Place::Dram(slot) => memory.dram.get(&slot),
            Place::File(slot) => memory.files.get(&slot),
            Place::Element(_) => None,
        };
        bytes.copied().unwrap_or(GARBAGE)
    }

    /// What in flight on `peer` writes `place` (or, unless `writes_only`,
    /// reads it): a G3 span of `extra` (the job being planned) or of a job in
    /// flight, a put into a target's slot, or a put out of a source's slot.
    fn in_flight_at(
        &self,
        peer: Peer,
        place: Place,
        writes_only: bool,
        extra: &[G3Span],
    ) -> Option<String> {
        let touches = |span: &G3Span| span.to == place || (!writes_only && span.from == place);
        if let Some(span) = extra.iter().find(|span| touches(span)) {
            return Some(format!("the same job's {span:?}"));
        }
        let g3 = self
            .g3_jobs
            .iter()
            .filter(|j| j.peer == peer)
            .find_map(|j| {
                j.keys
                    .iter()
                    .flatten()
                    .find(|span| touches(span))
                    .map(|span| (j.job, *span))
            });
        if let Some((job, span)) = g3 {
            return Some(format!("G3 job {job:?}'s {span:?}"));
        }
        let Place::Dram(slot) = place else {
            return None;
        };
        let put = match peer {
            Peer::Target(t) => self.puts.iter().find(|p| p.target == t && p.slot == slot),
            Peer::Source(s) if !writes_only => {
                let incarnation = self.sources[s].incarnation;
                self.puts
                    .iter()
                    .find(|p| p.source == s && p.incarnation == incarnation && p.from == slot)
            }
            Peer::Source(_) => None,
        };
        put.map(|p| format!("{p:?}"))
    }

    /// The driver runs `peer`'s G3 job: each span reads what its source
    /// place holds now (nothing may write that place, nor touch the one it
    /// writes, until the job is reported) and may fail; the job is reported
    /// after a seeded delay, in any order with everything else.
    fn start_g3(&mut self, peer: Peer, job: JobId, transfers: &[Vec<G3Transfer>]) {
        let mut keys = Vec::with_capacity(transfers.len());
        for key in transfers {
            let mut spans: Vec<G3Span> = Vec::with_capacity(key.len());
            for t in key {
                let dram = self.pool_slot(peer, t.addr).map(Place::Dram);
                let (from, to) = match (t.direction, dram, peer) {
                    (G3Direction::Store, Some(d), _) => (d, Place::File(t.slot)),
                    (G3Direction::Load, Some(d), _) => (Place::File(t.slot), d),
                    // A target's deliver reads G3 straight into its
                    // destination.
                    (G3Direction::Load, None, Peer::Target(_)) => {
                        match Target::element_of(t.addr) {
                            Some(e) => (Place::File(t.slot), Place::Element(e)),
                            None => {
                                return self.violation(format!(
                                    "{peer:?}'s G3 job {job:?} reads into {t:?}, no memory of its"
                                ));
                            }
                        }
                    }
                    _ => {
                        return self.violation(format!(
                            "{peer:?}'s G3 job {job:?} writes {t:?} from outside its pool"
                        ));
                    }
                };
                if t.len != BLOCK {
                    self.violation(format!("{peer:?}'s G3 job {job:?}: {t:?} is not one page"));
                }
                for place in [from, to] {
                    if let Place::Dram(slot) = place
                        && self.slot_free(peer, slot)
                    {
                        self.violation(format!(
                            "{peer:?}'s G3 job {job:?} touches its free slot {slot} ({t:?})"
                        ));
                    }
                }
                if let Some(other) = self.in_flight_at(peer, from, true, &spans) {
                    self.violation(format!(
                        "{peer:?}'s G3 job {job:?} reads {from:?} while {other} writes it"
                    ));
                }
                if let Some(other) = self.in_flight_at(peer, to, false, &spans) {
                    self.violation(format!(
                        "{peer:?}'s G3 job {job:?} writes {to:?} while {other} touches it"
                    ));
                }
                let store = t.direction == G3Direction::Store;
                let fail = if store {
                    self.g3_write_fail_percent
                } else {
                    self.g3_read_fail_percent
                };
                spans.push(G3Span {
                    from,
                    to,
                    bytes: self.bytes_at(peer, from),
                    ok: !self.rng.chance(fail),
                    store,
                });
            }
            keys.push(spans);
        }
        let took = if self.rng.chance(self.g3_slow_percent) {
            self.rng.below(2 * TIMEOUT)
        } else {
            self.rng.below(self.max_g3_time)
        };
        let incarnation = match peer {
            Peer::Source(s) => self.sources[s].incarnation,
            Peer::Target(_) => 0,
        };
        self.seq += 1;
        self.g3_jobs.push(InFlightG3 {
            peer,
            incarnation,
            job,
            cancelled: vec![false; keys.len()],
            keys,
            done_at: self.now + took,
            seq: self.seq,
        });
    }

    /// Reports the G3 jobs due by now (in time order; a stopped source's
    /// once it runs again): each span writes what it carries (garbage when
    /// it failed; a failed read leaves its G3 slot untrusted, garbage too),
    /// a key copied only when all its spans were.
    fn complete_due_g3(&mut self) {
        let now = self.now;
        let (mut due, pending): (Vec<_>, Vec<_>) = std::mem::take(&mut self.g3_jobs)
            .into_iter()
            .partition(|j| j.done_at <= now && self.g3_report_at(j) <= now);
        self.g3_jobs = pending;
        due.sort_by_key(|j| (j.done_at, j.seq));
        for job in due {
            if let Peer::Source(s) = job.peer
                && self.sources[s].incarnation != job.incarnation
            {
                // Its process is gone: a new one must never hear of it.
                self.violation(format!("{job:?} outlived its source's process"));
                continue;
            }
            let mut outcomes = Vec::with_capacity(job.keys.len());
            for (spans, cancelled) in job.keys.iter().zip(&job.cancelled) {
                // The runner's driver runs a cancelled key anyway; a driver
                // may also skip one that has not started.
                if *cancelled && self.rng.chance(50) {
                    outcomes.push(CopyOutcome::Cancelled);
                    continue;
                }
                for span in spans {
                    self.land_g3(job.peer, span);
                }
                let copied = spans.iter().all(|span| span.ok);
                outcomes.push(if copied {
                    CopyOutcome::Copied
                } else {
                    CopyOutcome::Failed
                });
            }
            self.core(job.peer)
                .handle_copy_done(now, job.job, &outcomes);
            self.deliver_actions(job.peer);
        }
    }

    /// When job `j` can be reported: once done, and once its process runs.
    fn g3_report_at(&self, j: &InFlightG3) -> u64 {
        match j.peer {
            Peer::Source(s) => j.done_at.max(self.sources[s].asleep_until),
            Peer::Target(_) => j.done_at,
        }
    }

    /// One G3 span of `peer` ends: its destination holds what it carried,
    /// or garbage.
    fn land_g3(&mut self, peer: Peer, span: &G3Span) {
        let bytes = if span.ok { span.bytes } else { GARBAGE };
        match (span.store, span.ok) {
            (true, true) => self.seen.spills += 1,
            (true, false) => self.seen.failed_spills += 1,
            (false, false) => self.seen.failed_fills += 1,
            (false, true) => match (peer, span.to) {
                (Peer::Source(_), _) => self.seen.source_fills += 1,
                (Peer::Target(_), Place::Element(_)) => self.seen.g3_delivers += 1,
                (Peer::Target(_), _) => self.seen.target_fills += 1,
            },
        }
        if let (false, false, Place::File(slot)) = (span.store, span.ok, span.from) {
            self.memory(peer).files.insert(slot, GARBAGE);
        }
        match span.to {
            Place::Dram(slot) => {
                self.memory(peer).dram.insert(slot, bytes);
                if let Peer::Source(s) = peer {
                    let filled = &mut self.sources[s].filled_from_g3;
                    if span.ok {
                        filled.insert(slot);
                    } else {
                        filled.remove(&slot);
                    }
                }
            }
            Place::File(slot) => {
                self.memory(peer).files.insert(slot, bytes);
            }
            Place::Element(e) => {
                let Peer::Target(t) = peer else {
                    return self.violation(format!("{peer:?} read G3 into element {e}"));
                };
                match self.targets[t].deliveries.get_mut(&e) {
                    None => self.violation(format!(
                        "target {t} read G3 into element {e}, asked by nobody"
                    )),
                    Some((want, copied)) if span.ok => {
                        let want = *want;
                        if bytes == want {
                            *copied = true;
                        } else {
                            self.violation(format!(
                                "target {t} delivers key {want} to element {e} from G3, which held {bytes}"
                            ));
                        }
                    }
                    Some(_) => {}
                }
            }
        }
    }

    /// A deposit's copy into source `s`'s pool: the slot is allocated and
    /// nothing in flight touches it; it then holds the deposited key.
    fn deposit_copy(&mut self, s: usize, keys: &[Vec<CopySpan>]) {
        let first = SOURCE_FIRST_KEY[s];
        for span in keys.iter().flatten() {
            let Some(slot) = self.sources[s].slot_of(span.dst) else {
                return self.violation(format!("source {s} copies {span:?} outside its pool"));
            };
            if self.slot_free(Peer::Source(s), slot) {
                self.violation(format!("source {s} deposits into its free slot {slot}"));
            }
            if let Some(other) = self.in_flight_at(Peer::Source(s), Place::Dram(slot), false, &[]) {
                self.violation(format!(
                    "source {s} deposits into slot {slot} while {other} touches it"
                ));
            }
            let bytes = host_key(first, span.src).unwrap_or(GARBAGE);
            let source = &mut self.sources[s];
            source.memory.dram.insert(slot, bytes);
            source.filled_from_g3.remove(&slot);
        }
    }

    /// What a target sent that the model needs: the slots each write grants,
    /// and which ops it probed (past their deadline).
    fn note_target_send(&mut self, t: usize, body: &Body) {
        let target = &mut self.targets[t];
        match body {
            Body::StartWrite {
                op_handle,
                keys,
                destinations,
                ..
            } => {
                let granted = keys
                    .iter()
                    .zip(destinations)
                    .filter_map(|(k, d)| Some((k.as_u64(), d.first()?.index)))
                    .collect();
                target.grants.entry(*op_handle).or_insert(granted);
            }
            Body::WriteProbe { op_handle, .. } => {
                target.probed.insert(*op_handle);
            }
            _ => {}
        }
    }

    /// Puts a message on the network: maybe dropped, maybe duplicated, each
    /// copy with its own delay, each direction in order.
    fn send(&mut self, to: ControlEndpoint, message: Message) {
        let copies = if self.rng.chance(self.drop_percent) {
            0
        } else if self.rng.chance(5) {
            2
        } else {
            1
        };
        let link = (message.header.sender_endpoint.clone(), to.clone());
        for _ in 0..copies {
            let last = self.link_clock.get(&link).copied().unwrap_or(0);
            let delay = if self.rng.chance(self.slow_percent) {
                self.rng.below(TIMEOUT)
            } else {
                self.rng.below(self.max_delay)
            };
            let at = (self.now + delay).max(last);
            self.link_clock.insert(link.clone(), at);
            self.seq += 1;
            self.network
                .insert((at, self.seq), (to.clone(), message.clone()));
        }
    }

    /// The driver runs a put on source `s`'s lanes: cut into pieces, one
    /// lane each, a lane's pieces one after the other.
    fn start_put(
        &mut self,
        s: usize,
        write: u64,
        target: &ControlEndpoint,
        generation: u64,
        spans: &[PutSpan],
    ) {
        if self.sources[s].routes.get(target) != Some(&generation) {
            // The route is gone or was replaced: never written through (as
            // the driver does; rare here, where connects are immediate).
            let now = self.now;
            self.sources[s].core.handle_put_done(now, write, false);
            return;
        }
        let Some(Peer::Target(t)) = self.peer_of(target) else {
            self.violation(format!("source {s} writes to {target:?}"));
            return;
        };
        // Each span: (target slot, source slot, the key whose bytes that
        // source slot holds now).
        let mut resolved = Vec::new();
        for span in spans {
            let slot = self.targets[t].slot_of(span.remote);
            let from = self.sources[s].slot_of(span.local);
            match (slot, from) {
                (Some(slot), Some(from)) if span.len == BLOCK => {
                    let key = self.bytes_at(Peer::Source(s), Place::Dram(from));
                    resolved.push((slot, from, key));
                }
                _ => {
                    return self.violation(format!(
                        "source {s}'s put {span:?} is not a page of its pool into target {t}'s"
                    ));
                }
            }
        }
        if resolved.is_empty() {
            return self.violation(format!("source {s} issued an empty put"));
        }
        for &(slot, from, _) in &resolved {
            if self.targets[t].core.slot_is_free(PoolId(0), slot as u32) {
                self.violation(format!("source {s} writes target {t}'s free slot {slot}"));
            }
            if let Some(other) = self.puts.iter().find(|p| p.target == t && p.slot == slot) {
                self.violation(format!(
                    "two writes in flight into target {t}'s slot {slot}: {other:?} and write {write} of source {s}"
                ));
            }
            if let Some(other) = self.in_flight_at(Peer::Target(t), Place::Dram(slot), false, &[]) {
                self.violation(format!(
                    "source {s} writes target {t}'s slot {slot} while {other} touches it"
                ));
            }
            if self.slot_free(Peer::Source(s), from) {
                self.violation(format!("source {s} puts from its free slot {from}"));
            }
            if let Some(other) = self.in_flight_at(Peer::Source(s), Place::Dram(from), true, &[]) {
                self.violation(format!(
                    "source {s} puts from slot {from} while {other} writes it"
                ));
            }
            if self.sources[s].filled_from_g3.contains(&from) {
                self.seen.served_from_g3 += 1;
            }
        }
        let incarnation = self.sources[s].incarnation;
        if let Some((op, keys)) = self.sources[s].core.peer_write_completion(write)
            && self.rng.chance(self.message_percent)
        {
            // The driver reads the source slots into the message now and
            // reports the write once it has left (here: at once).
            self.seen.message_writes += 1;
            self.seen.writes[s] += 1;
            self.messages.push(InFlightMessage {
                source: s,
                incarnation,
                target: t,
                op,
                keys,
                pieces: resolved.iter().map(|&(slot, _, key)| (slot, key)).collect(),
                arrives_at: self.now + self.rng.below(self.max_put_time),
                lost: self.rng.chance(self.put_fail_percent),
            });
            let now = self.now;
            self.sources[s].core.handle_message_sent(now, write, true);
            return;
        }
        let mine: Vec<usize> = self
            .writes
            .iter()
            .filter(|((ws, wi, _), _)| *ws == s && *wi == incarnation)
            .map(|(_, w)| w.target)
            .collect();
        self.seen.writes[s] += 1;
        if !mine.is_empty() {
            self.seen.concurrent_writes += 1;
        }
        if mine.iter().any(|o| *o != t) {
            self.seen.shared_source_writes += 1;
        }
        let lanes = self.sources[s].lane_free_at.len();
        let parts = 1 + self.rng.below(resolved.len().min(lanes) as u64) as usize;
        if parts > 1 {
            self.seen.multi_lane_writes += 1;
        }
        for piece in resolved.chunks(resolved.len().div_ceil(parts)) {
            let source = &mut self.sources[s];
            let lane = source.next_lane % lanes;
            source.next_lane += 1;
            let start = self.now.max(source.lane_free_at[lane]);
            let late = self.rng.chance(self.late_percent);
            let took = if late {
                self.seen.late_pieces += 1;
                self.rng.below(6 * TIMEOUT)
            } else {
                self.rng.below(self.max_put_time)
            };
            let done_at = start + took;
            // A late piece is a late report: its lane moves on meanwhile.
            self.sources[s].lane_free_at[lane] = if late { start } else { done_at };
            let ok = !self.rng.chance(self.put_fail_percent);
            if !ok {
                self.seen.failed_pieces += 1;
            }
            for &(slot, from, key) in piece {
                self.seq += 1;
                self.puts.push(InFlightPut {
                    source: s,
                    incarnation,
                    write,
                    target: t,
                    slot,
                    from,
                    key,
                    done_at,
                    ok,
                    seq: self.seq,
                });
            }
        }
        self.writes.insert(
            (s, incarnation, write),
            WriteTrack {
                target: t,
                left: resolved.len(),
                ok: true,
            },
        );
    }

    /// A deliver's copy out of target `t`'s slots: each must hold the key
    /// that the destination element was asked for.
    fn check_copy(&mut self, t: usize, keys: &[Vec<CopySpan>]) {
        for span in keys.iter().flatten() {
            let target = &mut self.targets[t];
            let slot = target.slot_of(span.src);
            let element = span
                .dst
                .checked_sub(FRAMEWORK)
                .filter(|o| o % BLOCK == 0)
                .map(|o| o / BLOCK);
            let wanted = element.and_then(|e| target.deliveries.get_mut(&e));
            let (Some(slot), Some((key, copied))) = (slot, wanted) else {
                return self.violation(format!("target {t} copies {span:?}, asked by nobody"));
            };
            let (key, landed) = (*key, target.memory.dram.get(&slot).copied());
            *copied = true;
            if landed != Some(key) {
                self.violation(format!(
                    "target {t} delivers key {key} from slot {slot}, which holds {landed:?}"
                ));
            }
            if let Some(other) = self.in_flight_at(Peer::Target(t), Place::Dram(slot), true, &[]) {
                self.violation(format!(
                    "target {t} delivers from slot {slot} while {other} may still write it"
                ));
            }
        }
    }

    /// Hands a message to the core it is addressed to, and runs that core's
    /// actions. A target's commits are checked as they happen.
    fn handle(&mut self, to: &ControlEndpoint, now: u64, message: Message) {
        match self.peer_of(to) {
            Some(Peer::Target(t)) => {
                let ended = match &message.body {
                    Body::WriteDone { op_handle, outcome } => {
                        Some((*op_handle, matches!(outcome, WriteOutcome::Completed(_))))
                    }
                    Body::WriteRefused { op_handle } => Some((*op_handle, false)),
                    Body::WriteProbeAck { op_handle, .. } => Some((*op_handle, false)),
                    _ => None,
                };
                let from_peer = self.peer_of(&message.header.sender_endpoint).is_some();
                let death_report = matches!(
                    message.body,
                    Body::WriteProbeAck {
                        dead_incarnation: Some(_),
                        ..
                    }
                );
                let target = &mut self.targets[t];
                target.core.drain_events().for_each(drop);
                target.core.take_notices();
                let freed = target.core.peer_counters().dead_freed;
                target.core.handle_message(now, message);
                if death_report {
                    let quiesced = target
                        .core
                        .take_notices()
                        .iter()
                        .filter(|n| matches!(n, crate::PeerNotice::Quiesced { .. }))
                        .count();
                    self.seen.dead_freed_quarantined += quiesced as u64;
                    if target.core.peer_counters().dead_freed > freed + 1 {
                        self.seen.dead_reports_ending_several += 1;
                    }
                }
                let stored: Vec<u64> = target
                    .core
                    .drain_events()
                    .flat_map(|e| match e {
                        // Pages committed in the pool (G3's are stored when
                        // a spill is reported, not here).
                        InventoryEvent::Stored { keys, scope, .. }
                            if scope.medium != Medium::Disk =>
                        {
                            keys
                        }
                        _ => Vec::new(),
                    })
                    .map(BlockKey::as_u64)
                    .collect();
                if let Some((op, true)) = ended
                    && target.probed.contains(&op)
                    && target.grants.contains_key(&op)
                    && from_peer
                {
                    self.seen.late_ends += 1;
                }
                if !stored.is_empty() {
                    self.check_commits(t, ended.map(|(op, _)| op), &stored);
                }
                self.deliver_actions(Peer::Target(t));
            }
            Some(Peer::Source(s)) => {
                self.sources[s].core.handle_message(now, message);
                self.deliver_actions(Peer::Source(s));
            }
            None => {}
        }
    }

    /// Target `t` committed `stored` on the end of write `op`: the op was
    /// not probed, granted those keys, and their slots hold their bytes.
    fn check_commits(&mut self, t: usize, op: Option<OpHandle>, stored: &[u64]) {
        let target = &self.targets[t];
        let Some(op) = op else {
            return self.violation(format!("target {t} committed {stored:?} outside a write"));
        };
        if target.probed.contains(&op) {
            return self.violation(format!(
                "target {t} committed {stored:?} from op {op:?}, which it probed (past its deadline)"
            ));
        }
        let Some(grants) = target.grants.get(&op) else {
            return self.violation(format!(
                "target {t} committed {stored:?} from op {op:?}, which it never sent"
            ));
        };
        let mut problems = Vec::new();
        for key in stored {
            let Some(&(_, slot)) = grants.iter().find(|(k, _)| k == key) else {
                problems.push(format!("op {op:?} never asked for key {key}"));
                continue;
            };
            let landed = target.memory.dram.get(&slot).copied();
            if landed != Some(*key) {
                problems.push(format!(
                    "key {key} committed in slot {slot}, where the last put was {landed:?}"
                ));
            }
            if let Some(other) = self.in_flight_at(Peer::Target(t), Place::Dram(slot), true, &[]) {
                problems.push(format!(
                    "key {key} committed in slot {slot} while {other} may still write it"
                ));
            }
        }
        self.seen.committed[t] += stored.len() as u64;
        self.targets[t].committed.extend(stored);
        for problem in problems {
            self.violation(format!("target {t}: {problem}"));
        }
    }

    /// Lands the pieces due by now (in time order), then reports each write
    /// whose pieces have all landed to the source incarnation that issued it
    /// (a crashed incarnation's puts may still land, but nobody reports
    /// them).
    /// Write messages that arrived: each is copied into its operation's
    /// landing spans and handled as the write's `write_done`, under one
    /// step (as the driver does under the core lock), or dropped when the
    /// target no longer waits on it or its sender was restarted (the
    /// session key it was sealed with is gone).
    fn complete_due_messages(&mut self) {
        let now = self.now;
        let (due, pending): (Vec<_>, Vec<_>) = std::mem::take(&mut self.messages)
            .into_iter()
            .partition(|m| m.arrives_at <= now);
        self.messages = pending;
        for m in due {
            if m.lost || m.incarnation != self.sources[m.source].incarnation {
                continue;
            }
            let target = &mut self.targets[m.target];
            let Some(spans) = target.core.peer_landing_spans(m.op, m.keys) else {
                self.seen.messages_dropped += 1;
                continue;
            };
            let slots: Vec<Option<u64>> = spans
                .iter()
                .map(|&(addr, len)| {
                    if len == BLOCK {
                        target.slot_of(addr)
                    } else {
                        None
                    }
                })
                .collect();
            let addressed: Vec<Option<u64>> =
                m.pieces.iter().map(|&(slot, _)| Some(slot)).collect();
            if slots != addressed {
                self.violations.push(format!(
                    "target {}'s landing spans {slots:?} are not the slots the source addressed: {m:?}",
                    m.target
                ));
                continue;
            }
            for &(slot, key) in &m.pieces {
                target.memory.dram.insert(slot, key);
            }
            self.seen.messages_taken += 1;
            let done = Message {
                header: Header {
                    sender: Incarnation::from_raw(m.incarnation).unwrap(),
                    route_generation: RouteGeneration(0),
                    sender_endpoint: self.sources[m.source].endpoint.clone(),
                },
                body: Body::WriteDone {
                    op_handle: m.op,
                    outcome: WriteOutcome::Completed(CompletedIndices::new((0..m.keys).collect())),
                },
            };
            let to = self.targets[m.target].endpoint.clone();
            self.handle(&to, now, done);
        }
    }

    fn complete_due_puts(&mut self) {
        let now = self.now;
        let (mut due, pending): (Vec<_>, Vec<_>) = self.puts.iter().partition(|p| p.done_at <= now);
        self.puts = pending;
        due.sort_by_key(|p| (p.done_at, p.seq));
        for put in due {
            let target = &mut self.targets[put.target];
            if target.core.slot_is_free(PoolId(0), put.slot as u32) {
                self.violations.push(format!(
                    "a put landed in target {}'s free slot {} ({put:?})",
                    put.target, put.slot
                ));
            }
            let bytes = if put.ok { put.key } else { GARBAGE };
            target.memory.dram.insert(put.slot, bytes);
            let id = (put.source, put.incarnation, put.write);
            if let Some(w) = self.writes.get_mut(&id) {
                w.left -= 1;
                w.ok &= put.ok;
                if w.left == 0 {
                    self.reports.push((id, w.ok));
                    self.writes.remove(&id);
                }
            }
        }
        let (asleep, reports): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reports)
            .into_iter()
            .partition(|((s, ..), _)| self.sources[*s].asleep_until > now);
        self.reports = asleep;
        for ((s, incarnation, write), ok) in reports {
            let source = &mut self.sources[s];
            if incarnation != source.incarnation {
                continue;
            }
            if write < source.max_reported {
                self.seen.out_of_order_reports += 1;
            }
            source.max_reported = source.max_reported.max(write);
            source.core.handle_put_done(now, write, ok);
        }
    }

    /// When `peer`'s driver next runs a turn: at its earliest deadline or
    /// stall guard, and not before its process wakes.
    fn wake_at(&self, peer: Peer) -> Option<u64> {
        let (core, asleep_until) = match peer {
            Peer::Target(t) => (&self.targets[t].core, 0),
            Peer::Source(s) => (&self.sources[s].core, self.sources[s].asleep_until),
        };
        let wake = match (core.peer_wake_at(), core.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        wake.map(|w| w.max(asleep_until))
    }

    fn peers(&self) -> impl Iterator<Item = Peer> + use<> {
        let (targets, sources) = (self.targets.len(), self.sources.len());
        (0..targets)
            .map(Peer::Target)
            .chain((0..sources).map(Peer::Source))
    }

    /// Moves time on to `end`, everything in time order: pieces land when
    /// due, messages arrive when due, and each driver runs its turns when it
    /// asks to (as the real one sleeps until `peer_wake_at`); a stopped
    /// process handles nothing until it wakes.
    fn advance_to(&mut self, end: u64) {
        for _ in 0..10_000 {
            let wakes: Vec<(Peer, Option<u64>)> =
                self.peers().map(|p| (p, self.wake_at(p))).collect();
            let lands = self.puts.iter().map(|p| p.done_at);
            let reports = self
                .reports
                .iter()
                .map(|((s, ..), _)| self.sources[*s].asleep_until);
            let messages = self.network.keys().next().map(|k| k.0);
            let write_messages = self.messages.iter().map(|m| m.arrives_at);
            let g3 = self.g3_jobs.iter().map(|j| self.g3_report_at(j));
            let next = wakes
                .iter()
                .filter_map(|(_, w)| *w)
                .chain(lands)
                .chain(reports)
                .chain(messages)
                .chain(write_messages)
                .chain(g3)
                .min()
                .filter(|w| *w <= end);
            let Some(at) = next else { break };
            self.now = self.now.max(at);
            let now = self.now;
            self.complete_due_puts();
            self.complete_due_messages();
            self.complete_due_g3();
            while let Some(&(at, seq)) = self.network.keys().next().filter(|k| k.0 <= now) {
                let Some((to, message)) = self.network.remove(&(at, seq)) else {
                    break;
                };
                if let Some(until) = self.asleep_until(&to) {
                    // Waits in the socket until its process runs again.
                    self.seq += 1;
                    self.network.insert((until, self.seq), (to, message));
                } else {
                    self.handle(&to, now, message);
                }
            }
            for (peer, wake) in wakes {
                if wake.is_some_and(|w| w <= now) {
                    let core = self.core(peer);
                    core.handle_tick(now);
                    core.handle_timeout(now);
                    if self.wake_at(peer).is_some_and(|w| w <= now) {
                        self.violation(format!("{peer:?} asks to wake at {now} again"));
                        return;
                    }
                }
            }
            self.flush();
        }
        self.now = self.now.max(end);
    }

    /// Moves time on by a random amount below `most`.
    fn advance(&mut self, most: u64) {
        let end = self.now + self.rng.below(most);
        self.advance_to(end);
    }

    /// Whether the process at `to` is stopped at the moment.
    fn asleep_until(&self, to: &ControlEndpoint) -> Option<u64> {
        match self.peer_of(to) {
            Some(Peer::Source(s)) => Some(self.sources[s].asleep_until).filter(|u| *u > self.now),
            _ => None,
        }
    }

    /// A fetch or a deliver of some keys on a random target, under a fresh
    /// request whose hint names a random source.
    fn request(&mut self) -> Result<(), String> {
        let t = self.rng.below(2) as usize;
        let s = self.rng.below(2) as usize;
        let n = 1 + self.rng.below(4);
        let first = self.rng.below(KEYS - n + 1);
        let keys: Vec<ScopedKey> = (first..first + n).map(|k| self.key(k)).collect();
        let request = RequestId(format!("r{}", self.seq));
        self.seq += 1;
        let hint = FetchHint {
            source: self.sources[s].endpoint.clone(),
            block_hashes: keys.iter().map(|k| k.key).collect(),
            mode: FetchMode::Copy,
            action_id: None,
        };
        let deliver = self.rng.chance(30);
        let now = self.now;
        let target = &mut self.targets[t];
        let before = target.core.peer_counters().writes_requested;
        target.core.submit_hint(now, request.clone(), &hint);
        if deliver {
            let mut elements = Vec::new();
            let entries = keys
                .iter()
                .map(|key| {
                    let element = target.next_element % FRAMEWORK_ELEMENTS;
                    target.next_element += 1;
                    target.deliveries.insert(element, (key.key.as_u64(), false));
                    elements.push((key.key.as_u64(), element));
                    DeliverEntry {
                        key: *key,
                        destinations: vec![ElementRef {
                            region: target.framework,
                            index: element,
                        }],
                    }
                })
                .collect();
            let op = target
                .core
                .deliver(now, entries, Some(&request))
                .map_err(|e| e.to_string())?;
            for (key, element) in elements {
                target.deliver_elements.insert((op, key), element);
            }
        } else {
            target
                .core
                .fetch(now, &keys, &[PoolId(0)], Some(&request))
                .map_err(|e| e.to_string())?;
        }
        let requested = target.core.peer_counters().writes_requested - before;
        self.seen.requests += 1;
        if requested > 1 {
            self.seen.split_requests += 1;
        }
        Ok(())
    }

    /// The engine beside a source with G3 deposits some of the source's
    /// keys again: those it no longer holds in its pool come back, and
    /// making room for them moves others to G3.
    fn source_deposit(&mut self) -> Result<(), String> {
        let s = self.rng.below(2) as usize;
        let n = 1 + self.rng.below(3);
        let first = self.rng.below(SOURCE_KEYS - n + 1);
        let (now, ns) = (self.now, self.ns);
        let source = &mut self.sources[s];
        if source.tiers.g3.is_none() || source.asleep_until > now {
            return Ok(());
        }
        let entries = (first..first + n)
            .map(|i| DepositEntry {
                key: scoped(ns, SOURCE_FIRST_KEY[s] + i),
                spans: vec![ElementRef {
                    region: source.host,
                    index: i,
                }],
                page: None,
            })
            .collect();
        source
            .core
            .deposit(now, entries, false)
            .map_err(|e| format!("source {s}: {e}"))?;
        Ok(())
    }

    fn step(&mut self) -> Result<(), String> {
        match self.rng.below(11) {
            0 | 1 => self.request()?,
            10 => self.source_deposit()?,
            2..=5 => {
                // On to the next message.
                if let Some(&(at, _)) = self.network.keys().next() {
                    self.advance_to(at);
                }
            }
            6 | 7 => self.advance(TIMEOUT / 3),
            8 => self.advance(TIMEOUT),
            _ if self.rng.chance(40) => self.hostile(),
            _ if self.rng.chance(15) => {
                // A source's process stops a while: past an operation timeout
                // it finds itself stalled when it wakes, and refuses writes
                // until it restarts.
                let s = self.rng.below(2) as usize;
                let stop = self.rng.below(2 * TIMEOUT);
                self.sources[s].asleep_until = self.now + stop;
                if stop >= TIMEOUT {
                    self.seen.stalls += 1;
                }
            }
            _ => {
                if self.rng.chance(25) {
                    // A source crashes and restarts at the same address; its
                    // targets may or may not see the connection drop. Half
                    // the time it is one writing into G3, if any is.
                    let spilling: Vec<usize> = (0..self.sources.len())
                        .filter(|s| {
                            self.g3_jobs.iter().any(|j| {
                                j.peer == Peer::Source(*s)
                                    && j.keys.iter().flatten().any(|span| span.store)
                            })
                        })
                        .collect();
                    let s = if !spilling.is_empty() && self.rng.chance(50) {
                        spilling[self.rng.below(spilling.len() as u64) as usize]
                    } else {
                        self.rng.below(2) as usize
                    };
                    if self.rng.chance(50) {
                        self.restart_source_guarded(s);
                    } else {
                        self.restart_source(s);
                    }
                    self.seen.crashes += 1;
                    if self.rng.chance(50) {
                        let lost = self.sources[s].endpoint.clone();
                        for t in &mut self.targets {
                            t.core.peer_connection_lost(&lost);
                        }
                    }
                }
            }
        }
        self.flush();
        self.check()
    }

    /// Source `s` (this process) builds a route to `target` now: in every
    /// window ending now, it built at most the budget's burst plus one per
    /// refill there.
    fn check_route_rate(&mut self, s: usize, target: &ControlEndpoint) {
        let now = self.now;
        let builds = self.sources[s]
            .route_builds
            .entry(target.clone())
            .or_default();
        builds.push(now);
        let over = builds.iter().rev().enumerate().find(|&(back, &since)| {
            back as u64 + 1 > u64::from(ROUTE_BURST) + (now - since) / ROUTE_REFILL
        });
        if let Some((back, since)) = over {
            let message = format!(
                "source {s} built {} routes to {target:?} in {} ns",
                back + 1,
                now - since
            );
            self.violation(message);
        }
    }

    /// A cluster member that misbehaves (it authenticated, so the channel
    /// stamps its own identity on what it sends): replies nobody asked it
    /// for, to a target; requests naming elements it was never granted, to
    /// a source (which has no route for it); probes for ops it never ran;
    /// metadata that changes every time (route churn), to a source.
    fn hostile(&mut self) {
        let header = Header {
            sender: Incarnation::from_raw(0xbad).unwrap(),
            route_generation: RouteGeneration(0),
            sender_endpoint: endpoint(HOSTILE),
        };
        let op = OpHandle(self.rng.below(64));
        let to_target = [
            Body::WriteDone {
                op_handle: op,
                outcome: WriteOutcome::Completed(CompletedIndices::new(vec![0, 1, 2, 3])),
            },
            Body::WriteProbeAck {
                op_handle: op,
                terminal: true,
                dead_incarnation: None,
            },
            Body::TargetMetadataAck {
                op_handle: Some(op),
                one_copy: self.rng.chance(50),
            },
            Body::WriteRefused { op_handle: op },
        ];
        let t = self.rng.below(2) as usize;
        let body = match self.rng.below(5) as usize {
            4 => {
                // A death report naming a real incarnation of a source
                // (this one or an earlier one), mostly for one of the ops
                // the target probed last (one it may still hold): never
                // believed from this endpoint.
                let mut probed: Vec<OpHandle> = self.targets[t].probed.iter().copied().collect();
                probed.sort_unstable();
                let op = match probed.len() as u64 {
                    0 => op,
                    n if self.rng.chance(75) => probed[(n - 1 - self.rng.below(n.min(8))) as usize],
                    _ => op,
                };
                let s = self.rng.below(2) as usize;
                let restarts = self.rng.below(self.sources[s].restarts as u64 + 1);
                let dead = source_incarnation(self.seed, s, restarts.into());
                Body::WriteProbeAck {
                    op_handle: op,
                    terminal: true,
                    dead_incarnation: Some(Incarnation::from_raw(dead).unwrap()),
                }
            }
            i => to_target[i].clone(),
        };
        let target = self.targets[t].endpoint.clone();
        let message = Message {
            header: header.clone(),
            body,
        };
        self.handle(&target, self.now, message);
        let s = self.rng.below(2) as usize;
        let keys = vec![BlockKey::from_u64(self.rng.below(KEYS))];
        let to_source = [
            Body::StartWrite {
                op_handle: op,
                remaining_timeout_ms: 1,
                source_incarnation: Some(
                    Incarnation::from_raw(self.sources[s].incarnation).unwrap(),
                ),
                namespace: self.ns,
                keys,
                destinations: vec![vec![ElementRef {
                    region: RegionId(0),
                    index: self.rng.below(1 << 20),
                }]],
            },
            Body::WriteProbe {
                op_handle: op,
                source_incarnation: None,
            },
        ];
        let source = self.sources[s].endpoint.clone();
        if self.rng.chance(66) {
            let body = to_source[self.rng.below(2) as usize].clone();
            self.handle(&source, self.now, Message { header, body });
            return;
        }
        // Route churn: a few adverts at once, each unlike the last.
        for _ in 0..=self.rng.below(4) {
            let body = Body::TargetMetadata {
                worker_address: vec![0xba, 0xd0],
                regions: vec![RegionAdvert {
                    id: RegionId(0),
                    label: format!("churn-{}", self.rng.below(1 << 30)),
                    base: 0x5000_0000,
                    element_size: BLOCK,
                    stride: BLOCK,
                    count: 4,
                    rkey: vec![9],
                }],
                shared_memory: None,
                doorbell: None,
            };
            let message = Message {
                header: header.clone(),
                body,
            };
            self.handle(&source, self.now, message);
        }
    }

    fn check(&mut self) -> Result<(), String> {
        for (t, target) in self.targets.iter().enumerate() {
            target
                .core
                .check_invariants()
                .map_err(|e| format!("target {t}: {e}"))?;
        }
        for (s, source) in self.sources.iter().enumerate() {
            source
                .core
                .check_invariants()
                .map_err(|e| format!("source {s}: {e}"))?;
        }
        if let Some(violation) = self.violations.first() {
            return Err(violation.clone());
        }
        for t in 0..self.targets.len() {
            self.check_results(t)?;
        }
        // No slot a put may still write is free.
        for put in &self.puts {
            if self.targets[put.target]
                .core
                .slot_is_free(PoolId(0), put.slot as u32)
            {
                return Err(format!(
                    "target {}'s slot {} is free while a put may still write it ({put:?})",
                    put.target, put.slot
                ));
            }
            // Nor is a slot a put of a live source still reads.
            let source = &self.sources[put.source];
            if put.incarnation == source.incarnation
                && source.core.slot_is_free(PoolId(0), put.from as u32)
            {
                return Err(format!(
                    "source {}'s slot {} is free while a put still reads it ({put:?})",
                    put.source, put.from
                ));
            }
        }
        // No slot a G3 job still reads or writes is free.
        for job in &self.g3_jobs {
            for span in job.keys.iter().flatten() {
                for place in [span.from, span.to] {
                    if let Place::Dram(slot) = place
                        && self.slot_free(job.peer, slot)
                    {
                        return Err(format!(
                            "{:?}'s slot {slot} is free while G3 job {:?} still touches it ({span:?})",
                            job.peer, job.job
                        ));
                    }
                }
            }
        }
        for t in &mut self.targets {
            t.core.drain_events().for_each(drop);
        }
        for s in &mut self.sources {
            s.core.drain_events().for_each(drop);
            // An engine's deposits on a source: nobody waits on them.
            let mut done = Vec::new();
            s.core.drain_completed(&mut done);
        }
        Ok(())
    }

    /// Target `t`'s completed operations: each completes once, a key failed
    /// by deadline never succeeds, a fetched page holds its key's bytes and
    /// a delivered one was copied from such a page.
    fn check_results(&mut self, t: usize) -> Result<(), String> {
        let mut done = Vec::new();
        self.targets[t].core.drain_completed(&mut done);
        for result in done {
            if !self.targets[t].completed_ops.insert(result.op) {
                return Err(format!("target {t}: op {:?} completed twice", result.op));
            }
            for (key, entry) in &result.entries {
                let target = &mut self.targets[t];
                if entry.status == EntryStatus::Failed(FailReason::Timeout) {
                    target.timed_out.insert((result.op, *key));
                    self.seen.timeouts += 1;
                }
                if !entry.is_success() {
                    continue;
                }
                if target.timed_out.contains(&(result.op, *key)) {
                    return Err(format!("target {t}: {key:?} timed out, then succeeded"));
                }
                self.seen.successes[t] += 1;
                let k = key.key.as_u64();
                if let Some(element) = target.deliver_elements.get(&(result.op, k)) {
                    if target.deliveries.get(element) != Some(&(k, true)) {
                        return Err(format!(
                            "target {t}: {key:?} delivered to element {element} without a copy of it"
                        ));
                    }
                    self.seen.delivered += 1;
                } else {
                    let slot = entry.slots.first().ok_or("success without a slot")?.index;
                    let landed = target.memory.dram.get(&slot);
                    if landed != Some(&k) {
                        return Err(format!(
                            "target {t}: {key:?} fetched from slot {slot} but the last put there was {landed:?}"
                        ));
                    }
                    if let Some(other) =
                        self.in_flight_at(Peer::Target(t), Place::Dram(slot), true, &[])
                    {
                        return Err(format!(
                            "target {t}: {key:?} fetched from slot {slot} while {other} may still write it"
                        ));
                    }
                }
                if let Some(release) = entry.release {
                    self.targets[t].core.release(&[release]);
                }
            }
        }
        Ok(())
    }

    /// Lets everything settle without message loss; every op must then
    /// complete.
    fn settle(&mut self) -> Result<(), String> {
        self.drop_percent = 0;
        for _ in 0..10_000 {
            let idle = self.targets.iter().all(|t| t.core.ops_in_flight() == 0);
            let quiet = self.network.is_empty()
                && self.puts.is_empty()
                && self.reports.is_empty()
                && self.g3_jobs.is_empty();
            if quiet && idle {
                break;
            }
            self.advance_to(self.now + TIMEOUT / 10);
            self.check()?;
        }
        for (t, target) in self.targets.iter().enumerate() {
            if target.core.ops_in_flight() != 0 {
                return Err(format!(
                    "target {t}: {} operations never completed",
                    target.core.ops_in_flight()
                ));
            }
        }
        Ok(())
    }

    /// What the run exercised.
    fn coverage(&self) -> Coverage {
        let mut seen = self.seen;
        seen.overlapping_keys = self.targets[0]
            .committed
            .intersection(&self.targets[1].committed)
            .count() as u64;
        seen.quarantined = self
            .targets
            .iter()
            .map(|t| t.core.peer_counters().quarantined)
            .sum();
        for t in &self.targets {
            let counters = t.core.peer_counters();
            seen.dead_freed += counters.dead_freed;
            seen.dead_ignored += counters.dead_ignored;
            seen.reprobes += counters.reprobes;
        }
        seen.routes_refused = self
            .sources
            .iter()
            .map(|s| s.core.peer_counters().routes_refused)
            .sum();
        let cores = self.targets.iter().map(|t| &t.core);
        seen.g3_evictions = cores
            .chain(self.sources.iter().map(|s| &s.core))
            .filter_map(Core::g3_counters)
            .map(|c| c.evictions)
            .sum();
        seen
    }
}

fn run_seed(seed: u64) -> Result<Coverage, String> {
    let mut sim = Sim::build(seed, 50);
    for step in 0..STEPS {
        sim.step()
            .map_err(|e| format!("seed {seed}, step {step}: {e}"))?;
    }
    sim.settle()
        .map_err(|e| format!("seed {seed}, settling: {e}"))?;
    Ok(sim.coverage())
}

/// Steps per seed before settling.
const STEPS: usize = 400;

#[test]
fn peer_protocol_survives_faults_over_many_seeds() {
    if let Some(seed) = std::env::var("KVCR_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        let seen = run_seed(seed).unwrap();
        eprintln!("peer_sim: seed {seed}: {seen:?}");
        return;
    }
    let seeds: u64 = std::env::var("KVCR_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    // Fresh seeds each run (the first is printed, and a failure names its
    // own), so CI explores new schedules instead of replaying the same ones.
    let first: u64 = std::env::var("KVCR_SIM_FIRST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(0u8) >> 16
        });
    eprintln!(
        "peer_sim: seeds {first}..{} (KVCR_SIM_FIRST_SEED={first})",
        first + seeds
    );
    let mut seen = Coverage::default();
    for seed in first..first + seeds {
        match run_seed(seed) {
            Ok(run) => seen.add(&run),
            Err(e) => panic!(
                "{e}\nreproduce: KVCR_SIM_SEED={seed} cargo test -p kvcr-runner-core --lib peer_sim"
            ),
        }
    }
    eprintln!("peer_sim: {seen:#?}");
    // The coverage the simulator exists for happened, at least once per ten
    // seeds (each is many times that; a handful of seeds may see less).
    if seeds >= 100 {
        let missing: Vec<&str> = [
            ("ops split into several writes", seen.split_requests),
            ("source 0 wrote", seen.writes[0]),
            ("source 1 wrote", seen.writes[1]),
            ("writes cut over several lanes", seen.multi_lane_writes),
            ("writes concurrent on one source", seen.concurrent_writes),
            (
                "one source writing for both targets",
                seen.shared_source_writes,
            ),
            ("put reports out of order", seen.out_of_order_reports),
            ("target 0 committed", seen.committed[0]),
            ("target 1 committed", seen.committed[1]),
            ("keys committed on both targets", seen.overlapping_keys),
            ("delivers", seen.delivered),
            ("write ends after a probe", seen.late_ends),
            ("failed pieces", seen.failed_pieces),
            ("late pieces", seen.late_pieces),
            ("source crashes", seen.crashes),
            ("source stalls", seen.stalls),
            ("quarantines", seen.quarantined),
            ("timeouts", seen.timeouts),
            ("runs with G3", seen.g3_runs),
            ("spills to G3", seen.spills),
            ("failed spills", seen.failed_spills),
            ("fills on a source (SourcePrepare)", seen.source_fills),
            ("pages put from a G3 fill", seen.served_from_g3),
            ("fills on a target", seen.target_fills),
            ("delivers straight from G3", seen.g3_delivers),
            ("failed fills", seen.failed_fills),
            ("source crashes mid-spill", seen.crashes_mid_spill),
            ("G3 evictions", seen.g3_evictions),
            ("guard-confirmed crashes", seen.guarded_crashes),
            ("puts resolved at a guarded crash", seen.guard_resolved_puts),
            ("death reports sent", seen.dead_reported),
            ("ops ended by a death report", seen.dead_freed),
            (
                "quarantined ops freed by a death report",
                seen.dead_freed_quarantined,
            ),
            (
                "death reports ending several ops",
                seen.dead_reports_ending_several,
            ),
            ("death reports ignored", seen.dead_ignored),
            ("quarantined ops probed again", seen.reprobes),
            ("route changes refused", seen.routes_refused),
            ("writes sent as messages", seen.message_writes),
            ("write messages taken", seen.messages_taken),
            ("write messages dropped", seen.messages_dropped),
        ]
        .into_iter()
        .filter(|(_, n)| n * 10 < seeds)
        .map(|(what, _)| what)
        .collect();
        assert!(missing.is_empty(), "too rare: {missing:?}");
    }
}

/// Target `t` fetches (or delivers) `keys` at the current time, under a
/// router hint naming source `s`.
fn hinted_request(sim: &mut Sim, t: usize, s: usize, keys: std::ops::Range<u64>, deliver: bool) {
    let now = sim.now;
    let keys: Vec<ScopedKey> = keys.map(|k| sim.key(k)).collect();
    let name = RequestId(format!("{t}-{s}-{deliver}-{now}"));
    let hint = FetchHint {
        source: sim.sources[s].endpoint.clone(),
        block_hashes: keys.iter().map(|k| k.key).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    let target = &mut sim.targets[t];
    target.core.submit_hint(now, name.clone(), &hint);
    assert_eq!(
        target.core.query_request(&keys[0], Some(&name)),
        QueryStatus::Fetchable(kvcr_contracts::tier::Tier::External)
    );
    if deliver {
        let entries = keys
            .iter()
            .map(|key| {
                let element = target.next_element;
                target.next_element += 1;
                target.deliveries.insert(element, (key.key.as_u64(), false));
                DeliverEntry {
                    key: *key,
                    destinations: vec![ElementRef {
                        region: target.framework,
                        index: element,
                    }],
                }
            })
            .collect();
        let op = target.core.deliver(now, entries, Some(&name)).unwrap();
        for (i, key) in keys.iter().enumerate() {
            let element = target.next_element - keys.len() as u64 + i as u64;
            target
                .deliver_elements
                .insert((op, key.key.as_u64()), element);
        }
    } else {
        target
            .core
            .fetch(now, &keys, &[PoolId(0)], Some(&name))
            .unwrap();
    }
}

/// Without faults, hinted fetches and delivers restore every key their
/// source holds: both targets pull from source 0 at once, target 1 also
/// from source 1, with each target's batching and each source's lanes.
/// Target 0 fetches `keys` at `now` under a hint (request `name`) naming
/// source 0, and the first messages are sent (nothing is delivered yet).
fn start_hinted_fetch(sim: &mut Sim, keys: &[ScopedKey], now: u64, name: &str) {
    let request = RequestId(name.into());
    let hint = FetchHint {
        source: endpoint(2),
        block_hashes: keys.iter().map(|k| k.key).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    sim.targets[0].core.submit_hint(now, request.clone(), &hint);
    sim.targets[0]
        .core
        .fetch(now, keys, &[PoolId(0)], Some(&request))
        .unwrap();
    sim.flush();
}

#[test]
fn fault_free_requests_restore_the_hinted_keys() {
    for seed in [7, 8, 9, 10] {
        let mut sim = Sim::new(seed);
        sim.quiet();
        hinted_request(&mut sim, 0, 0, 0..4, false);
        hinted_request(&mut sim, 1, 0, 4..8, false);
        hinted_request(&mut sim, 1, 1, 8..12, true);
        sim.flush();
        // Deliver everything without loss; every piece lands.
        for _ in 0..100 {
            sim.now += TIMEOUT / 100;
            let now = sim.now;
            let due: Vec<(u64, u64)> = sim
                .network
                .range(..=(now, u64::MAX))
                .map(|(k, _)| *k)
                .collect();
            for k in due {
                let (to, message) = sim.network.remove(&k).unwrap();
                sim.handle(&to, now, message);
            }
            sim.complete_due_puts();
            sim.complete_due_messages();
            sim.flush();
            sim.check().unwrap();
        }
        let seen = sim.coverage();
        let counters = |core: &Core| core.peer_counters();
        assert_eq!(
            (seen.successes, seen.delivered, seen.committed),
            ([4, 8], 4, [4, 8]),
            "seed {seed}: {seen:?}"
        );
        assert_eq!(counters(&sim.targets[0].core).keys_received, 4);
        assert_eq!(counters(&sim.targets[1].core).keys_received, 8);
        assert_eq!(counters(&sim.sources[0].core).keys_sent, 8);
        assert_eq!(counters(&sim.sources[1].core).keys_sent, 4);
        assert!(sim.targets.iter().all(|t| t.core.ops_in_flight() == 0));
    }
}

/// Without faults, keys a source holds only in G3 are restored too: it
/// fills them back into its pool before serving each `start_write`
/// (`SourcePrepare`), moving the pages it had there to G3 to make room,
/// and the next request, for those pages, is served the same way. (G3 has
/// room for every key here: a victim G3 has no slot for is dropped.)
#[test]
fn fault_free_requests_restore_keys_only_g3_holds() {
    for (seed, slots, spill_ahead) in [(7, 4, false), (8, 4, true), (9, 5, false), (10, 5, true)] {
        let mut sim = Sim::build(seed, 100);
        sim.quiet();
        let tiers = Tiers::with_g3(slots, SOURCE_KEYS as u32, spill_ahead);
        sim.sources[0] = Source::new(0, seed, 0, 2, 0, sim.ns, tiers, HashMap::new());
        let first = SOURCE_FIRST_KEY[0];
        let g3_only = (first..first + SOURCE_KEYS)
            .filter(|k| sim.sources[0].core.query(&sim.key(*k)) != QueryStatus::Hit)
            .count() as u64;
        assert_eq!(g3_only, SOURCE_KEYS - u64::from(slots), "seed {seed}");
        // The oldest keys went to G3: 0..4 are there only (but 3, with a
        // pool of 5); 4..8 are in the pool until the first request's fills
        // move them.
        hinted_request(&mut sim, 0, 0, 0..4, false);
        sim.flush();
        sim.settle().unwrap();
        hinted_request(&mut sim, 1, 0, 4..8, true);
        sim.flush();
        sim.settle().unwrap();
        let seen = sim.coverage();
        assert_eq!(
            (seen.successes, seen.delivered),
            ([4, 4], 4),
            "seed {seed}: {seen:?}"
        );
        assert_eq!(sim.sources[0].core.peer_counters().keys_sent, 8);
        assert!(seen.source_fills > g3_only, "seed {seed}: {seen:?}");
        assert_eq!(
            seen.served_from_g3, seen.source_fills,
            "seed {seed}: {seen:?}"
        );
        assert_eq!((seen.failed_fills, seen.failed_spills), (0, 0));
    }
}

/// A `start_write` that waited in the source's socket while the source was
/// stopped is refused, even when the first turn after the stop handles the
/// message before its tick: a stalled source never serves a queued request
/// with a fresh deadline.
#[test]
fn a_request_queued_during_a_stall_is_refused() {
    let mut sim = Sim::new(11);
    sim.quiet();
    let keys: Vec<ScopedKey> = (0..2).map(|k| sim.key(k)).collect();
    start_hinted_fetch(&mut sim, &keys, 0, "r");
    // Metadata and its ack go round at time 0, the source ticking on each
    // turn, until the start_write is on its way.
    let mut stale = None;
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if to == endpoint(1) {
            sim.targets[0].core.handle_message(0, message);
        } else if matches!(message.body, Body::StartWrite { .. }) {
            stale = Some(message);
            break;
        } else {
            sim.sources[0].core.handle_tick(0);
            sim.sources[0].core.handle_message(0, message);
        }
        sim.flush();
    }
    let stale = stale.expect("the target sent its start_write");
    let refused = sim.sources[0].core.peer_counters().refused;
    // The process was stopped for a whole operation timeout; the message is
    // handled before the first tick after it.
    sim.sources[0].core.handle_message(TIMEOUT, stale);
    assert_eq!(sim.sources[0].core.peer_counters().refused, refused + 1);
    let mut replied = false;
    while let Some(action) = sim.sources[0].core.poll_action() {
        match action {
            Action::Put { .. } => panic!("a request queued during a stall was written"),
            Action::Send { message, .. } => {
                replied |= matches!(
                    message.body,
                    Body::WriteDone {
                        outcome: WriteOutcome::Failed { terminal: true },
                        ..
                    }
                );
            }
            _ => {}
        }
    }
    assert!(replied, "the refusal is a terminal failure");
}

/// After an operation expires (the source may have died), the next write
/// waits for a fresh metadata ack instead of naming the cached incarnation:
/// a process restarted at the same address is asked by its own incarnation,
/// and the old one never receives it.
#[test]
fn a_write_after_an_expiry_waits_for_a_fresh_ack() {
    let mut sim = Sim::new(13);
    sim.quiet();
    let old = Incarnation::from_raw(sim.sources[0].incarnation).unwrap();
    // Metadata, ack and a start_write naming the old incarnation.
    let k0 = sim.key(0);
    start_hinted_fetch(&mut sim, &[k0], 0, "a");
    let mut named = Vec::new();
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if let Body::StartWrite {
            source_incarnation, ..
        } = &message.body
        {
            named.push(*source_incarnation);
            continue; // the source dies before it reads it
        }
        sim.handle(&to, 0, message);
        sim.flush();
    }
    named.dedup();
    assert_eq!(named, vec![Some(old)]);
    // The op expires; a new process takes the address.
    sim.targets[0].core.handle_tick(TIMEOUT);
    sim.targets[0].core.handle_timeout(TIMEOUT);
    sim.network.clear();
    sim.now = TIMEOUT; // the new process starts then
    sim.restart_source(0);
    let new = Incarnation::from_raw(sim.sources[0].incarnation).unwrap();
    let k1 = sim.key(1);
    start_hinted_fetch(&mut sim, &[k1], TIMEOUT + 1, "b");
    let mut named = Vec::new();
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if let Body::StartWrite {
            source_incarnation, ..
        } = &message.body
        {
            named.push(*source_incarnation);
        }
        sim.handle(&to, TIMEOUT + 1, message);
        sim.flush();
    }
    named.dedup(); // the simulated network may duplicate a message
    assert_eq!(named, vec![Some(new)], "only the new incarnation is asked");
    assert_eq!(sim.sources[0].core.peer_counters().refused, 0);
}

// ------------------------------------------------------------ trust rules

fn from(port: u16, incarnation: u128, body: Body) -> Message {
    Message {
        header: Header {
            sender: Incarnation::from_raw(incarnation).unwrap(),
            route_generation: RouteGeneration(0),
            sender_endpoint: endpoint(port),
        },
        body,
    }
}

/// The messages a core sent, in order (other actions are dropped).
fn sent(core: &mut Core) -> Vec<(ControlEndpoint, Body)> {
    let mut out = Vec::new();
    while let Some(action) = core.poll_action() {
        if let Action::Send { to, message } = action {
            out.push((to, message.body));
        }
    }
    out
}

fn metadata(regions: usize) -> Body {
    Body::TargetMetadata {
        worker_address: vec![1; 4],
        regions: (0..regions)
            .map(|i| RegionAdvert {
                id: RegionId(i as u32),
                label: format!("r{i}"),
                base: TARGET_POOL,
                element_size: BLOCK,
                stride: BLOCK,
                count: u64::from(SLOTS),
                rkey: vec![1, 2, 3],
            })
            .collect(),
        shared_memory: None,
        doorbell: None,
    }
}

/// A source with keys 0..8, and the incarnation it answers as.
fn stocked_source(adjust: impl FnOnce(&mut PeerConfig)) -> (Sim, Incarnation) {
    let mut sim = Sim::new(3);
    sim.reconfigure_source(0, adjust);
    let incarnation = sim.sources[0].incarnation;
    (sim, Incarnation::from_raw(incarnation).unwrap())
}

fn start_write(op: u64, source: Incarnation, ns: NamespaceId, key: u64) -> Body {
    Body::StartWrite {
        op_handle: OpHandle(op),
        remaining_timeout_ms: 1,
        source_incarnation: Some(source),
        namespace: ns,
        keys: vec![BlockKey::from_u64(key)],
        destinations: vec![vec![ElementRef {
            region: RegionId(0),
            index: 0,
        }]],
    }
}

/// With an allowlist, a router hint naming another source makes the rank
/// send nothing (no metadata, no memory description) and fetch nothing, and
/// messages from outside the list are refused before any handler.
#[test]
fn an_allowlist_keeps_hints_and_messages_to_its_peers() {
    let (mut target, ns) = new_core_with(TARGET_POOL, 1, 1, Tiers::DRAM_ONLY, |c| {
        c.allowed_peers = vec![endpoint(2)];
    });
    let hint = FetchHint {
        source: endpoint(7),
        block_hashes: vec![BlockKey::from_u64(1)],
        mode: FetchMode::Copy,
        action_id: None,
    };
    let request = RequestId("r".into());
    target.submit_hint(0, request.clone(), &hint);
    assert!(sent(&mut target).is_empty(), "nothing told to a stranger");
    let key = ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(1),
    };
    assert_eq!(
        target.query_request(&key, Some(&request)),
        QueryStatus::Miss
    );
    target.handle_message(0, from(7, 7, metadata(1)));
    assert!(sent(&mut target).is_empty());
    assert_eq!(target.peer_counters().refused_peers, 2);
    assert_eq!(target.peer_state_sizes().routes, 0);
    // The allowed source is served as usual.
    let hint = FetchHint {
        source: endpoint(2),
        ..hint
    };
    target.submit_hint(0, request, &hint);
    assert!(matches!(
        sent(&mut target).as_slice(),
        [(to, Body::TargetMetadata { .. })] if *to == endpoint(2)
    ));
}

/// A private namespace is served only to its members; others get a terminal
/// failure and nothing is written or claimed.
#[test]
fn a_private_namespace_is_refused_to_other_targets() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    sim.reconfigure_source(0, |c| {
        c.private_namespaces = vec![(ns, vec![endpoint(5)])];
    });
    for (port, op) in [(1u16, 1u64), (5, 2)] {
        sim.sources[0]
            .core
            .handle_message(0, from(port, 11, metadata(1)));
        sim.sources[0].core.handle_message(
            0,
            from(port, 11, start_write(op, source_incarnation, ns, 0)),
        );
    }
    let replies = sent(&mut sim.sources[0].core);
    let refused = replies.iter().any(|(to, body)| {
        *to == endpoint(1)
            && matches!(
                body,
                Body::WriteDone {
                    op_handle: OpHandle(1),
                    outcome: WriteOutcome::Failed { terminal: true }
                }
            )
    });
    assert!(refused, "{replies:?}");
    assert_eq!(sim.sources[0].core.peer_counters().refused_private, 1);
    assert_eq!(
        sim.sources[0].core.peer_busy().1,
        1,
        "the member's write is under way"
    );
}

/// The driver's wake time: nothing pending wakes it a quarter of the
/// operation timeout after its last tick (a stall is still told from an idle
/// sleep); a pending request wakes it at its deadline.
#[test]
fn an_idle_driver_wakes_for_stall_checks_and_deadlines_only() {
    let (mut target, ns) = new_core(TARGET_POOL, 1, 1);
    assert_eq!(target.peer_wake_at(), None, "never ticked: no guard yet");
    target.handle_tick(1_000);
    assert_eq!(target.peer_wake_at(), Some(1_000 + TIMEOUT / 4));
    let request = RequestId("wake".into());
    let key = ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(1),
    };
    target.submit_hint(
        1_000,
        request.clone(),
        &FetchHint {
            source: endpoint(2),
            block_hashes: vec![key.key],
            mode: FetchMode::Copy,
            action_id: None,
        },
    );
    target
        .fetch(1_000, &[key], &[PoolId(0)], Some(&request))
        .unwrap();
    let wake = target.peer_wake_at().unwrap();
    assert!(wake <= 1_000 + TIMEOUT, "the request's deadline: {wake}");
    assert_eq!(target.peer_transport_waits(), 1, "no one-copy ack yet");
}

/// Metadata past the stated bounds is neither kept nor acknowledged nor
/// handed to UCX; within them it is.
#[test]
fn oversized_metadata_is_refused_whole() {
    let (mut sim, _) = stocked_source(|_| {});
    let too_many = metadata(MAX_ADVERTISED_REGIONS + 1);
    let Body::TargetMetadata { regions, .. } = metadata(1) else {
        unreachable!()
    };
    let huge_address = Body::TargetMetadata {
        worker_address: vec![0; MAX_WORKER_ADDRESS_LEN + 1],
        regions: regions.clone(),
        shared_memory: None,
        doorbell: None,
    };
    let mut big_rkey = regions;
    big_rkey[0].rkey = vec![0; MAX_RKEY_LEN + 1];
    let huge_rkey = Body::TargetMetadata {
        worker_address: vec![1; 4],
        regions: big_rkey,
        shared_memory: None,
        doorbell: None,
    };
    for body in [too_many, huge_address, huge_rkey] {
        sim.sources[0].core.handle_message(0, from(1, 11, body));
        assert!(
            sent(&mut sim.sources[0].core).is_empty(),
            "not acknowledged"
        );
    }
    assert_eq!(sim.sources[0].core.peer_counters().refused, 3);
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 0);
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, metadata(MAX_ADVERTISED_REGIONS)));
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 1);
}

/// The doorbell rides with the route: the same key is the same route (no
/// new connect), a new key is a new route generation handed to the driver;
/// a write's completion is offered for ringing only while it is being
/// written and covers every key asked for.
#[test]
fn a_doorbell_is_part_of_the_route_and_offers_only_whole_writes() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    let with_key = |key: u8| {
        let Body::TargetMetadata {
            worker_address,
            regions,
            shared_memory,
            ..
        } = metadata(1)
        else {
            unreachable!()
        };
        Body::TargetMetadata {
            worker_address,
            regions,
            shared_memory,
            doorbell: Some(DoorbellAdvert {
                region: RegionId(0),
                key: [key; 32],
            }),
        }
    };
    let connects = |sim: &mut Sim| -> Vec<(u64, Option<DoorbellAdvert>)> {
        std::iter::from_fn(|| sim.sources[0].core.poll_action())
            .filter_map(|a| match a {
                Action::Connect {
                    generation,
                    doorbell,
                    ..
                } => Some((generation, doorbell)),
                _ => None,
            })
            .collect()
    };
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, with_key(1)));
    let first = connects(&mut sim);
    assert!(
        matches!(first.as_slice(), [(_, Some(d))] if d.key == [1; 32]),
        "{first:?}"
    );
    sim.sources[0]
        .core
        .handle_connected(&endpoint(1), first[0].0, true);
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, with_key(1)));
    assert!(
        connects(&mut sim).is_empty(),
        "the same key: the same route"
    );
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, with_key(2)));
    let second = connects(&mut sim);
    assert!(
        matches!(second.as_slice(), [(g, Some(d))] if *g > first[0].0 && d.key == [2; 32]),
        "{second:?}"
    );
    sim.sources[0]
        .core
        .handle_connected(&endpoint(1), second[0].0, true);
    sent(&mut sim.sources[0].core);
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, start_write(7, source_incarnation, ns, 0)));
    let write = std::iter::from_fn(|| sim.sources[0].core.poll_action())
        .find_map(|a| match a {
            Action::Put { write, .. } => Some(write),
            _ => None,
        })
        .expect("the write is put");
    assert_eq!(
        sim.sources[0].core.peer_write_completion(write),
        Some((OpHandle(7), 1))
    );
    assert_eq!(sim.sources[0].core.peer_write_completion(write + 1), None);
    sim.sources[0].core.handle_put_done(0, write, true);
    assert_eq!(
        sim.sources[0].core.peer_write_completion(write),
        None,
        "an ended write offers nothing"
    );
}

/// A write whose bytes leave as one message carrying its completion ends
/// without a `write_done` (the message is it); one that failed to leave, or
/// whose target gave up meanwhile, ends with a terminal failure as a put
/// would. Either way its keys are released.
#[test]
fn a_write_sent_as_a_message_sends_no_second_completion() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    let core = &mut sim.sources[0].core;
    core.handle_message(0, from(1, 11, metadata(1)));
    let generation = std::iter::from_fn(|| core.poll_action())
        .find_map(|a| match a {
            Action::Connect { generation, .. } => Some(generation),
            _ => None,
        })
        .expect("a connect");
    core.handle_connected(&endpoint(1), generation, false);
    sent(core);
    let put = |core: &mut Core, op: u64, key: u64| {
        core.handle_message(0, from(1, 11, start_write(op, source_incarnation, ns, key)));
        std::iter::from_fn(|| core.poll_action())
            .find_map(|a| match a {
                Action::Put { write, .. } => Some(write),
                _ => None,
            })
            .expect("the write is put")
    };
    let first = put(core, 7, 0);
    assert_eq!(core.peer_write_completion(first), Some((OpHandle(7), 1)));
    core.handle_message_sent(0, first, true);
    assert!(sent(core).is_empty(), "the message was the write_done");
    assert_eq!(core.peer_busy().1, 0, "the write ended");
    assert_eq!(core.peer_counters().keys_sent, 1);
    let second = put(core, 8, 1);
    core.handle_message_sent(0, second, false);
    assert!(
        matches!(
            sent(core).as_slice(),
            [(
                _,
                Body::WriteDone {
                    op_handle: OpHandle(8),
                    outcome: WriteOutcome::Failed { terminal: true }
                }
            )]
        ),
        "a message that did not leave ends as a failed put"
    );
    assert_eq!(core.peer_busy().1, 0);
    // Both keys were released: probes answer that nothing is in flight.
    for op in [7, 8] {
        core.handle_message(
            0,
            from(
                1,
                11,
                Body::WriteProbe {
                    op_handle: OpHandle(op),
                    source_incarnation: Some(source_incarnation),
                },
            ),
        );
        assert!(matches!(
            sent(core).as_slice(),
            [(_, Body::WriteProbeAck { terminal: true, .. })]
        ));
    }
}

/// Where a write's bytes may be copied when they arrive as a message: the
/// elements the target granted, in request order, only for the operation's
/// whole key count and only while it waits for its reply.
#[test]
fn landing_spans_are_the_granted_elements_while_the_reply_is_awaited() {
    let mut sim = Sim::new(17);
    sim.quiet();
    let keys = vec![sim.key(0), sim.key(1)];
    start_hinted_fetch(&mut sim, &keys, 0, "landing");
    // Deliver everything but the start_write (the source never sees it).
    let mut start = None;
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if let Body::StartWrite {
            op_handle,
            destinations,
            ..
        } = &message.body
        {
            start = Some((*op_handle, destinations.clone()));
            continue;
        }
        sim.handle(&to, 0, message);
        sim.flush();
    }
    let (op, destinations) = start.expect("a start_write went out");
    let target = &mut sim.targets[0].core;
    let granted: Vec<(u64, u64)> = destinations
        .iter()
        .flatten()
        .map(|e| target.resolve(*e).unwrap())
        .collect();
    assert_eq!(granted.len(), 2);
    assert_eq!(target.peer_landing_spans(op, 2), Some(granted));
    let first_key: Vec<(u64, u64)> = destinations[0]
        .iter()
        .map(|e| target.resolve(*e).unwrap())
        .collect();
    assert_eq!(
        target.peer_landing_spans(op, 1),
        Some(first_key),
        "the first key's (a source that holds only it)"
    );
    assert_eq!(target.peer_landing_spans(op, 3), None);
    assert_eq!(target.peer_landing_spans(op, 0), None);
    assert_eq!(target.peer_landing_spans(OpHandle(op.0 + 1), 2), None);
    let source = Incarnation::from_raw(sim.sources[0].incarnation).unwrap();
    let done = Message {
        header: Header {
            sender: source,
            route_generation: RouteGeneration(0),
            sender_endpoint: endpoint(2),
        },
        body: Body::WriteDone {
            op_handle: op,
            outcome: WriteOutcome::Completed(CompletedIndices::new(vec![0, 1])),
        },
    };
    sim.handle(&endpoint(1), 0, done);
    assert_eq!(
        sim.targets[0].core.peer_landing_spans(op, 2),
        None,
        "the operation ended"
    );
}

/// A route lives as long as its session and its UCX connect: when either
/// ends, nothing of it is kept and writes through it are refused.
#[test]
fn a_route_goes_with_its_session_or_a_failed_connect() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, metadata(1)));
    let generation = std::iter::from_fn(|| sim.sources[0].core.poll_action())
        .find_map(|a| match a {
            Action::Connect { generation, .. } => Some(generation),
            _ => None,
        })
        .unwrap();
    assert!(
        sent(&mut sim.sources[0].core).is_empty(),
        "the ack waits for the connect"
    );
    sim.sources[0]
        .core
        .handle_connect_failed(&endpoint(1), generation, ConnectFailure::Unusable);
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 0);
    assert!(matches!(
        sent(&mut sim.sources[0].core).as_slice(),
        [(
            _,
            Body::TargetMetadataAck {
                one_copy: false,
                ..
            }
        )]
    ));
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, start_write(1, source_incarnation, ns, 0)));
    assert!(matches!(
        sent(&mut sim.sources[0].core).as_slice(),
        [(_, Body::WriteRefused { .. })]
    ));
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, metadata(1)));
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 1);
    sim.sources[0].core.peer_target_gone(&endpoint(1));
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 0);
}

/// The route budget's cell rate: a fresh target may change now; up to
/// `burst` changes queue ahead of `now`; 0 counts as 1; extremes saturate.
#[rstest::rstest]
#[case::fresh(4, 10, None, 100, Some(110))]
#[case::long_ago(4, 10, Some(50), 100, Some(110))]
#[case::within_burst(4, 10, Some(130), 100, Some(140))]
#[case::over_burst(4, 10, Some(131), 100, None)]
#[case::one_at_a_time(1, 10, Some(110), 105, None)]
#[case::zero_burst_is_one(0, 10, Some(101), 100, None)]
#[case::zero_burst_fresh(0, 10, None, 100, Some(110))]
#[case::saturates(u32::MAX, u64::MAX, Some(u64::MAX), 0, Some(u64::MAX))]
fn route_budget_admits_a_burst_then_one_per_refill(
    #[case] burst: u32,
    #[case] refill_ns: u64,
    #[case] due: Option<u64>,
    #[case] now: u64,
    #[case] expected: Option<u64>,
) {
    let budget = RouteBudget { burst, refill_ns };
    assert_eq!(budget.admit(now, due), expected);
}

/// Metadata that says `label` for its one region: each new label is a
/// route change.
fn labelled_metadata(label: &str) -> Body {
    let Body::TargetMetadata {
        worker_address,
        mut regions,
        shared_memory,
        doorbell,
    } = metadata(1)
    else {
        unreachable!("metadata() builds TargetMetadata")
    };
    regions[0].label = label.to_owned();
    Body::TargetMetadata {
        worker_address,
        regions,
        shared_memory,
        doorbell,
    }
}

/// The route builds a core asks of its driver, and the messages it sends
/// (other actions are dropped).
fn connects_and_sends(core: &mut Core) -> (Vec<(ControlEndpoint, u64)>, Vec<Body>) {
    let (mut connects, mut sends) = (Vec::new(), Vec::new());
    while let Some(action) = core.poll_action() {
        match action {
            Action::Connect {
                peer, generation, ..
            } => connects.push((peer, generation)),
            Action::Send { message, .. } => sends.push(message.body),
            _ => {}
        }
    }
    (connects, sends)
}

fn connects(core: &mut Core) -> Vec<(ControlEndpoint, u64)> {
    connects_and_sends(core).0
}

/// A target that changes its route in a loop gets its burst at once, then
/// one per refill: the rest are refused unacknowledged (counted), its old
/// route stays, and a refused target re-sending after the refill is served.
#[test]
fn route_changes_beyond_the_budget_are_refused_until_it_refills() {
    let (mut sim, _) = stocked_source(|c| {
        c.route_budget = RouteBudget {
            burst: 3,
            refill_ns: 1_000,
        };
    });
    let core = &mut sim.sources[0].core;
    let mut built = Vec::new();
    for round in 0..10 {
        core.handle_message(0, from(1, 11, labelled_metadata(&format!("r{round}"))));
        let (connects, replies) = connects_and_sends(core);
        assert!(replies.is_empty(), "refused or waiting for its connect");
        built.extend(connects);
    }
    assert_eq!(built.len(), 3, "the burst, at once");
    assert_eq!(core.peer_counters().routes_refused, 7);
    for (peer, generation) in &built {
        core.handle_connected(peer, *generation, false);
    }
    let acks = sent(core);
    assert_eq!(
        acks.len(),
        1,
        "only the newest generation is acknowledged: {acks:?}"
    );
    // Refused metadata left the last built route in place: the same advert
    // again is no change, and is acknowledged at once.
    core.handle_message(10, from(1, 11, labelled_metadata("r2")));
    let (built, replies) = connects_and_sends(core);
    assert!(built.is_empty());
    assert!(
        matches!(replies.as_slice(), [Body::TargetMetadataAck { .. }]),
        "{replies:?}"
    );
    // Not yet refilled, then refilled: one more change.
    core.handle_message(999, from(1, 11, labelled_metadata("r9")));
    assert!(connects(core).is_empty());
    core.handle_message(1_000, from(1, 11, labelled_metadata("r9")));
    assert_eq!(connects(core).len(), 1);
    core.handle_message(1_000, from(1, 11, labelled_metadata("r10")));
    assert!(connects(core).is_empty(), "one per refill");
    // Another target has its own budget.
    core.handle_message(1_000, from(5, 12, labelled_metadata("x")));
    assert_eq!(connects(core).len(), 1);
    assert_eq!(core.peer_counters().routes_refused, 7 + 2);
    core.check_invariants().unwrap();
}

/// The budgets a source remembers are bounded: with every one of
/// [`MAX_ROUTE_BUDGETS`] in use a new target is refused; once they have
/// refilled (as good as forgotten) they make room.
#[test]
fn remembered_route_budgets_are_bounded() {
    let refill_ns = 1_000;
    let (mut sim, _) = stocked_source(|c| {
        c.route_budget = RouteBudget {
            burst: 1,
            refill_ns,
        };
    });
    let core = &mut sim.sources[0].core;
    let port = |i: usize| 10_000 + i as u16;
    for i in 0..MAX_ROUTE_BUDGETS {
        core.handle_message(0, from(port(i), 100 + i as u128, metadata(1)));
        assert_eq!(connects(core).len(), 1, "target {i}");
    }
    let newcomer = port(MAX_ROUTE_BUDGETS);
    core.handle_message(1, from(newcomer, 99, metadata(1)));
    assert!(
        connects(core).is_empty(),
        "no room while every budget is spent"
    );
    assert_eq!(core.peer_counters().routes_refused, 1);
    core.handle_message(refill_ns, from(newcomer, 99, metadata(1)));
    assert_eq!(connects(core).len(), 1, "refilled budgets were forgotten");
    core.check_invariants().unwrap();
}

/// A probe flood from one target keeps at most `MAX_FENCES_PER_TARGET`
/// fences; folded fences still refuse every op at or below the highest
/// probed, and accepted ops prune the fences below them.
#[test]
fn fences_stay_bounded_under_a_probe_flood() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, metadata(1)));
    let flood = 10 * MAX_FENCES_PER_TARGET as u64;
    for op in 1..=flood {
        sim.sources[0].core.handle_message(
            0,
            from(
                1,
                11,
                Body::WriteProbe {
                    op_handle: OpHandle(op),
                    source_incarnation: None,
                },
            ),
        );
        assert!(sim.sources[0].core.peer_state_sizes().fences <= MAX_FENCES_PER_TARGET);
    }
    sent(&mut sim.sources[0].core);
    for op in [1, flood / 2, flood] {
        sim.sources[0]
            .core
            .handle_message(0, from(1, 11, start_write(op, source_incarnation, ns, 0)));
        assert!(
            matches!(
                sent(&mut sim.sources[0].core).as_slice(),
                [(
                    _,
                    Body::WriteDone {
                        outcome: WriteOutcome::Failed { terminal: true },
                        ..
                    }
                )]
            ),
            "op {op} was probed: it never writes"
        );
    }
    assert_eq!(sim.sources[0].core.peer_busy().1, 0);
    sim.sources[0].core.handle_message(
        0,
        from(1, 11, start_write(flood + 1, source_incarnation, ns, 0)),
    );
    assert_eq!(sim.sources[0].core.peer_busy().1, 1, "a fresh op is served");
    assert_eq!(
        sim.sources[0].core.peer_state_sizes().fences,
        0,
        "pruned below it"
    );
}

/// Targets that come and go with fresh incarnations, and router hints naming
/// ever new sources, leave a bounded memory behind.
#[test]
fn per_peer_memory_is_bounded_over_many_peers() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    let peers = 3 * MAX_REMEMBERED_PEERS as u128;
    for incarnation in 100..100 + peers {
        sim.sources[0]
            .core
            .handle_message(0, from(1, incarnation, metadata(1)));
        sim.sources[0].core.handle_message(
            0,
            from(1, incarnation, start_write(1, source_incarnation, ns, 99)),
        );
        sim.sources[0].core.peer_target_gone(&endpoint(1));
        sent(&mut sim.sources[0].core);
    }
    let sizes = sim.sources[0].core.peer_state_sizes();
    assert!(sizes.high_water <= MAX_REMEMBERED_PEERS + 1, "{sizes:?}");
    assert_eq!(sizes.routes, 0);

    let (mut target, _) = new_core(TARGET_POOL, 1, 1);
    for port in 0..3 * MAX_REMEMBERED_PEERS {
        let request = RequestId(format!("r{port}"));
        let hint = FetchHint {
            source: ControlEndpoint::parse(&format!(
                "tcp://127.0.{}.{}:9",
                port / 250,
                port % 250 + 1
            ))
            .unwrap(),
            block_hashes: vec![BlockKey::from_u64(1)],
            mode: FetchMode::Copy,
            action_id: None,
        };
        target.submit_hint(0, request.clone(), &hint);
        target.discard_hint(&request);
        sent(&mut target);
    }
    let sizes = target.peer_state_sizes();
    assert!(sizes.sources <= MAX_REMEMBERED_PEERS, "{sizes:?}");
    assert_eq!(sizes.hinted_requests, 0);
}

/// A source with G3 (a pool of 4 slots for 8 keys, spilling ahead or not)
/// that accepted target port 1's `start_write` op 1 for a key only G3
/// holds: the write is being prepared. Returns the source, its
/// incarnation, and the G3 jobs the preparation started (room made by a
/// spill, or the fill).
fn preparing_source(spill_ahead: bool) -> (Sim, Incarnation, Vec<(JobId, usize)>) {
    let mut sim = Sim::new(5);
    let ns = sim.ns;
    let tiers = Tiers::with_g3(4, 8, spill_ahead);
    sim.sources[0] = Source::new(0, 5, 1, 1, 0, ns, tiers, HashMap::new());
    let source = &mut sim.sources[0].core;
    let incarnation = Incarnation::from_raw(source_incarnation(5, 0, 1)).unwrap();
    let g3_only = (0..SOURCE_KEYS)
        .find(|k| {
            let key = scoped(ns, *k);
            source.query(&key) != QueryStatus::Hit && source.g3_ready(&key)
        })
        .expect("a pool of 4 slots leaves some of 8 keys in G3 only");
    source.handle_message(0, from(1, 11, metadata(1)));
    let generation = std::iter::from_fn(|| source.poll_action())
        .find_map(|a| match a {
            Action::Connect { generation, .. } => Some(generation),
            _ => None,
        })
        .unwrap();
    source.handle_connected(&endpoint(1), generation, false);
    sent(source);
    source.handle_message(0, from(1, 11, start_write(1, incarnation, ns, g3_only)));
    let g3: Vec<(JobId, usize)> = std::iter::from_fn(|| source.poll_action())
        .filter_map(|a| match a {
            Action::G3 { job, transfers, .. } => Some((job, transfers.len())),
            _ => None,
        })
        .collect();
    assert!(!g3.is_empty(), "the key is filled from G3 first");
    (sim, incarnation, g3)
}

/// Runs `core`'s G3 jobs (and those they lead to) at `now`, all copied:
/// whether a put was issued, and whether a write ended in a terminal
/// failure.
fn finish_g3_jobs(core: &mut Core, now: u64, mut g3: Vec<(JobId, usize)>) -> (bool, bool) {
    let mut put = false;
    let mut failed = false;
    while let Some((job, n)) = g3.pop() {
        core.handle_copy_done(now, job, &vec![CopyOutcome::Copied; n]);
        while let Some(action) = core.poll_action() {
            match action {
                Action::Put { .. } => put = true,
                Action::G3 { job, transfers, .. } => g3.push((job, transfers.len())),
                Action::Send { message, .. } => {
                    failed |= matches!(
                        message.body,
                        Body::WriteDone {
                            outcome: WriteOutcome::Failed { terminal: true },
                            ..
                        }
                    );
                }
                _ => {}
            }
        }
    }
    (put, failed)
}

/// A probe for a write whose keys a source is still filling from G3
/// (`SourcePrepare`) ends it: nothing was put yet, so the answer is
/// terminal, and when the fill ends the write is refused, never put into
/// slots the target has freed meanwhile. (The probe's fence alone did not:
/// the write was already past the high-water mark, where fences fold.)
#[test]
fn a_probe_during_a_g3_preparation_ends_the_write() {
    let (mut sim, incarnation, g3) = preparing_source(false);
    let source = &mut sim.sources[0].core;
    // Past its deadline the target probes the op, then frees its grants
    // when the answer is terminal.
    source.handle_message(
        10,
        from(
            1,
            11,
            Body::WriteProbe {
                op_handle: OpHandle(1),
                source_incarnation: Some(incarnation),
            },
        ),
    );
    let terminal = sent(source)
        .iter()
        .any(|(_, body)| matches!(body, Body::WriteProbeAck { terminal: true, .. }));
    let (put, failed) = finish_g3_jobs(source, 20, g3);
    assert!(
        terminal,
        "nothing was put yet: the probe's answer is terminal"
    );
    assert!(!put, "a probed write is never put");
    assert!(failed, "the write ends with a terminal failure");
    source.check_invariants().unwrap();
}

/// A write whose preparation outlives its deadline (its fill reports after
/// it) is refused, not put, when the fill ends: the target gave up at that
/// deadline, and a put then would be born expired.
#[test]
fn a_g3_preparation_past_its_deadline_refuses_the_write() {
    // Spilling ahead, the pool's next victim is in G3 already: dropping it
    // makes room at once, and the fill is the preparation's own job.
    let (mut sim, _, g3) = preparing_source(true);
    let source = &mut sim.sources[0].core;
    assert_eq!(g3.len(), 1, "one job: the fill");
    for now in [TIMEOUT / 2, TIMEOUT] {
        source.handle_tick(now);
        source.handle_timeout(now);
    }
    let (put, failed) = finish_g3_jobs(source, TIMEOUT + 10, g3);
    assert!(!put, "an expired write is never put");
    assert!(failed, "the write ends with a terminal failure");
    source.check_invariants().unwrap();
}

// ------------------------------------------ guard-confirmed death reports

/// The source's incarnations in the death-report tests (a target's are 1
/// and 2, and the hostile member's 0xbad).
const OLD: u128 = 0x50;
const NEW: u128 = 0x51;

fn ack() -> Body {
    Body::TargetMetadataAck {
        op_handle: None,
        one_copy: false,
    }
}

fn probe_ack(op: OpHandle, dead: Option<u128>) -> Body {
    Body::WriteProbeAck {
        op_handle: op,
        terminal: true,
        dead_incarnation: dead.map(|i| Incarnation::from_raw(i).unwrap()),
    }
}

/// Target `core` fetches `key` from the source at port 2 under a fresh
/// hinted request. Returns the `start_write`s it sent: op, the incarnation
/// named, the slot granted.
fn fetch_from_port_2(
    core: &mut Core,
    ns: NamespaceId,
    now: u64,
    key: u64,
) -> Vec<(OpHandle, Option<Incarnation>, u64)> {
    let request = RequestId(format!("k{key}@{now}"));
    let hint = FetchHint {
        source: endpoint(2),
        block_hashes: vec![BlockKey::from_u64(key)],
        mode: FetchMode::Copy,
        action_id: None,
    };
    core.submit_hint(now, request.clone(), &hint);
    core.fetch(now, &[scoped(ns, key)], &[PoolId(0)], Some(&request))
        .unwrap();
    starts(&sent(core))
}

fn starts(sent: &[(ControlEndpoint, Body)]) -> Vec<(OpHandle, Option<Incarnation>, u64)> {
    sent.iter()
        .filter_map(|(_, body)| match body {
            Body::StartWrite {
                op_handle,
                source_incarnation,
                destinations,
                ..
            } => Some((*op_handle, *source_incarnation, destinations[0][0].index)),
            _ => None,
        })
        .collect()
}

/// The probes in `sent`: op and the incarnation each names.
fn probes(sent: &[(ControlEndpoint, Body)]) -> Vec<(OpHandle, Option<Incarnation>)> {
    sent.iter()
        .filter_map(|(_, body)| match body {
            Body::WriteProbe {
                op_handle,
                source_incarnation,
            } => Some((*op_handle, *source_incarnation)),
            _ => None,
        })
        .collect()
}

fn turn(core: &mut Core, now: u64) -> Vec<(ControlEndpoint, Body)> {
    core.handle_tick(now);
    core.handle_timeout(now);
    sent(core)
}

/// A target (port 1) holding, for the source at port 2: ops `a` and `b`
/// sent to incarnation `OLD` and quarantined (no answer by the abandonment
/// deadline), op `c` sent to `OLD` later and past its deadline (probed,
/// waiting for proof), and op `d` sent to `NEW`, which took the address
/// and acknowledged the metadata afresh. Returns the core, the four ops
/// with their slots, and what the target sent on `NEW`'s ack.
#[allow(clippy::type_complexity)]
fn target_with_old_ops() -> (Core, [(OpHandle, u64); 4], Vec<(ControlEndpoint, Body)>) {
    let (mut target, ns) = new_core(TARGET_POOL, 1, 1);
    let old = Some(Incarnation::from_raw(OLD).unwrap());
    target.handle_tick(0);
    // The first write waits for the ack.
    assert!(fetch_from_port_2(&mut target, ns, 0, 2).is_empty());
    target.handle_message(0, from(2, OLD, ack()));
    let [(a, _, slot_a)] = starts(&sent(&mut target))[..] else {
        panic!("one start_write")
    };
    let [(b, _, slot_b)] = fetch_from_port_2(&mut target, ns, 0, 3)[..] else {
        panic!("one start_write")
    };
    // Probe #1 at the op deadline, probe #2 and quarantine at abandonment.
    let quarter = TIMEOUT / 4;
    for step in 1..=12 {
        turn(&mut target, step * quarter);
    }
    let now = 3 * TIMEOUT;
    assert_eq!(
        target.take_notices(),
        vec![
            crate::PeerNotice::Uncertain { op: a },
            crate::PeerNotice::Uncertain { op: b }
        ]
    );
    // `OLD` again (the expiry invalidated the ack): c goes out to it.
    fetch_from_port_2(&mut target, ns, now, 4);
    target.handle_message(now, from(2, OLD, ack()));
    let [(c, named, slot_c)] = starts(&sent(&mut target))[..] else {
        panic!("one start_write")
    };
    assert_eq!(named, old);
    for step in 1..=5 {
        turn(&mut target, now + step * quarter);
    }
    let now = now + 5 * quarter;
    // `NEW` takes the address; the target's session to it broke.
    target.peer_connection_lost(&endpoint(2));
    fetch_from_port_2(&mut target, ns, now, 5);
    target.handle_message(now, from(2, NEW, ack()));
    let on_ack = sent(&mut target);
    let [(d, named, slot_d)] = starts(&on_ack)[..] else {
        panic!("one start_write")
    };
    assert_eq!(named, Some(Incarnation::from_raw(NEW).unwrap()));
    for slot in [slot_a, slot_b, slot_c, slot_d] {
        assert!(!target.slot_is_free(PoolId(0), slot as u32));
    }
    assert_eq!(target.peer_busy().0, 4);
    (
        target,
        [(a, slot_a), (b, slot_b), (c, slot_c), (d, slot_d)],
        on_ack,
    )
}

/// A fresh ack from the process now at the endpoint probes the quarantined
/// ops again, each naming the incarnation it was sent to; a duplicate of
/// that ack does not.
#[test]
fn a_fresh_ack_probes_the_quarantined_ops_again() {
    let (mut target, [(a, _), (b, _), ..], on_ack) = target_with_old_ops();
    let old = Some(Incarnation::from_raw(OLD).unwrap());
    assert_eq!(probes(&on_ack), vec![(a, old), (b, old)]);
    target.handle_message(0, from(2, NEW, ack()));
    assert!(probes(&sent(&mut target)).is_empty(), "a duplicate ack");
    assert_eq!(
        target.peer_counters().reprobes,
        2 + 2,
        "on OLD's ack, NEW's"
    );
}

/// A death report for one op, from the op's own endpoint, naming the
/// incarnation it was sent to, frees that op and every other op sent to
/// that incarnation (quarantined ones with their quiesced notice); an op of
/// another incarnation is untouched.
#[test]
fn a_death_report_frees_every_op_of_that_incarnation() {
    let (mut target, [(a, slot_a), (b, slot_b), (c, slot_c), (d, slot_d)], _) =
        target_with_old_ops();
    let now = 5 * TIMEOUT;
    target.handle_message(now, from(2, NEW, probe_ack(a, Some(OLD))));
    for slot in [slot_a, slot_b, slot_c] {
        assert!(target.slot_is_free(PoolId(0), slot as u32), "slot {slot}");
    }
    assert!(!target.slot_is_free(PoolId(0), slot_d as u32), "NEW's op");
    assert_eq!(target.peer_busy().0, 1);
    assert_eq!(
        target.take_notices(),
        vec![
            crate::PeerNotice::Quiesced { op: a },
            crate::PeerNotice::Quiesced { op: b }
        ],
        "c was never quarantined"
    );
    let counters = target.peer_counters();
    assert_eq!((counters.dead_freed, counters.dead_ignored), (3, 0));
    target.check_invariants().unwrap();
    let _ = (c, d);
}

/// A death report is believed only from the op's own endpoint, naming the
/// op's incarnation, from another process than that one, about an op that
/// was probed: otherwise nothing is freed, and it is counted.
#[test]
fn a_death_report_from_elsewhere_or_about_another_incarnation_frees_nothing() {
    let (mut target, [(a, slot_a), (b, _), (c, _), (d, slot_d)], _) = target_with_old_ops();
    let now = 5 * TIMEOUT;
    let ignored = [
        from(9, NEW, probe_ack(a, Some(OLD))),  // another endpoint
        from(9, OLD, probe_ack(c, Some(OLD))),  // another endpoint
        from(2, NEW, probe_ack(a, Some(0x77))), // not the op's incarnation
        from(2, NEW, probe_ack(b, Some(NEW))),  // not the op's incarnation
        from(2, OLD, probe_ack(a, Some(OLD))),  // the process itself
        from(2, OLD, probe_ack(d, Some(NEW))),  // d was never probed
    ];
    let n = ignored.len() as u64;
    for message in ignored {
        target.handle_message(now, message);
    }
    // Terminal answers without a death report prove nothing from NEW.
    target.handle_message(now, from(2, NEW, probe_ack(a, None)));
    assert_eq!(target.peer_busy().0, 4, "nothing freed");
    assert!(!target.slot_is_free(PoolId(0), slot_a as u32));
    assert!(target.take_notices().is_empty());
    let counters = target.peer_counters();
    assert_eq!((counters.dead_freed, counters.dead_ignored), (0, n));
    // The op's own incarnation's terminal answer is proof (as always).
    target.handle_message(now, from(2, OLD, probe_ack(a, None)));
    assert!(target.slot_is_free(PoolId(0), slot_a as u32));
    assert!(!target.slot_is_free(PoolId(0), slot_d as u32));
    target.check_invariants().unwrap();
}

/// More quarantined ops than one ack probes again: each ack takes the next
/// ones, oldest first, so all get their turn.
#[test]
fn reprobes_are_capped_per_ack_and_take_turns() {
    let (mut target, ns) = new_core_with(TARGET_POOL, 1, 1, Tiers::with_g3(200, 8, false), |_| {});
    target.handle_tick(0);
    fetch_from_port_2(&mut target, ns, 0, 0);
    target.handle_message(0, from(2, OLD, ack()));
    let total = MAX_REPROBES_PER_ACK + 36;
    let mut ops: Vec<OpHandle> = starts(&sent(&mut target)).iter().map(|s| s.0).collect();
    for key in 1..total as u64 {
        ops.extend(
            fetch_from_port_2(&mut target, ns, 0, key)
                .iter()
                .map(|s| s.0),
        );
    }
    assert_eq!(ops.len(), total);
    for step in 1..=12 {
        turn(&mut target, step * TIMEOUT / 4);
    }
    let mut probed = Vec::new();
    for round in 0..3u128 {
        target.peer_connection_lost(&endpoint(2));
        target.handle_message(3 * TIMEOUT, from(2, NEW + round, ack()));
        let sent = probes(&sent(&mut target));
        assert_eq!(sent.len(), MAX_REPROBES_PER_ACK, "round {round}");
        probed.extend(sent.into_iter().map(|p| p.0));
    }
    let expected: Vec<OpHandle> = ops.iter().chain(&ops).take(probed.len()).copied().collect();
    assert_eq!(probed, expected, "oldest first, in turn, wrapping");
}

/// A source that the guard told of its address's dead incarnations answers
/// a probe naming one with a death report; without the list, or for an
/// incarnation not on it, it answers as before (non-terminal for another
/// incarnation); its own incarnation is never reported dead.
#[test]
fn a_source_reports_only_the_incarnations_its_guard_confirmed_dead() {
    let (mut sim, own) = stocked_source(|_| {});
    let source = &mut sim.sources[0].core;
    source.handle_message(0, from(1, 11, metadata(1)));
    sent(source);
    let probe = |op: u64, incarnation: u128| {
        from(
            1,
            11,
            Body::WriteProbe {
                op_handle: OpHandle(op),
                source_incarnation: Some(Incarnation::from_raw(incarnation).unwrap()),
            },
        )
    };
    let answers = |source: &mut Core| -> Vec<(bool, Option<Incarnation>)> {
        sent(source)
            .into_iter()
            .filter_map(|(_, body)| match body {
                Body::WriteProbeAck {
                    terminal,
                    dead_incarnation,
                    ..
                } => Some((terminal, dead_incarnation)),
                _ => None,
            })
            .collect()
    };
    let old = Incarnation::from_raw(OLD).unwrap();
    source.handle_message(0, probe(1, OLD));
    assert_eq!(answers(source), vec![(false, None)], "not known dead");
    source.set_dead_incarnations(vec![old, own]);
    assert_eq!(source.dead_incarnations(), &[old], "never itself");
    source.handle_message(0, probe(2, OLD));
    source.handle_message(0, probe(3, 0x77));
    source.handle_message(0, probe(4, own.raw()));
    assert_eq!(
        answers(source),
        vec![(true, Some(old)), (false, None), (true, None)],
        "dead; unknown; its own, with nothing in flight"
    );
    assert_eq!(source.peer_counters().dead_reported, 1);
    // Bounded: the latest ones are kept.
    let many: Vec<Incarnation> = (1..=100u128)
        .map(|i| Incarnation::from_raw(0x1000 + i).unwrap())
        .collect();
    source.set_dead_incarnations(many.clone());
    assert_eq!(
        source.dead_incarnations(),
        &many[100 - MAX_DEAD_INCARNATIONS..]
    );
}

/// Delivers every message on `sim`'s network (and those they cause) at
/// `now`, in order, without landing puts; returns the probe answers the
/// target got.
fn pump(sim: &mut Sim, now: u64) -> Vec<Body> {
    let mut answers = Vec::new();
    for _ in 0..100 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if to == endpoint(TARGET_PORTS[0]) && matches!(message.body, Body::WriteProbeAck { .. }) {
            answers.push(message.body.clone());
        }
        sim.handle(&to, now, message);
        sim.flush();
    }
    assert!(sim.network.is_empty());
    answers
}

/// Target 0 fetches key 0 from source 0, whose put into the granted slot is
/// in flight when the source stops answering: the op is quarantined. Then
/// the source crashes (`guarded`: the guard confirms it) and restarts, and
/// the target fetches from the address again. Returns the quarantined op,
/// its slot and the probe answers the target got from the new process.
fn quarantined_then_restart(seed: u64, guarded: bool) -> (Sim, OpHandle, u64, Vec<Body>) {
    let mut sim = Sim::new(seed);
    sim.quiet();
    hinted_request(&mut sim, 0, 0, 0..1, false);
    sim.flush();
    pump(&mut sim, 0);
    assert!(!sim.puts.is_empty(), "the put is under way");
    let [(&op, grants)] = sim.targets[0].grants.iter().collect::<Vec<_>>()[..] else {
        panic!("one op")
    };
    let slot = grants[0].1;
    // The source answers nothing any more: probes #1 and #2 go unanswered.
    for now in [TIMEOUT, 3 * TIMEOUT] {
        sim.targets[0].core.handle_tick(now);
        sim.targets[0].core.handle_timeout(now);
        sim.flush();
        sim.network.clear();
    }
    assert_eq!(sim.targets[0].core.peer_counters().quarantined, 1);
    sim.now = 3 * TIMEOUT;
    if guarded {
        sim.restart_source_guarded(0);
    } else {
        sim.restart_source(0);
    }
    sim.targets[0]
        .core
        .peer_connection_lost(&sim.sources[0].endpoint);
    sim.targets[0].core.take_notices();
    hinted_request(&mut sim, 0, 0, 1..2, false);
    sim.flush();
    let now = sim.now;
    let answers = pump(&mut sim, now);
    sim.check().unwrap();
    (sim, op, slot, answers)
}

/// A source restarted without the guard's confirmation answers the
/// re-probe non-terminal: the slot stays held, and the old process's late
/// put lands in it harmlessly.
#[test]
fn a_restart_the_guard_did_not_confirm_keeps_the_slots() {
    for seed in [21, 22, 23] {
        let (mut sim, _, slot, answers) = quarantined_then_restart(seed, false);
        assert!(
            answers.iter().all(|a| matches!(
                a,
                Body::WriteProbeAck {
                    terminal: false,
                    dead_incarnation: None,
                    ..
                }
            )) && !answers.is_empty(),
            "{answers:?}"
        );
        assert!(!sim.targets[0].core.slot_is_free(PoolId(0), slot as u32));
        assert!(sim.targets[0].core.take_notices().is_empty());
        let old = source_incarnation(seed, 0, 0);
        assert!(
            sim.puts
                .iter()
                .any(|p| p.incarnation == old && p.target == 0 && p.slot == slot),
            "the old process's put may still land"
        );
        sim.advance_to(10 * TIMEOUT);
        sim.check().unwrap();
        assert!(!sim.targets[0].core.slot_is_free(PoolId(0), slot as u32));
        assert_eq!(sim.targets[0].core.peer_counters().dead_freed, 0);
    }
}

/// After a guard-confirmed crash the restarted source reports the old
/// incarnation dead when the target probes its quarantined op again (on
/// the new process's ack), and the slot is freed with a quiesced notice.
#[test]
fn a_guard_confirmed_death_frees_the_quarantined_slots() {
    for seed in [21, 22, 23] {
        let (mut sim, op, slot, answers) = quarantined_then_restart(seed, true);
        let old = source_incarnation(seed, 0, 0);
        assert!(
            sim.puts.iter().all(|p| p.incarnation != old),
            "resolved at the crash"
        );
        assert!(
            answers.iter().any(|a| matches!(
                a,
                Body::WriteProbeAck {
                    terminal: true,
                    dead_incarnation: Some(i),
                    ..
                } if i.raw() == old
            )),
            "{answers:?}"
        );
        assert!(sim.targets[0].core.slot_is_free(PoolId(0), slot as u32));
        // The simulator took the notice: one quarantined op quiesced.
        assert_eq!(sim.seen.dead_freed_quarantined, 1, "op {op:?}");
        assert_eq!(sim.targets[0].core.peer_counters().dead_freed, 1);
        sim.settle().unwrap();
    }
}

// ------------------------------------------------------------ the journal

/// A target's journal names the slots it granted to a source's write
/// (`Held`) before the grant goes out; a target that dies then and is
/// recovered keeps those slots out of use (the source may still write
/// them), and a write that ends frees them (`Freed`) before its page is
/// journaled READY.
#[test]
fn granted_slots_are_journaled_held_and_kept_out_of_use_after_a_crash() {
    use crate::journal::{JournalWriter, recover};
    let mut sim = Sim::new(17);
    sim.quiet();
    sim.targets[0].core.enable_journal();
    let mut region = vec![0u8; 64 << 10];
    let mut writer = JournalWriter::format(&mut region).unwrap();
    let mut journal = |core: &mut Core, region: &mut Vec<u8>| {
        let records = core.take_journal();
        for record in &records {
            writer.append(region, record).unwrap();
        }
        records
    };
    let keys = vec![sim.key(0), sim.key(1)];
    let request = RequestId("held".into());
    let hint = FetchHint {
        source: endpoint(SOURCE_PORTS[0]),
        block_hashes: keys.iter().map(|k| k.key).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    sim.targets[0].core.submit_hint(0, request.clone(), &hint);
    sim.targets[0]
        .core
        .fetch(0, &keys, &[PoolId(0)], Some(&request))
        .unwrap();
    journal(&mut sim.targets[0].core, &mut region);
    sim.flush();
    // Deliver until the start_write is on the wire (the source never reads it).
    let mut granted = false;
    for _ in 0..32 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if matches!(message.body, Body::StartWrite { .. }) {
            granted = true;
            break;
        }
        sim.handle(&to, 0, message);
        // The pump journals before it sends anything.
        journal(&mut sim.targets[0].core, &mut region);
        sim.flush();
    }
    assert!(granted, "the target asked the source to write");
    let recovered = recover(&region).unwrap();
    assert_eq!(recovered.held.len(), 2, "{recovered:?}");
    assert!(recovered.pages.is_empty());

    // The target dies; a fresh one takes the journal.
    let (mut fresh, _) = new_core(TARGET_POOL, TARGET_PORTS[0], 0xdead);
    let (report, _) = fresh.recover(0, &recovered);
    assert_eq!(report.held_slots, 2);
    assert_eq!(fresh.recovered_held_slots(), 2);
    fresh.check_invariants().unwrap();
    // Every slot but the held ones can be filled; the held ones never are.
    let free = u64::from(SLOTS) - 2;
    let region = fresh
        .register_region(RegionDesc {
            label: "kv".into(),
            base: SOURCE_HOST,
            size: BLOCK,
            stride: 0,
            count: u64::from(SLOTS),
        })
        .unwrap();
    let entries = (0..u64::from(SLOTS))
        .map(|k| DepositEntry {
            key: ScopedKey {
                namespace: keys[0].namespace,
                key: BlockKey::from_u64(100 + k),
            },
            spans: vec![ElementRef { region, index: k }],
            page: None,
        })
        .collect();
    fresh.deposit(0, entries, true).unwrap();
    while let Some(action) = fresh.poll_action() {
        if let Action::Copy { job, keys, .. } = action {
            fresh.handle_copy_done(0, job, &vec![CopyOutcome::Copied; keys.len()]);
        }
    }
    let used: HashSet<u32> = fresh.ready_pages().into_values().flatten().collect();
    assert_eq!(used.len() as u64, free, "every free slot, no held one");
    assert!(recovered.held.iter().all(|s| !used.contains(s)));
    fresh.check_invariants().unwrap();
}
