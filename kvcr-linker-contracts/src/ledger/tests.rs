//! Unit tests of `ledger` internals.

use super::*;

#[test]
fn removals_merge_only_within_one_scope() {
    let kvcr = scope(Owner::Kvcr, NamespaceId(1), Tier::KvcrDram);
    let framework = scope(Owner::Framework, NamespaceId(1), Tier::External);
    let mut events = Vec::new();
    push_removed(&mut events, kvcr, BlockKey::from_u64(1));
    push_removed(&mut events, kvcr, BlockKey::from_u64(2));
    push_removed(&mut events, framework, BlockKey::from_u64(3));
    push_removed(&mut events, kvcr, BlockKey::from_u64(4));
    let sizes: Vec<usize> = events
        .iter()
        .map(|e| match e {
            InventoryEvent::Removed { keys, .. } => keys.len(),
            _ => 0,
        })
        .collect();
    assert_eq!(sizes, vec![2, 1, 1]);
}
