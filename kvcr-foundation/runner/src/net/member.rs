//! A runner's static key pair: the X25519 key every control session it
//! opens or answers proves (Noise `XXpsk0`), whose public half
//! ([`MemberKey`]) its advertised control endpoint names (`?key=`).
//!
//! A runner makes a fresh pair at start unless [`crate::PeerOptions`] gives
//! one. The private half never leaves the process and never reaches a log.

use curve25519_dalek::montgomery::MontgomeryPoint;
use kvcr_contracts::MemberKey;

use crate::error::{Error, Result, RunnerReason};

/// A member's X25519 static key pair (`Debug` shows the public half only).
#[derive(Clone, PartialEq, Eq)]
pub struct StaticKey {
    private: [u8; 32],
    public: MemberKey,
}

impl StaticKey {
    /// A fresh pair from the operating system's random source.
    pub fn generate() -> Result<Self> {
        let mut private = [0u8; 32];
        getrandom::fill(&mut private).map_err(|_| {
            Error::runner(RunnerReason::Config {
                field: "peer.static_key",
                why: "no randomness for a static key",
            })
        })?;
        Self::from_private(private).ok_or(Error::runner(RunnerReason::Config {
            field: "peer.static_key",
            why: "no randomness for a static key",
        }))
    }

    /// The pair whose private half is `private` (an X25519 scalar, clamped
    /// as X25519 does); `None` if its public half would be all zero.
    pub fn from_private(private: [u8; 32]) -> Option<Self> {
        let public = MontgomeryPoint::mul_base_clamped(private).to_bytes();
        Some(Self {
            private,
            public: MemberKey::from_bytes(public)?,
        })
    }

    /// The public half: what this runner's endpoint names and its sessions
    /// prove.
    pub fn public(&self) -> MemberKey {
        self.public
    }

    /// The private half, for the handshake.
    pub(crate) fn private(&self) -> &[u8; 32] {
        &self.private
    }
}

impl std::fmt::Debug for StaticKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticKey")
            .field("public", &self.public)
            .field("private", &"<redacted>")
            .finish()
    }
}

/// Whether a target follows a hint whose source endpoint names no key (and
/// so dials a source without knowing who must answer there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeylessSources {
    /// Refused when a cluster secret is set; allowed without one, where the
    /// runner serves loopback only (the default).
    #[default]
    RefusedWithSecret,
    /// Always refused: every source must be named with its key.
    Refused,
    /// Always allowed: any member answering at the address is taken as the
    /// source (what every session was before member keys).
    Allowed,
}

impl KeylessSources {
    /// Whether a keyless source may be dialed, given whether a cluster
    /// secret is set.
    pub(crate) fn allowed(self, secret: bool) -> bool {
        match self {
            Self::RefusedWithSecret => !secret,
            Self::Refused => false,
            Self::Allowed => true,
        }
    }
}
