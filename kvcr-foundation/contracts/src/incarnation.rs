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
    /// A fresh id, unpredictable and distinct from every other this process
    /// made.
    ///
    /// The bits come from std's `RandomState`, whose SipHash keys the standard
    /// library draws from the operating system's random source once per thread
    /// and then steps for every new state, so two calls never share keys. This
    /// keeps the contracts free of an FFI crate (`getrandom` pulls in `libc`).
    /// An incarnation names a life of a runner; it is not a credential.
    pub fn generate() -> Self {
        use std::collections::hash_map::RandomState;
        use std::hash::{BuildHasher, Hasher};
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(1);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let half = |salt: u64| {
            let mut hasher = RandomState::new().build_hasher();
            hasher.write_u64(n);
            hasher.write_u64(salt);
            hasher.write_u32(std::process::id());
            hasher.finish()
        };
        let raw = (u128::from(half(0x6b76_6372)) << 64) | u128::from(half(0x696e_6361));
        Self::from_raw(raw).unwrap_or(Self(1))
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
