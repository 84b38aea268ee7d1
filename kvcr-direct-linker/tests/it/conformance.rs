//! The linker conformance suite against the direct linker: one test per
//! check (`conformance::round_trip_moves_bytes_exactly`, ...), generated from
//! the suite's own list so no check can be left out, with the KV pool in host
//! memory (everywhere) and on a GPU (with `KVCR_TEST_GPU=1`).

use crate::fixture::{Fixture, cuda_fixture, gpu_required, host_fixture};

kvcr_linker_contracts::conformance_suite!(Fixture, |check| {
    check(&host_fixture);
    if gpu_required() {
        check(&cuda_fixture);
    }
});
