//! Incarnation ids: one per runner process and per reset.
//!
//! Every control message carries its sender's incarnation, so a peer restarted
//! at the same address is never mistaken for the process it replaced, and every
//! inventory stream is scoped to one incarnation.

use std::fmt;
use std::str::FromStr;

use crate::error::{Echo, Error, Result};

/// A non-zero 128-bit random id naming one life of one runner.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Incarnation(u128);

impl Incarnation {
    /// A fresh id from the operating system's random source.
    ///
    /// Falls back to mixing the address of a stack slot with a process-wide
    /// counter only if the OS source fails, which on Linux means the process is
    /// too early in boot to have entropy; uniqueness then holds within a process.
    pub fn generate() -> Self {
        let mut bytes = [0u8; 16];
        if getrandom::fill(&mut bytes).is_err() {
            use std::sync::atomic::{AtomicU64, Ordering};
            static COUNTER: AtomicU64 = AtomicU64::new(1);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let addr = std::ptr::addr_of!(bytes) as usize as u64;
            bytes[..8].copy_from_slice(&n.to_be_bytes());
            bytes[8..].copy_from_slice(&addr.to_be_bytes());
        }
        Self::from_raw(u128::from_be_bytes(bytes)).unwrap_or(Self(1))
    }

    /// From a raw value; zero is reserved for "none" on the wire and refused.
    pub const fn from_raw(raw: u128) -> Option<Self> {
        if raw == 0 { None } else { Some(Self(raw)) }
    }

    /// The raw value (never zero).
    pub const fn raw(self) -> u128 {
        self.0
    }

    /// The first 8 hex digits, for human-facing names.
    pub fn short(self) -> String {
        format!("{:08x}", (self.0 >> 96) as u32)
    }

    /// A per-rank agent name: `kvcr-dp{dp}-tp{tp}-{short}`. Different across
    /// ranks, DP groups and restarts.
    pub fn agent_name(self, dp_rank: u32, tp_rank: u32) -> String {
        format!("kvcr-dp{dp_rank}-tp{tp_rank}-{}", self.short())
    }

    /// Parses the 32-hex-digit form written by `Display`.
    pub fn parse(input: &str) -> Result<Self> {
        let err = || Error::Incarnation {
            input: Echo::new(input),
        };
        if input.len() != 32
            || !input
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(err());
        }
        u128::from_str_radix(input, 16)
            .ok()
            .and_then(Self::from_raw)
            .ok_or_else(err)
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Incarnation({self})")
    }
}

impl FromStr for Incarnation {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}
