//! Owners, tiers, media and inventory merging rules.

use kvcr_contracts::{
    BlockKey, Incarnation, InventoryEvent, InventoryScope, Medium, NamespaceId, Owner, Tier,
};
use rstest::rstest;

#[rstest]
#[case::gpu(Medium::Gpu, "GPU")]
#[case::cpu(Medium::Cpu, "CPU")]
#[case::pinned(Medium::CpuPinned, "CPU_PINNED")]
#[case::disk(Medium::Disk, "DISK")]
#[case::external(Medium::External, "EXTERNAL")]
fn medium_wire_names(#[case] medium: Medium, #[case] wire: &str) {
    assert_eq!(medium.as_str(), wire);
    assert_eq!(Medium::from_wire(wire), Some(medium));
    assert_eq!(
        serde_json::to_string(&medium).unwrap(),
        format!("\"{wire}\"")
    );
}

/// Consumer-side aliases map the way Dynamo maps them; unknown strings give None.
#[rstest]
#[case("DEVICE", Some(Medium::Gpu))]
#[case("CPU", Some(Medium::Cpu))]
#[case("CPU_TIER1", Some(Medium::CpuPinned))]
#[case("CPU_TIER2", Some(Medium::Disk))]
#[case("NVME", Some(Medium::Disk))]
#[case("NETWORK", Some(Medium::External))]
#[case("SHARED", Some(Medium::External))]
#[case("gpu", None)]
#[case("", None)]
fn medium_aliases(#[case] wire: &str, #[case] expected: Option<Medium>) {
    assert_eq!(Medium::from_wire(wire), expected);
}

#[test]
fn ownership_field() {
    assert_eq!(Owner::Framework.wire_ownership(), None);
    assert_eq!(Owner::Kvcr.wire_ownership(), Some("kvcr"));
    assert_eq!(Tier::KvcrDram.default_medium(), Medium::CpuPinned);
    assert_eq!(Tier::Gpu.default_medium(), Medium::Gpu);
}

fn scope(owner: Owner, ns: u64, medium: Medium) -> InventoryScope {
    InventoryScope {
        owner,
        namespace: NamespaceId(ns),
        medium,
    }
}

fn stored(scope: InventoryScope, keys: &[u64], parent: Option<u64>) -> InventoryEvent {
    InventoryEvent::Stored {
        scope,
        keys: keys.iter().copied().map(BlockKey::from_u64).collect(),
        parent: parent.map(BlockKey::from_u64),
        token_ids: vec![0; keys.len() * 4],
        block_size: 4,
        lora_name: None,
        lora_id: None,
        cache_salt: None,
    }
}

/// Invariant 5: events of different owners, namespaces or media never merge;
/// stores merge only when the chain continues.
#[rstest]
#[case::same_chain(scope(Owner::Kvcr, 1, Medium::CpuPinned), Some(2), true)]
#[case::chain_broken(scope(Owner::Kvcr, 1, Medium::CpuPinned), Some(9), false)]
#[case::other_owner(scope(Owner::Framework, 1, Medium::CpuPinned), Some(2), false)]
#[case::other_namespace(scope(Owner::Kvcr, 2, Medium::CpuPinned), Some(2), false)]
#[case::other_medium(scope(Owner::Kvcr, 1, Medium::External), Some(2), false)]
fn store_merging(
    #[case] next_scope: InventoryScope,
    #[case] parent: Option<u64>,
    #[case] merges: bool,
) {
    let first = stored(scope(Owner::Kvcr, 1, Medium::CpuPinned), &[1, 2], None);
    let next = stored(next_scope, &[3], parent);
    assert_eq!(first.can_merge(&next), merges);
}

#[test]
fn clears_and_mixed_kinds_never_merge() {
    let inc = Incarnation::generate();
    let clear = InventoryEvent::AllCleared {
        owner: Owner::Kvcr,
        incarnation: inc,
    };
    assert!(!clear.can_merge(&clear.clone()));
    let removed = InventoryEvent::Removed {
        scope: scope(Owner::Kvcr, 1, Medium::CpuPinned),
        keys: vec![BlockKey::from_u64(1)],
    };
    let removed_other = InventoryEvent::Removed {
        scope: scope(Owner::Framework, 1, Medium::CpuPinned),
        keys: vec![BlockKey::from_u64(1)],
    };
    assert!(removed.can_merge(&removed.clone()));
    assert!(!removed.can_merge(&removed_other));
    assert!(!removed.can_merge(&clear));
    let store = stored(scope(Owner::Kvcr, 1, Medium::CpuPinned), &[1], None);
    assert!(!store.can_merge(&removed));
}
