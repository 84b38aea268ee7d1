//! The linker conformance suite against the direct linker: one test per
//! check, with the KV pool in host memory (everywhere) and on a GPU (with
//! `KVCR_TEST_GPU=1`); the table names every check the suite has.

use kvcr_linker_contracts::conformance::{self, Check};
use rstest::rstest;

use crate::fixture::{Fixture, cuda_fixture, gpu_required, host_fixture};

#[rstest]
#[case::round_trip_moves_bytes_exactly(conformance::round_trip_moves_bytes_exactly)]
#[case::never_offloaded_page_is_a_miss(conformance::never_offloaded_page_is_a_miss)]
#[case::second_attempt_supersedes_first(conformance::second_attempt_supersedes_first)]
#[case::late_fetch_of_superseded_attempt_is_released(
    conformance::late_fetch_of_superseded_attempt_is_released
)]
#[case::finish_drops_every_claim(conformance::finish_drops_every_claim)]
#[case::abort_drops_every_claim(conformance::abort_drops_every_claim)]
#[case::ending_never_revokes_accepted_fetch(conformance::ending_never_revokes_accepted_fetch)]
#[case::ending_never_revokes_accepted_load(conformance::ending_never_revokes_accepted_load)]
#[case::device_prefix_growth_shifts_preparation(
    conformance::device_prefix_growth_shifts_preparation
)]
#[case::device_prefix_shrink_retires_preparation(
    conformance::device_prefix_shrink_retires_preparation
)]
#[case::load_without_claim_is_refused(conformance::load_without_claim_is_refused)]
#[case::duplicate_load_is_refused(conformance::duplicate_load_is_refused)]
#[case::reset_refused_while_transfers_in_flight(
    conformance::reset_refused_while_transfers_in_flight
)]
#[case::reset_forgets_store_and_reoffload_round_trips(
    conformance::reset_forgets_store_and_reoffload_round_trips
)]
#[case::stale_and_unknown_attempts_are_typed_errors(
    conformance::stale_and_unknown_attempts_are_typed_errors
)]
#[case::offload_outcomes_in_submission_order(conformance::offload_outcomes_in_submission_order)]
#[case::claimed_page_is_never_evicted(conformance::claimed_page_is_never_evicted)]
#[case::bad_device_slot_is_refused(conformance::bad_device_slot_is_refused)]
fn direct_linker_conforms(#[case] check: Check<Fixture>) {
    check(&host_fixture);
    if gpu_required() {
        check(&cuda_fixture);
    }
}

/// The table above must name every check, so a new check cannot be skipped
/// silently.
#[test]
fn conformance_table_covers_every_check() {
    let table = include_str!("conformance.rs");
    let missing: Vec<&str> = conformance::cases::<Fixture>()
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !table.contains(&format!("#[case::{name}(")))
        .collect();
    assert!(
        missing.is_empty(),
        "checks missing from the table: {missing:?}"
    );
}
