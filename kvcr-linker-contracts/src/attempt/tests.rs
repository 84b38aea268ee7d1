//! Unit tests of `attempt` internals.

use super::*;

fn attempt(generation: u64) -> AttemptId {
    AttemptId {
        request: RequestId("r".into()),
        generation,
    }
}

#[test]
fn carried_claims_count_as_held_until_landing() {
    let mut table = AttemptTable::new();
    let a = attempt(1);
    table.begin(&a).unwrap();
    let fetch = table.accept(&a, vec![]).unwrap();
    table.land(fetch, vec![ClaimId(1), ClaimId(2)]).unwrap();
    let load = table.accept(&a, vec![ClaimId(1)]).unwrap();
    assert_eq!(table.claims_held(), 2);
    assert_eq!(table.claims_of(&a), vec![ClaimId(2)]);
    table.land(load, vec![]).unwrap();
    assert_eq!(table.claims_held(), 1);
}
