//! The target role: a destination pulls hinted pages. Hints, metadata
//! exchange with sources, remote fills granted as `start_write`s, and the
//! target operations' deadlines, probes and quarantine; quarantined ops
//! probed again on a fresh metadata ack, and death reports (a guard-confirmed
//! dead incarnation ends every op sent to it).
//!
//! Split by direction: `requests` (hints, metadata, `start_write`s out) and
//! `replies` (what comes back, probes, deaths, deadlines ending ops).

use super::*;

mod replies;
mod requests;
