//! Block keys, namespaces and the page hash chain.
//!
//! A [`BlockKey`] is the opaque 64-bit content hash a router sees. Engines and
//! routers spell it as a signed (`i64`, SGLang, Dynamo's `/query_by_hash`) or an
//! unsigned (`u64`, vLLM) integer, or as the leading 16 hex digits of a SHA-256
//! page digest; all spellings of one hash normalise to the same value here.
//!
//! A [`Namespace`] says which pages are interchangeable: the same tokens under
//! another model/layout digest, another LoRA adapter or another cache salt are
//! different pages. [`ScopedKey`] pairs a key with its namespace's id; it is what
//! the runner indexes by.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, KeyReason, Result};

/// The 64-bit content hash of one KV page, as routers and KV events carry it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockKey(u64);

impl BlockKey {
    /// From the unsigned wire form.
    pub const fn from_u64(raw: u64) -> Self {
        Self(raw)
    }

    /// From the signed wire form (two's complement: `-1` is `u64::MAX`).
    pub const fn from_i64(raw: i64) -> Self {
        Self(raw as u64)
    }

    /// The unsigned form.
    pub const fn as_u64(self) -> u64 {
        self.0
    }

    /// The signed form, as SGLang and Dynamo's query API spell it.
    pub const fn as_i64(self) -> i64 {
        self.0 as i64
    }

    /// From any integer in `[-2^63, 2^64)`; anything else is refused.
    pub fn from_wire_int(raw: i128) -> Result<Self> {
        if raw < i128::from(i64::MIN) || raw > i128::from(u64::MAX) {
            return Err(Error::key(&raw.to_string(), KeyReason::OutOfRange));
        }
        // Two's complement truncation is exactly the normalisation wanted:
        // negative values in i64 range map to their u64 bit pattern.
        Ok(Self(raw as u64))
    }

    /// The hash of a hex page digest: its first 16 hex digits, big-endian, as
    /// SGLang's `hash_str_to_int64` reads them. Shorter all-hex strings are
    /// read whole.
    pub fn from_hex_digest(digest: &str) -> Result<Self> {
        let prefix = digest.get(..digest.len().min(16)).unwrap_or(digest);
        if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::key(digest, KeyReason::NotHex));
        }
        u64::from_str_radix(prefix, 16)
            .map(Self)
            .map_err(|_| Error::key(digest, KeyReason::NotHex))
    }

    /// From a JSON value: an integer in `[-2^63, 2^64)` or a hex digest string.
    /// Booleans, floats and other types are refused.
    pub fn from_json(value: &serde_json::Value) -> Result<Self> {
        match value {
            serde_json::Value::Number(n) => {
                if let Some(u) = n.as_u64() {
                    Ok(Self(u))
                } else if let Some(i) = n.as_i64() {
                    Ok(Self::from_i64(i))
                } else {
                    Err(Error::key(&n.to_string(), KeyReason::OutOfRange))
                }
            }
            serde_json::Value::String(s) => Self::from_hex_digest(s),
            serde_json::Value::Bool(b) => Err(Error::key(&b.to_string(), KeyReason::Boolean)),
            other => Err(Error::key(&other.to_string(), KeyReason::WrongType)),
        }
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({:#018x})", self.0)
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The model/layout compatibility digest: pages are interchangeable only between
/// runners whose model, dtype, page size, head slice and layout agree. The engine
/// computes it; kvcr only compares it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CompatDigest(pub u64);

impl fmt::Debug for CompatDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CompatDigest({:#018x})", self.0)
    }
}

/// What makes two equal token sequences produce interchangeable KV pages.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Namespace {
    /// Model, dtype, page size, layout and head-slice compatibility.
    pub compat: CompatDigest,
    /// The LoRA adapter, by name as KV events carry it (`lora_name`); `None` is the base model.
    pub lora_name: Option<String>,
    /// An optional cache salt isolating tenants.
    pub cache_salt: Option<String>,
}

impl Namespace {
    /// The base-model namespace for a compatibility digest.
    pub fn base(compat: CompatDigest) -> Self {
        Self {
            compat,
            lora_name: None,
            cache_salt: None,
        }
    }

    /// Stable 64-bit id of this namespace (the same on every host and build).
    ///
    /// FNV-1a over a length-prefixed canonical encoding, so that
    /// `("ab", None)` and `("a", "b")` cannot collide by concatenation.
    pub fn id(&self) -> NamespaceId {
        let mut h = Fnv1a::new();
        h.write(&self.compat.0.to_be_bytes());
        for part in [&self.lora_name, &self.cache_salt] {
            match part {
                None => h.write(&[0]),
                Some(s) => {
                    h.write(&[1]);
                    h.write(&(s.len() as u64).to_be_bytes());
                    h.write(s.as_bytes());
                }
            }
        }
        NamespaceId(h.finish())
    }

    /// The prior digest for page 0 of a hash chain in this namespace.
    ///
    /// The base namespace (no LoRA, no salt) leaves the chain unseeded, so its
    /// keys equal the engine's plain chain; otherwise the seed is
    /// `sha256("kvcr-namespace-v1" ‖ fields)`, so a LoRA adapter or a salt
    /// changes every page's key.
    pub fn chain_seed(&self) -> Option<[u8; 32]> {
        if self.lora_name.is_none() && self.cache_salt.is_none() {
            return None;
        }
        let mut h = Sha256::new();
        h.update(b"kvcr-namespace-v1");
        for part in [&self.lora_name, &self.cache_salt] {
            match part {
                None => h.update([0u8]),
                Some(s) => {
                    h.update([1u8]);
                    h.update((s.len() as u64).to_be_bytes());
                    h.update(s.as_bytes());
                }
            }
        }
        Some(h.finalize().into())
    }
}

/// The stable id of a [`Namespace`], carried on the wire and in the index.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NamespaceId(pub u64);

impl fmt::Debug for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NamespaceId({:#018x})", self.0)
    }
}

/// A block key inside its namespace: the runner's index key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ScopedKey {
    /// Which namespace.
    pub namespace: NamespaceId,
    /// Which page.
    pub key: BlockKey,
}

/// A SHA-256 page digest, as SGLang's storage keys spell it (64 hex digits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageDigest(pub [u8; 32]);

impl PageDigest {
    /// The router-visible key: the first 8 bytes, big-endian.
    pub fn block_key(&self) -> BlockKey {
        let mut first = [0u8; 8];
        first.copy_from_slice(&self.0[..8]);
        BlockKey(u64::from_be_bytes(first))
    }

    /// Lowercase hex, 64 digits.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
            s.push(char::from_digit(u32::from(b & 0xf), 16).unwrap_or('0'));
        }
        s
    }
}

impl fmt::Debug for PageDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageDigest({})", self.to_hex())
    }
}

/// The position-aware page hash chain:
/// `digest_i = sha256(digest_{i-1} ‖ u32-LE tokens of page i)`, with page 0's
/// prior taken from the namespace seed (none for the base namespace).
#[derive(Debug, Clone)]
pub struct PageHashChain {
    prior: Option<[u8; 32]>,
}

impl PageHashChain {
    /// A fresh chain for `namespace`.
    pub fn new(namespace: &Namespace) -> Self {
        Self {
            prior: namespace.chain_seed(),
        }
    }

    /// A chain that continues after `prior` (the last page already hashed).
    pub fn resume(prior: PageDigest) -> Self {
        Self {
            prior: Some(prior.0),
        }
    }

    /// Hashes the next page's tokens and advances the chain.
    pub fn next_page(&mut self, tokens: &[u32]) -> PageDigest {
        let mut h = Sha256::new();
        if let Some(prior) = &self.prior {
            h.update(prior);
        }
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        let digest: [u8; 32] = h.finalize().into();
        self.prior = Some(digest);
        PageDigest(digest)
    }

    /// Hashes `tokens` page by page (`page_size` tokens each); a partial tail
    /// page is not hashed, as engines only key full pages.
    pub fn pages(&mut self, tokens: &[u32], page_size: usize) -> Vec<PageDigest> {
        if page_size == 0 {
            return Vec::new();
        }
        tokens
            .chunks_exact(page_size)
            .map(|page| self.next_page(page))
            .collect()
    }
}

/// 64-bit FNV-1a: tiny, stable across builds and platforms, no dependency.
struct Fnv1a(u64);

impl Fnv1a {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Self {
        Self(Self::OFFSET)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}
