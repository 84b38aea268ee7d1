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
//! `KVCR_SIM_SEED=<n> cargo test -p kvcr-runner-core --lib sim::`.

mod checks;
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

use checks::*;
use faults::*;
use g3::*;
use memory::*;
use net::*;
use node::*;
use puts::*;
use world::*;

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
