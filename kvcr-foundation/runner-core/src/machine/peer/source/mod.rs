//! The source role: a peer that holds pages writes them into a target's
//! grants. Metadata replies, `start_write` checks against the advertised
//! regions, puts, `write_done`, probes and fences, and death reports for the
//! incarnations of this endpoint a guard confirmed dead.
//!
//! Split by concern: `routes` (metadata and connects), `writes` (checks,
//! preparation, puts), `completions` (put and message reports, `write_done`)
//! and `probes` (fences, the high-water mark, death reports).

use super::*;

mod completions;
mod device;
mod probes;
pub(super) mod routes;
mod writes;
