//! Public-contract tests of kvcr-linker-contracts (one integration binary).

// Test helpers outside `#[test]` functions panic on purpose: a failed helper is
// a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod attempts;
mod conformance;
mod hooks;
mod ledger;
mod prefix;
mod properties;
mod scenarios;

use std::num::NonZeroU32;

use kvcr_contracts::{
    BlockKey, CompatDigest, Incarnation, InventoryEvent, Namespace, NamespaceId, ScopedKey, Tier,
};
use kvcr_linker_contracts::{InventoryLedger, Offload, OffloadPage, OwnershipPolicy};

const BLOCK_SIZE: u32 = 4;

/// The base-model namespace of the fixtures.
fn base() -> Namespace {
    Namespace::base(CompatDigest(0xc0ffee))
}

/// The fixtures' namespace for LoRA adapter `name`.
fn lora(name: &str) -> Namespace {
    Namespace {
        lora_name: Some(name.to_owned()),
        ..base()
    }
}

fn incarnation(n: u128) -> Incarnation {
    Incarnation::from_raw(n).unwrap()
}

fn key(n: u64) -> BlockKey {
    BlockKey::from_u64(n)
}

fn scoped(namespace: &Namespace, n: u64) -> ScopedKey {
    ScopedKey {
        namespace: namespace.id(),
        key: key(n),
    }
}

/// Pages `keys` of one chain; page `k`'s tokens are `k*10 .. k*10+4`.
fn offload(namespace: &Namespace, tier: Tier, keys: &[u64], parent: Option<u64>) -> Offload {
    Offload {
        namespace: namespace.clone(),
        tier,
        parent: parent.map(key),
        block_size: BLOCK_SIZE,
        pages: keys
            .iter()
            .map(|&k| OffloadPage {
                key: key(k),
                token_ids: (0..BLOCK_SIZE)
                    .map(|t| (k as u32).wrapping_mul(10).wrapping_add(t))
                    .collect(),
            })
            .collect(),
    }
}

/// KVCR DRAM opted in; disk and external stay framework-owned.
fn dram_opted_in() -> OwnershipPolicy {
    OwnershipPolicy::framework_owned()
        .opt_in(Tier::KvcrDram)
        .unwrap()
}

fn ledger(ranks: u32) -> InventoryLedger {
    InventoryLedger::new(
        dram_opted_in(),
        NonZeroU32::new(ranks).unwrap(),
        incarnation(1),
    )
}

/// Offloads on every rank with success and returns the events.
fn agreed(ledger: &mut InventoryLedger, offload: Offload) -> Vec<InventoryEvent> {
    let id = ledger.begin_offload(offload).unwrap();
    let mut events = Vec::new();
    for rank in 0..2 {
        match ledger.rank_result(id, rank, true) {
            Ok(mut e) => events.append(&mut e),
            Err(kvcr_linker_contracts::Error::RankOutOfRange { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    events
}

fn namespace_label(id: NamespaceId) -> String {
    for (label, ns) in [
        ("base", base()),
        ("lora-a", lora("a")),
        ("lora-b", lora("b")),
    ] {
        if ns.id() == id {
            return label.to_owned();
        }
    }
    format!("{:016x}", id.0)
}

fn keys_text(keys: &[BlockKey]) -> String {
    let keys: Vec<String> = keys.iter().map(|k| k.as_u64().to_string()).collect();
    format!("[{}]", keys.join(","))
}

/// One line per event, stable for snapshots.
fn render(event: &InventoryEvent) -> String {
    match event {
        InventoryEvent::Stored {
            scope,
            keys,
            parent,
            token_ids,
            block_size,
            lora_name,
            ..
        } => format!(
            "stored    ownership={} ns={} medium={} lora={} parent={} keys={} tokens={:?} block_size={}",
            scope.owner.wire_ownership().unwrap_or("-"),
            namespace_label(scope.namespace),
            scope.medium.as_str(),
            lora_name.as_deref().unwrap_or("-"),
            parent.map_or("-".to_owned(), |p| p.as_u64().to_string()),
            keys_text(keys),
            token_ids,
            block_size,
        ),
        InventoryEvent::Removed { scope, keys } => format!(
            "removed   ownership={} ns={} medium={} keys={}",
            scope.owner.wire_ownership().unwrap_or("-"),
            namespace_label(scope.namespace),
            scope.medium.as_str(),
            keys_text(keys),
        ),
        InventoryEvent::AllCleared { owner, incarnation } => format!(
            "cleared   ownership={} incarnation={incarnation}",
            owner.wire_ownership().unwrap_or("-"),
        ),
    }
}

fn render_all(events: &[InventoryEvent]) -> Vec<String> {
    events.iter().map(render).collect()
}
