//! The reference in-memory linker runs the conformance suite, one test per
//! check (`conformance::round_trip_moves_bytes_exactly`, ...), generated from
//! the suite's own list so no check can be left out.

use kvcr_linker_contracts::conformance::ReferenceFixture;

kvcr_linker_contracts::conformance_suite!(ReferenceFixture, |check| {
    check(&ReferenceFixture::new)
});
