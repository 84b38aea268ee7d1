//! kvcr-direct-linker's tests (one integration binary).
//!
//! * `conformance`: the linker conformance suite against the direct linker
//!   with a host-resident KV pool (runs everywhere) and, with
//!   `KVCR_TEST_GPU=1`, with a GPU pool through the CUDA copier.
//! * `restore`: byte-exact offload/restore across layouts, engine-side eviction,
//!   abort and deadline paths, peer restore — on a GPU when `KVCR_TEST_GPU=1`
//!   (which fails, not skips, when no GPU is found); without the flag only the
//!   no-driver path runs.
//! * `one_hop`: a second process imports this one's exported device extent
//!   and copies a pinned pattern into it (GPU only).
//! * `one_hop_peer`: restores from a source process in one hop, its fallback
//!   to two, a source killed with a grant outstanding (GPU only).
//! * `rows`: runs of consecutive slots move as single 2D copies, byte-exact
//!   both ways (GPU only).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod conformance;
mod fixture;
mod layouts;
mod one_hop;
mod one_hop_peer;
mod restore;
mod rows;
