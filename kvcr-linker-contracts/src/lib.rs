//! kvcr-linker-contracts (slice 4/5): request-scoped linker hooks and the
//! owned-inventory ledger that every direct linker (mode B) shares.
//!
//! Not written yet; the crate exports nothing today.

#![forbid(unsafe_code)]
