//! Scripted and seeded runs of the simulator, one file per concern.

use super::*;

mod deaths;
mod g3_prepare;
mod journal;
mod late_digests;
mod many_seeds;
mod one_hop;
mod one_hop_batches;
mod one_hop_leads;
mod restore;
mod routes;
mod trust;

use restore::*;
use trust::*;
