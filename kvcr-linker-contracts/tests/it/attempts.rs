//! Attempt ownership across request-id reuse.

use kvcr_contracts::{AttemptId, RequestId};
use kvcr_linker_contracts::{AttemptTable, ClaimId, Error};
use rstest::rstest;

fn attempt(request: &str, generation: u64) -> AttemptId {
    AttemptId {
        request: RequestId(request.into()),
        generation,
    }
}

fn claims(ids: &[u64]) -> Vec<ClaimId> {
    ids.iter().copied().map(ClaimId).collect()
}

/// Case 31: the second attempt supersedes the first at once; the first's
/// claims come back; the second starts clean and is live immediately.
#[test]
fn second_attempt_supersedes_and_never_blocks() {
    let mut table = AttemptTable::new();
    let first = attempt("r", 1);
    table.begin(&first).unwrap();
    let fetch = table.accept(&first, vec![]).unwrap();
    table.land(fetch, claims(&[1, 2])).unwrap();
    let second = attempt("r", 2);
    let superseded = table.begin(&second).unwrap().unwrap();
    assert_eq!(superseded.attempt, first);
    assert_eq!(superseded.released, claims(&[1, 2]));
    assert!(table.is_live(&second));
    assert!(!table.is_live(&first));
    assert_eq!(table.claims_held(), 0);
    assert!(matches!(
        table.check_live(&first),
        Err(Error::Superseded {
            current_generation: 2,
            ..
        })
    ));
}

/// Case 41: the first attempt's transfer lands after the second began; its
/// claims are released and never reach the second attempt.
#[test]
fn late_landing_never_reaches_the_new_attempt() {
    let mut table = AttemptTable::new();
    let first = attempt("r", 1);
    table.begin(&first).unwrap();
    let late = table.accept(&first, vec![]).unwrap();
    let second = attempt("r", 2);
    table.begin(&second).unwrap();
    let landing = table.land(late, claims(&[5])).unwrap();
    assert_eq!(landing.attempt, first);
    assert!(landing.kept.is_empty());
    assert_eq!(landing.release, claims(&[5]));
    assert!(table.claims_of(&second).is_empty());
}

/// Hooks: ending an attempt keeps its accepted transfers in flight; a load's
/// carried claims stay held until it lands, then are released.
#[test]
fn ending_keeps_accepted_transfers_in_flight() {
    let mut table = AttemptTable::new();
    let a = attempt("r", 1);
    table.begin(&a).unwrap();
    let fetch = table.accept(&a, vec![]).unwrap();
    table.land(fetch, claims(&[1, 2, 3])).unwrap();
    let load = table.accept(&a, claims(&[1, 2])).unwrap();
    assert_eq!(table.end(&a).unwrap(), claims(&[3]));
    assert_eq!(table.in_flight_of(&a), 1);
    assert_eq!(table.claims_held(), 2, "the load still carries its pages");
    let landing = table.land(load, vec![]).unwrap();
    assert_eq!(landing.release, claims(&[1, 2]));
    assert_eq!(table.claims_held(), 0);
    assert_eq!(table.in_flight(), 0);
}

#[derive(Debug, Clone, Copy)]
enum Misuse {
    DoubleRelease,
    ReleaseUnheld,
    LandTwice,
    CarryUnheld,
    CarryTwice,
    OlderAttempt,
    EndStale,
    ResetInFlight,
}

/// Misuse is a typed error and leaves the table as it was.
#[rstest]
#[case::double_release(Misuse::DoubleRelease)]
#[case::release_unheld(Misuse::ReleaseUnheld)]
#[case::land_twice(Misuse::LandTwice)]
#[case::carry_unheld(Misuse::CarryUnheld)]
#[case::carry_same_claim_twice(Misuse::CarryTwice)]
#[case::older_attempt_starts(Misuse::OlderAttempt)]
#[case::end_stale_attempt(Misuse::EndStale)]
#[case::reset_with_transfer_in_flight(Misuse::ResetInFlight)]
fn misuse_is_a_typed_error_and_changes_nothing(#[case] misuse: Misuse) {
    let mut table = AttemptTable::new();
    let a = attempt("r", 3);
    table.begin(&a).unwrap();
    let fetch = table.accept(&a, vec![]).unwrap();
    table.land(fetch, claims(&[1, 2])).unwrap();
    let pending = table.accept(&a, vec![]).unwrap();
    let snapshot = |t: &AttemptTable| (t.claims_of(&a), t.in_flight(), t.live(), t.claims_held());
    let before = snapshot(&table);
    if matches!(misuse, Misuse::DoubleRelease) {
        table.release(&a, ClaimId(1)).unwrap();
    }
    let before = if matches!(misuse, Misuse::DoubleRelease) {
        snapshot(&table)
    } else {
        before
    };
    let error = match misuse {
        Misuse::DoubleRelease => table.release(&a, ClaimId(1)).unwrap_err(),
        Misuse::ReleaseUnheld => table.release(&a, ClaimId(9)).unwrap_err(),
        Misuse::LandTwice => table.land(fetch, claims(&[7])).unwrap_err(),
        Misuse::CarryUnheld => table.accept(&a, claims(&[1, 9])).unwrap_err(),
        Misuse::CarryTwice => table.accept(&a, claims(&[1, 1])).unwrap_err(),
        Misuse::OlderAttempt => table.begin(&attempt("r", 2)).unwrap_err(),
        Misuse::EndStale => table.end(&attempt("r", 2)).unwrap_err(),
        Misuse::ResetInFlight => table.reset().unwrap_err(),
    };
    let expected = match misuse {
        Misuse::DoubleRelease
        | Misuse::ReleaseUnheld
        | Misuse::CarryUnheld
        | Misuse::CarryTwice => {
            matches!(error, Error::ClaimNotHeld { .. })
        }
        Misuse::LandTwice => {
            matches!(error, Error::UnknownTransfer { transfer } if transfer == fetch)
        }
        Misuse::OlderAttempt => matches!(
            error,
            Error::AttemptOutOfOrder {
                current_generation: 3,
                ..
            }
        ),
        Misuse::EndStale => matches!(
            error,
            Error::Superseded {
                current_generation: 3,
                ..
            }
        ),
        Misuse::ResetInFlight => matches!(error, Error::TransfersInFlight { in_flight: 1 }),
    };
    assert!(expected, "{misuse:?}: unexpected {error:?}");
    assert_eq!(snapshot(&table), before, "{misuse:?} changed the table");
    table.land(pending, vec![]).unwrap();
}

/// A request id reused after its attempt ended starts fresh.
#[test]
fn request_id_reuse_after_end_starts_fresh() {
    let mut table = AttemptTable::new();
    let first = attempt("r", 1);
    table.begin(&first).unwrap();
    table.end(&first).unwrap();
    assert!(matches!(
        table.end(&first),
        Err(Error::NoLiveAttempt { .. })
    ));
    assert_eq!(table.begin(&attempt("r", 4)).unwrap(), None);
    assert_eq!(table.live(), 1);
}
