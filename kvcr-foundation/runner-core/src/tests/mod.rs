//! Unit tests of the sans-I/O core (virtual time, simulated copy outcomes):
//! the shared fixtures here, the model-based property tests in `model`, the
//! sharing, abort and pinning cases in `scenarios`, the G3 moves in `g3`,
//! page digests in the index in `digests`.

use std::collections::{BTreeMap, HashMap, HashSet};

use proptest::prelude::*;

use crate::machine::{Action, CopyOutcome, Core, CoreConfig, G3Config, JobId};
use crate::policy::{Fifo, G3Fifo, G3Lru, Lru};
use crate::*;
use kvcr_contracts::key::{BlockKey, CompatDigest, Namespace, NamespaceId, ScopedKey};
use kvcr_contracts::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_contracts::tier::{InventoryEvent, Medium, Tier};

mod digests;
mod g3;
mod model;
mod scenarios;

const BLOCK: u64 = 64;
const FRAMEWORK_BASE: u64 = 0x1000_0000;
const POOL_BASE: u64 = 0x2000_0000;

fn core(slots: u32, lru: bool, timeout_ns: u64) -> (Core, NamespaceId, RegionId) {
    core_with_g3(slots, lru, timeout_ns, None)
}

/// A core whose policy moves victims to a G3 of `g3_slots` slots (when set).
fn core_with_g3(
    slots: u32,
    lru: bool,
    timeout_ns: u64,
    g3_slots: Option<u32>,
) -> (Core, NamespaceId, RegionId) {
    core_with_g3_ahead(slots, lru, timeout_ns, g3_slots, false)
}

/// As [`core_with_g3`], spilling ahead when `ahead`.
fn core_with_g3_ahead(
    slots: u32,
    lru: bool,
    timeout_ns: u64,
    g3_slots: Option<u32>,
    ahead: bool,
) -> (Core, NamespaceId, RegionId) {
    let config = CoreConfig {
        pools: vec![("kv".into(), BLOCK, slots)],
        pool_bases: vec![POOL_BASE],
        operation_timeout_ns: timeout_ns,
        watermark_percent: 25,
        medium: kvcr_contracts::tier::Medium::CpuPinned,
        g3: g3_slots.map(|slots| G3Config {
            slots,
            slot_bytes: BLOCK,
            alignment: BLOCK,
            spill_ahead: ahead,
        }),
    };
    let policy: Box<dyn CachePolicy> = match (lru, g3_slots.is_some()) {
        (true, false) => Box::new(Lru),
        (false, false) => Box::new(Fifo),
        (true, true) => Box::new(G3Lru),
        (false, true) => Box::new(G3Fifo),
    };
    let mut core = Core::new(&config, policy).unwrap();
    let ns = core.register_namespace(Namespace::base(CompatDigest(1)));
    // The framework region is never dereferenced here: the core only computes
    // addresses, and these tests simulate the copies.
    let region = core
        .register_region(RegionDesc {
            label: "kv".into(),
            base: FRAMEWORK_BASE,
            size: BLOCK,
            stride: 0,
            count: 64,
        })
        .unwrap();
    (core, ns, region)
}

/// Element `index` of region `region`.
pub(crate) fn element(region: u32, index: u64) -> ElementRef {
    ElementRef {
        region: RegionId(region),
        index,
    }
}

fn key(ns: NamespaceId, k: u8) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(u64::from(k)),
    }
}

/// The lifecycle check aborts on an illegal transition (debug builds).
#[test]
#[should_panic(expected = "illegal residency transition")]
fn lifecycle_check_catches_illegal_transition() {
    let (mut core, ns, region) = core(4, true, 1_000);
    core.deposit(
        0,
        vec![DepositEntry {
            key: key(ns, 1),
            spans: vec![ElementRef { region, index: 0 }],
            page: None,
        }],
        false,
    )
    .unwrap();
    // FILLING -> FILLING is not a transition the core ever makes.
    core.force_transition_for_test(&key(ns, 1));
}
