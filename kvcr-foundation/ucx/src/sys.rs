//! Raw FFI bindings to UCP 1.13 (the `sys` rung of the ladder).
//!
//! Generated once by bindgen from Debian's `libucx-dev` 1.13.1 headers with a
//! narrow allowlist (see `build.rs`) and committed as `bindings_1_13.rs`; the
//! `ucx-bindgen` feature regenerates them at build time instead. Enums are
//! plain integer constants, never Rust enums, so a status or flag value that a
//! newer libucp returns is not undefined behaviour. The generated file carries
//! bindgen's compile-time size/alignment/offset assertions for every struct.
//!
//! Nothing here is safe to call directly: the crate calls these routines
//! only through `result` (one thin wrapper each), and the safe layer is the
//! rest of the crate.

#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_docs,
    unreachable_pub,
    clippy::all,
    clippy::pedantic,
    clippy::restriction,
    clippy::undocumented_unsafe_blocks,
    clippy::missing_safety_doc
)]

#[cfg(not(feature = "ucx-bindgen"))]
include!("bindings_1_13.rs");

#[cfg(feature = "ucx-bindgen")]
include!(concat!(env!("OUT_DIR"), "/ucx_bindings.rs"));
