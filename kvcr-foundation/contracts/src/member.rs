//! A cluster member's public key: the X25519 static key its runner proves in
//! every control session's handshake.
//!
//! It is written as 64 hex digits (lowercase when printed; either case is
//! read) and travels inside a control endpoint (`tcp://host:port?key=…`, see
//! [`crate::endpoint`]), so whoever is told where a runner is is also told
//! who must answer there.

use std::fmt;
use std::str::FromStr;

use crate::error::{EndpointReason, Error, Result};

/// Hex digits in a written key.
const HEX_LEN: usize = 64;

/// A member's 32-byte X25519 public key (never all zero).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberKey([u8; 32]);

impl MemberKey {
    /// The key from its bytes; `None` for all zero (the identity point no
    /// runner can hold the private key of).
    pub fn from_bytes(bytes: [u8; 32]) -> Option<Self> {
        (bytes != [0; 32]).then_some(Self(bytes))
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Parses 64 hex digits.
    pub fn parse(input: &str) -> Result<Self> {
        Self::parse_reason(input).map_err(|reason| Error::endpoint(input, reason))
    }

    pub(crate) fn parse_reason(input: &str) -> std::result::Result<Self, EndpointReason> {
        if input.len() != HEX_LEN {
            return Err(EndpointReason::MemberKey);
        }
        let mut bytes = [0u8; 32];
        let digit = |c: u8| char::from(c).to_digit(16).ok_or(EndpointReason::MemberKey);
        for (byte, pair) in bytes.iter_mut().zip(input.as_bytes().chunks_exact(2)) {
            let &[high, low] = pair else {
                return Err(EndpointReason::MemberKey);
            };
            let value = digit(high)? * 16 + digit(low)?;
            *byte = u8::try_from(value).map_err(|_| EndpointReason::MemberKey)?;
        }
        Self::from_bytes(bytes).ok_or(EndpointReason::MemberKey)
    }
}

impl fmt::Display for MemberKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for MemberKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemberKey({self})")
    }
}

impl FromStr for MemberKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}
