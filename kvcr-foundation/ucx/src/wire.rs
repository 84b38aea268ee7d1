//! The byte forms of a worker address and a remote key, as they travel on the
//! control channel. No unsafe code here.
//!
//! UCX parses a packed worker address (`ucp_ep_create`) and a packed rkey
//! (`ucp_ep_rkey_unpack`) from a bare pointer, with no length: a truncated or
//! foreign blob handed straight to UCX is an out-of-bounds read. So each blob
//! travels inside a small envelope that the Rust side checks completely before
//! UCX sees a byte:
//!
//! ```text
//! worker address: "KVWA" ver=1 0 0 0 | context_id u64 | worker_id u64 | n u32 | n bytes (UCX) | fnv1a64 u64
//! remote key:     "KVRK" ver=1 0 0 0 | context_id u64 | base u64 | len u64 | n u32 | n bytes (UCX) | fnv1a64 u64
//! ```
//!
//! (all integers little-endian). The context id ties an rkey to the UCX
//! context that packed it, so an rkey is only unpacked on an endpoint whose
//! peer is that context ([`UcxReason::ForeignRkey`] otherwise); `base`/`len`
//! describe the remote registration, so a put's remote range is checked
//! against it.
//!
//! The packed UCX blob inside each envelope is then walked field by field
//! ([`packed`]): UCX 1.13 asserts (SIGABRT) or reads past the
//! end on a well-framed but malformed address or rkey, so only the shapes 1.13
//! itself produces get through, on parse here and again, against the local
//! context's bounds, before `ucp_ep_create` / `ucp_ep_rkey_unpack`.
//!
//! The checksum catches corruption and mix-ups, not forgery: a peer that can
//! talk to the control channel at all is trusted at the transport level (the
//! control channel's handshake is what keeps strangers out).

use super::UcxReason;
use super::packed::{self, Limits};
use super::status::UcxReason as R;
use crate::error::{Error, Result};

pub use super::packed::{MAX_UCX_ADDRESS, MAX_UCX_RKEY};

const WA_MAGIC: &[u8; 4] = b"KVWA";
const RK_MAGIC: &[u8; 4] = b"KVRK";
const VERSION: u8 = 1;
const WA_HEADER: usize = 4 + 4 + 8 + 8 + 4;
const RK_HEADER: usize = 4 + 4 + 8 + 8 + 8 + 4;
const CHECKSUM: usize = 8;

/// FNV-1a, 64-bit.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn input(op: &'static str, reason: UcxReason) -> Error {
    Error::Refused { op, reason }
}

/// A little cursor over untrusted bytes; every read is bounds-checked.
struct Reader<'a> {
    what: &'static str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], UcxReason> {
        let end = self.pos.checked_add(n).ok_or(R::Truncated {
            what: self.what,
            len: self.bytes.len(),
            needed: usize::MAX,
        })?;
        let out = self.bytes.get(self.pos..end).ok_or(R::Truncated {
            what: self.what,
            len: self.bytes.len(),
            needed: end,
        })?;
        self.pos = end;
        Ok(out)
    }

    fn u32(&mut self) -> std::result::Result<u32, UcxReason> {
        let b = self.take(4)?;
        let mut a = [0u8; 4];
        a.copy_from_slice(b);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> std::result::Result<u64, UcxReason> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

/// Checks magic, version, reserved bytes and checksum; returns a reader
/// positioned after the 8-byte magic/version/reserved prefix and the body end.
fn open_envelope<'a>(
    what: &'static str,
    magic: &[u8; 4],
    header: usize,
    max_payload: usize,
    bytes: &'a [u8],
) -> std::result::Result<Reader<'a>, UcxReason> {
    let min = header + CHECKSUM;
    if bytes.len() < min {
        // Say "bad magic" for anything that does not even start right, so a
        // stray short blob is reported as foreign rather than as truncated.
        if bytes.len() < 4 || bytes.get(..4) != Some(magic.as_slice()) {
            return Err(R::Magic { what });
        }
        return Err(R::Truncated {
            what,
            len: bytes.len(),
            needed: min,
        });
    }
    if bytes.get(..4) != Some(magic.as_slice()) {
        return Err(R::Magic { what });
    }
    let version = bytes.get(4).copied().unwrap_or_default();
    if version != VERSION {
        return Err(R::Version { what, version });
    }
    if bytes.get(5..8) != Some([0u8, 0, 0].as_slice()) {
        return Err(R::Version { what, version });
    }
    // The payload length is the last field of the header.
    let mut len_bytes = [0u8; 4];
    len_bytes.copy_from_slice(bytes.get(header - 4..header).unwrap_or(&[0; 4]));
    let n = u32::from_le_bytes(len_bytes) as usize;
    if n > max_payload {
        return Err(R::TooLarge {
            what,
            len: n,
            max: max_payload,
        });
    }
    let total = header + n + CHECKSUM;
    if bytes.len() < total {
        return Err(R::Truncated {
            what,
            len: bytes.len(),
            needed: total,
        });
    }
    if bytes.len() > total {
        return Err(R::Trailing {
            what,
            extra: bytes.len() - total,
        });
    }
    let (body, sum) = bytes.split_at(header + n);
    let mut sum_bytes = [0u8; 8];
    sum_bytes.copy_from_slice(sum);
    if fnv1a64(body) != u64::from_le_bytes(sum_bytes) {
        return Err(R::Checksum { what });
    }
    Ok(Reader {
        what,
        bytes: body,
        pos: 8,
    })
}

fn seal(mut body: Vec<u8>) -> Vec<u8> {
    let sum = fnv1a64(&body);
    body.extend_from_slice(&sum.to_le_bytes());
    body
}

/// A worker's address in its travelling form: the UCX address plus the ids of
/// the context and worker it belongs to. Build one with
/// [`Worker::address`](super::Worker::address); parse a peer's with
/// [`WorkerAddress::from_bytes`].
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerAddress {
    bytes: Vec<u8>,
    context_id: u64,
    worker_id: u64,
}

impl std::fmt::Debug for WorkerAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerAddress")
            .field("context_id", &format_args!("{:#018x}", self.context_id))
            .field("worker_id", &format_args!("{:#018x}", self.worker_id))
            .field("len", &self.bytes.len())
            .finish()
    }
}

impl WorkerAddress {
    pub(super) fn seal(context_id: u64, worker_id: u64, ucx: &[u8]) -> Result<Self> {
        packed::validate_worker_address(ucx, &Limits::new())
            .map_err(|r| input("worker address", r))?;
        let n = u32::try_from(ucx.len())
            .ok()
            .filter(|&n| n as usize <= MAX_UCX_ADDRESS)
            .ok_or_else(|| {
                input(
                    "worker address",
                    R::TooLarge {
                        what: "worker address",
                        len: ucx.len(),
                        max: MAX_UCX_ADDRESS,
                    },
                )
            })?;
        let mut body = Vec::with_capacity(WA_HEADER + ucx.len() + CHECKSUM);
        body.extend_from_slice(WA_MAGIC);
        body.extend_from_slice(&[VERSION, 0, 0, 0]);
        body.extend_from_slice(&context_id.to_le_bytes());
        body.extend_from_slice(&worker_id.to_le_bytes());
        body.extend_from_slice(&n.to_le_bytes());
        body.extend_from_slice(ucx);
        Ok(Self {
            bytes: seal(body),
            context_id,
            worker_id,
        })
    }

    /// Wraps a packed UCX worker address (as `ucp_worker_get_address`
    /// returns it) in its travelling form, after validating it
    /// ([`packed::validate_worker_address`], format bounds only). For tools
    /// and tests; a worker's own address comes from
    /// [`Worker::address`](super::Worker::address).
    pub fn from_packed(context_id: u64, worker_id: u64, packed: &[u8]) -> Result<Self> {
        Self::seal(context_id, worker_id, packed)
    }

    /// Parses and validates a peer's worker address: the envelope (magic,
    /// version, lengths, checksum), then the packed UCX address inside it
    /// ([`packed::validate_worker_address`], format bounds only;
    /// [`Worker::connect`](super::Worker::connect) checks it again against
    /// the local context). Truncated, oversized, corrupted, foreign or
    /// malformed bytes are a typed [`Error::Refused`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let what = "worker address";
        let mut r = open_envelope(what, WA_MAGIC, WA_HEADER, MAX_UCX_ADDRESS, bytes)
            .map_err(|reason| input(what, reason))?;
        let context_id = r.u64().map_err(|e| input(what, e))?;
        let worker_id = r.u64().map_err(|e| input(what, e))?;
        let n = r.u32().map_err(|e| input(what, e))? as usize;
        let ucx = r.take(n).map_err(|e| input(what, e))?;
        packed::validate_worker_address(ucx, &Limits::new()).map_err(|e| input(what, e))?;
        Ok(Self {
            bytes: bytes.to_vec(),
            context_id,
            worker_id,
        })
    }

    /// The travelling form (what goes on the control channel).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The id of the UCX context (process-local random) the worker belongs to.
    pub fn context_id(&self) -> u64 {
        self.context_id
    }

    /// The id of the worker (random, fresh per worker).
    pub fn worker_id(&self) -> u64 {
        self.worker_id
    }

    /// The packed UCX address inside the envelope (validated; for tools and
    /// tests that inspect it).
    pub fn packed(&self) -> &[u8] {
        self.ucx_bytes()
    }

    /// The packed UCX address inside the envelope.
    pub(super) fn ucx_bytes(&self) -> &[u8] {
        self.bytes
            .get(WA_HEADER..self.bytes.len().saturating_sub(CHECKSUM))
            .unwrap_or_default()
    }
}

/// A packed remote key in its travelling form: the UCX rkey plus the packing
/// context's id and the registration's base address and length. Build one
/// with [`Registration::pack_rkey`](super::Registration::pack_rkey); parse a
/// peer's with [`RkeyBuffer::from_bytes`]; unpack it with
/// [`Endpoint::unpack_rkey`](super::Endpoint::unpack_rkey).
#[derive(Clone, PartialEq, Eq)]
pub struct RkeyBuffer {
    bytes: Vec<u8>,
    context_id: u64,
    base: u64,
    len: u64,
}

impl std::fmt::Debug for RkeyBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RkeyBuffer")
            .field("context_id", &format_args!("{:#018x}", self.context_id))
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish()
    }
}

impl RkeyBuffer {
    pub(super) fn seal(context_id: u64, base: u64, len: u64, ucx: &[u8]) -> Result<Self> {
        packed::validate_rkey(ucx, &Limits::new()).map_err(|r| input("rkey pack", r))?;
        let n = u32::try_from(ucx.len()).map_err(|_| {
            input(
                "rkey pack",
                R::TooLarge {
                    what: "rkey",
                    len: ucx.len(),
                    max: MAX_UCX_RKEY,
                },
            )
        })?;
        let mut body = Vec::with_capacity(RK_HEADER + ucx.len() + CHECKSUM);
        body.extend_from_slice(RK_MAGIC);
        body.extend_from_slice(&[VERSION, 0, 0, 0]);
        body.extend_from_slice(&context_id.to_le_bytes());
        body.extend_from_slice(&base.to_le_bytes());
        body.extend_from_slice(&len.to_le_bytes());
        body.extend_from_slice(&n.to_le_bytes());
        body.extend_from_slice(ucx);
        Ok(Self {
            bytes: seal(body),
            context_id,
            base,
            len,
        })
    }

    /// Wraps a packed UCX rkey (as `ucp_rkey_pack` returns it) with the
    /// packing context's id and the registration's extent, after validating
    /// it ([`packed::validate_rkey`], format bounds only). For tools and
    /// tests; a registration's own rkey comes from
    /// [`Registration::pack_rkey`](super::Registration::pack_rkey).
    pub fn from_packed(context_id: u64, base: u64, len: u64, packed: &[u8]) -> Result<Self> {
        if len == 0 || base.checked_add(len).is_none() {
            return Err(input("rkey", R::MalformedRkey("region extent")));
        }
        Self::seal(context_id, base, len, packed)
    }

    /// Parses and validates a peer's packed rkey: the envelope, the region
    /// extent, then the packed UCX rkey inside it
    /// ([`packed::validate_rkey`], format bounds only;
    /// [`Endpoint::unpack_rkey`](super::Endpoint::unpack_rkey) checks it
    /// again against the local context). Truncated, oversized, corrupted or
    /// garbage bytes are a typed [`Error::Refused`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let what = "rkey";
        let mut r = open_envelope(what, RK_MAGIC, RK_HEADER, MAX_UCX_RKEY, bytes)
            .map_err(|reason| input(what, reason))?;
        let context_id = r.u64().map_err(|e| input(what, e))?;
        let base = r.u64().map_err(|e| input(what, e))?;
        let len = r.u64().map_err(|e| input(what, e))?;
        let n = r.u32().map_err(|e| input(what, e))? as usize;
        let ucx = r.take(n).map_err(|e| input(what, e))?;
        if len == 0 || base.checked_add(len).is_none() {
            return Err(input(what, R::MalformedRkey("region extent")));
        }
        packed::validate_rkey(ucx, &Limits::new()).map_err(|e| input(what, e))?;
        Ok(Self {
            bytes: bytes.to_vec(),
            context_id,
            base,
            len,
        })
    }

    /// The travelling form (what goes on the control channel).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The id of the UCX context that packed it.
    pub fn context_id(&self) -> u64 {
        self.context_id
    }

    /// The remote registration's base address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The remote registration's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: registrations are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed UCX rkey inside the envelope (validated; for tools and
    /// tests that inspect it).
    pub fn packed(&self) -> &[u8] {
        self.ucx_bytes()
    }

    /// The packed UCX rkey inside the envelope.
    pub(super) fn ucx_bytes(&self) -> &[u8] {
        self.bytes
            .get(RK_HEADER..self.bytes.len().saturating_sub(CHECKSUM))
            .unwrap_or_default()
    }
}
