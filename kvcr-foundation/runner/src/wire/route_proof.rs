//! The route proof's active message: before a source puts anything through
//! the UCX worker a target advertised, it sends that worker a fresh nonce,
//! and the route is used only once the nonce comes back on the session the
//! advert came on. Whoever runs the worker hands the nonce back only on the
//! session it dialed to the source the message names, so a member that
//! advertised another process's worker address never sees it (see
//! `docs/trust.md`, "What a peer's bytes may reach").
//!
//! ```text
//! header := magic:"kvrp" version:u8=1 nonce:u8[32] source:u128le endpoint:utf8
//! ```
//!
//! `source` and `endpoint` are the sending source's incarnation and control
//! endpoint; the message carries no data.

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;

/// The UCX active message id of a route proof's nonce.
pub(crate) const ROUTE_PROOF: u16 = 0x6b77;
const MAGIC: &[u8; 4] = b"kvrp";
const VERSION: u8 = 1;
const FIXED: usize = MAGIC.len() + 1 + 32 + 16;
/// The largest header a route proof's message has (a control endpoint is
/// at most a few hundred bytes: a host name of 253, a scheme and a port).
pub(crate) const MAX_HEADER: usize = FIXED + 512;

/// What a source tells the worker it proves: the nonce to hand back, and
/// the source (incarnation and endpoint) to hand it back to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NonceMessage {
    pub(crate) nonce: [u8; 32],
    pub(crate) source: Incarnation,
    pub(crate) endpoint: ControlEndpoint,
}

impl NonceMessage {
    /// A fresh nonce for `source` at `endpoint` (`None`: the OS had no
    /// randomness to give).
    pub(crate) fn generate(source: Incarnation, endpoint: ControlEndpoint) -> Option<Self> {
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).ok()?;
        Some(Self {
            nonce,
            source,
            endpoint,
        })
    }

    /// The message header.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let endpoint = self.endpoint.to_string();
        let mut header = Vec::with_capacity(FIXED + endpoint.len());
        header.extend_from_slice(MAGIC);
        header.push(VERSION);
        header.extend_from_slice(&self.nonce);
        header.extend_from_slice(&self.source.raw().to_le_bytes());
        header.extend_from_slice(endpoint.as_bytes());
        header
    }

    /// The message a header says, if it is exactly one.
    pub(crate) fn decode(header: &[u8]) -> Option<Self> {
        if header.len() > MAX_HEADER {
            return None;
        }
        let (magic, rest) = header.split_first_chunk::<4>()?;
        let (version, rest) = rest.split_first()?;
        if magic != MAGIC || *version != VERSION {
            return None;
        }
        let (nonce, rest) = rest.split_first_chunk::<32>()?;
        let (source, rest) = rest.split_first_chunk::<16>()?;
        let source = Incarnation::from_raw(u128::from_le_bytes(*source))?;
        let endpoint = ControlEndpoint::parse(std::str::from_utf8(rest).ok()?).ok()?;
        Some(Self {
            nonce: *nonce,
            source,
            endpoint,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> NonceMessage {
        NonceMessage::generate(
            Incarnation::generate(),
            ControlEndpoint::parse("tcp://127.0.0.1:4000").unwrap(),
        )
        .unwrap()
    }

    /// A header reads back as the message it was made from, and fresh
    /// nonces differ.
    #[test]
    fn a_nonce_message_round_trips() {
        let sent = message();
        assert_eq!(NonceMessage::decode(&sent.encode()), Some(sent.clone()));
        assert_ne!(message().nonce, sent.nonce);
    }

    /// Any other magic, version, a cut before the endpoint, a zero incarnation, an
    /// endpoint that does not parse or an oversized header is no message.
    #[test]
    fn malformed_headers_are_no_message() {
        let good = message().encode();
        for cut in 0..=FIXED {
            assert_eq!(NonceMessage::decode(&good[..cut]), None, "cut at {cut}");
        }
        for at in [0, 4] {
            let mut bad = good.clone();
            bad[at] ^= 1;
            assert_eq!(NonceMessage::decode(&bad), None, "flip at {at}");
        }
        let mut zero = good.clone();
        zero[FIXED - 16..FIXED].fill(0);
        assert_eq!(NonceMessage::decode(&zero), None);
        let mut junk = good[..FIXED].to_vec();
        junk.extend_from_slice(b"not an endpoint");
        assert_eq!(NonceMessage::decode(&junk), None);
        let mut long = good.clone();
        long.resize(MAX_HEADER + 1, b'1');
        assert_eq!(NonceMessage::decode(&long), None);
    }
}
