//! The guard's claim protocol, version 1: its messages and its framing.
//!
//! A frame is `[len: u32 little-endian][len bytes of JSON]` on a
//! `SOCK_STREAM` Unix socket, `len` at most [`MAX_FRAME`]; a longer length
//! is refused before anything is allocated for it, and the connection is
//! closed (the stream cannot be resynchronised). Every message is an
//! internally tagged JSON object (`"type"`), and every object refuses
//! fields it does not know.
//!
//! ```text
//!  client ── Claim { version, group, compat_digest, layout, control, incarnation } ──► guard
//!         ◄── Granted { .. } + SCM_RIGHTS [journal, pool 0, .., pool n-1, listener] ──
//!         ◄── Refused { refusal }                                  (no descriptors) ──
//!  client ── Release { version } ──► guard
//!         ◄── Released ──
//! ```
//!
//! The descriptors of a grant travel in one `sendmsg`, attached to the
//! first byte of the `Granted` frame, in the order above.

use serde::{Deserialize, Serialize};

use crate::net::StaticKey;

/// The protocol version this crate speaks.
pub const VERSION: u32 = 1;

/// Largest payload of one frame, in bytes.
pub const MAX_FRAME: usize = 64 * 1024;

/// Longest pool name, in bytes.
pub const MAX_POOL_NAME: usize = 64;

/// One pool of a group: `blocks` blocks of `block_bytes` each.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// The pool's name (at most [`MAX_POOL_NAME`] bytes).
    pub name: String,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks in the pool.
    pub blocks: u32,
}

impl PoolSpec {
    /// The pool's size in bytes, `None` when it overflows.
    pub fn bytes(&self) -> Option<u64> {
        self.block_bytes.checked_mul(u64::from(self.blocks))
    }
}

/// The memory of a group: its pools, in layout order, and its journal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// The pools, in layout order (one memfd each).
    pub pools: Vec<PoolSpec>,
    /// Size of the residency journal's memfd.
    pub journal_bytes: u64,
}

impl Layout {
    /// Checks the layout against the limits and returns its total size
    /// (journal and pools), or why it is refused.
    pub fn check(&self, max_pools: usize, max_bytes: u64) -> Result<u64, String> {
        if self.pools.is_empty() {
            return Err("a layout needs at least one pool".into());
        }
        if self.pools.len() > max_pools {
            return Err(format!("{} pools (at most {max_pools})", self.pools.len()));
        }
        if self.journal_bytes == 0 {
            return Err("layout.journal_bytes is 0".into());
        }
        let mut total = self.journal_bytes;
        for (i, pool) in self.pools.iter().enumerate() {
            if pool.name.len() > MAX_POOL_NAME {
                return Err(format!(
                    "layout.pools[{i}].name is {} bytes (at most {MAX_POOL_NAME})",
                    pool.name.len()
                ));
            }
            let bytes = pool
                .bytes()
                .filter(|b| *b > 0)
                .ok_or_else(|| format!("layout.pools[{i}] is empty or overflows"))?;
            total = total
                .checked_add(bytes)
                .filter(|t| *t <= max_bytes)
                .ok_or_else(|| format!("the layout is over {max_bytes} bytes"))?;
        }
        if total > max_bytes {
            return Err(format!("the layout is over {max_bytes} bytes"));
        }
        Ok(total)
    }

    /// The first field in which `other` differs from this layout, named as
    /// a path (`layout.pools[1].blocks`), or `None` when they are equal.
    pub fn first_difference(&self, other: &Self) -> Option<String> {
        if self.journal_bytes != other.journal_bytes {
            return Some("layout.journal_bytes".into());
        }
        if self.pools.len() != other.pools.len() {
            return Some("layout.pools (count)".into());
        }
        self.pools
            .iter()
            .zip(&other.pools)
            .enumerate()
            .find_map(|(i, (a, b))| {
                let field = if a.name != b.name {
                    "name"
                } else if a.block_bytes != b.block_bytes {
                    "block_bytes"
                } else if a.blocks != b.blocks {
                    "blocks"
                } else {
                    return None;
                };
                Some(format!("layout.pools[{i}].{field}"))
            })
    }
}

/// A claim as it travels: see [`GuardClaim`](super::GuardClaim).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimMsg {
    /// [`VERSION`].
    pub version: u32,
    /// The group (one per rank).
    pub group: u32,
    /// The engine's compatibility digest (model, layout, dtype, ...).
    pub compat_digest: u64,
    /// The group's memory.
    pub layout: Layout,
    /// `host:port` (an IP literal) the guard binds the control listener at;
    /// port 0 on the group's first claim asks the OS for one.
    pub control: String,
    /// The claimant's incarnation: 32 hex digits.
    pub incarnation: String,
}

/// A grant as it travels: see [`GuardGrant`](super::GuardGrant).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantedMsg {
    /// [`VERSION`].
    pub version: u32,
    /// The group claimed.
    pub group: u32,
    /// The group's layout (the claim's).
    pub layout: Layout,
    /// Each pool's memfd name token, 32 hex digits, in layout order.
    pub pool_tokens: Vec<String>,
    /// The address the control listener is bound at.
    pub control: String,
    /// Whether the memory was handed out before (false on the group's
    /// first grant: the memory is fresh).
    pub warm: bool,
    /// The incarnation that held the group last, if any (32 hex digits).
    pub previous_incarnation: Option<String>,
    /// The group's incarnations whose process died holding it, oldest
    /// first (32 hex digits each; a bounded list).
    pub dead_incarnations: Vec<String>,
    /// The group's member key (the private half, 64 hex digits): every
    /// holder of the group, and the guard's backup, proves it, so the
    /// group's advertised endpoint names the same key across restarts.
    pub member_key: MemberKeyHex,
}

/// A member key's private half as a grant carries it (64 hex digits);
/// `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MemberKeyHex(pub String);

impl std::fmt::Debug for MemberKeyHex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MemberKeyHex(<redacted>)")
    }
}

/// Client → guard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Claim a group.
    Claim(ClaimMsg),
    /// End this connection's lease; the memory stays with the guard.
    Release {
        /// [`VERSION`].
        version: u32,
    },
}

/// Guard → client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The claim is granted; the descriptors come with this frame.
    Granted(GrantedMsg),
    /// The request is refused; the guard closes the connection.
    Refused {
        /// Why.
        refusal: Refusal,
    },
    /// The lease ended.
    Released,
}

/// Why the guard refused a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Refusal {
    /// The request names a protocol version the guard does not speak.
    #[error("protocol version {got} is not supported (this guard speaks {VERSION})")]
    Version {
        /// The version asked for.
        got: u32,
    },
    /// The request is malformed or outside the guard's limits.
    #[error("invalid request: {why}")]
    Invalid {
        /// Why.
        why: String,
    },
    /// A live process holds the group.
    #[error("group {group} is held by pid {pid}")]
    Held {
        /// The group.
        group: u32,
        /// The holder's pid (in the guard's pid namespace).
        pid: u32,
    },
    /// The claim differs from the group's first claim.
    #[error("group {group} was first claimed with another {field}")]
    Mismatch {
        /// The group.
        group: u32,
        /// The field that differs (`compat_digest`, `control`,
        /// `layout.pools[0].blocks`, ...).
        field: String,
    },
    /// The guard keeps its most groups already.
    #[error("the guard keeps at most {limit} groups")]
    TooManyGroups {
        /// The limit.
        limit: u32,
    },
    /// The guard could not make the group's memory or bind its listener.
    #[error("the guard could not set the group up: {why}")]
    Failed {
        /// What failed.
        why: String,
    },
}

/// The frame header for a payload of `len` bytes, `None` when it is over
/// [`MAX_FRAME`].
pub fn header(len: usize) -> Option<[u8; 4]> {
    if len > MAX_FRAME {
        return None;
    }
    u32::try_from(len).ok().map(u32::to_le_bytes)
}

/// The payload length a header announces, `None` when it is over
/// [`MAX_FRAME`].
pub fn payload_len(header: [u8; 4]) -> Option<usize> {
    usize::try_from(u32::from_le_bytes(header))
        .ok()
        .filter(|len| *len <= MAX_FRAME)
}

/// One message as a whole frame (header and payload), `None` when it is
/// over [`MAX_FRAME`].
pub fn encode<T: Serialize>(message: &T) -> Option<Vec<u8>> {
    let payload = serde_json::to_vec(message).ok()?;
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&header(payload.len())?);
    frame.extend_from_slice(&payload);
    Some(frame)
}

/// Parses a request; a payload that is not one is a refusal to send back
/// (a [`Refusal::Version`] when it names another version, so a client of a
/// later protocol learns why even when its fields are new).
pub fn decode_request(payload: &[u8]) -> Result<Request, Refusal> {
    match serde_json::from_slice::<Request>(payload) {
        Ok(Request::Claim(ClaimMsg { version, .. }) | Request::Release { version })
            if version != VERSION =>
        {
            Err(Refusal::Version { got: version })
        }
        Ok(request) => Ok(request),
        Err(e) => Err(other_version(payload).map_or_else(
            || Refusal::Invalid {
                why: format!("not a request: {e}"),
            },
            |got| Refusal::Version { got },
        )),
    }
}

/// The `version` a payload names when it is a JSON object naming one
/// other than [`VERSION`].
fn other_version(payload: &[u8]) -> Option<u32> {
    let value: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let version = u32::try_from(value.get("version")?.as_u64()?).ok()?;
    (version != VERSION).then_some(version)
}

/// `value` as 32 lowercase hex digits.
pub fn hex128(value: u128) -> String {
    format!("{value:032x}")
}

/// Exactly 32 hex digits to their value.
pub fn parse_hex128(text: &str) -> Option<u128> {
    if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(text, 16).ok()
}

/// A 16-byte token as 32 lowercase hex digits.
pub fn token_hex(token: &[u8; 16]) -> String {
    hex128(u128::from_be_bytes(*token))
}

/// Exactly 32 hex digits to a 16-byte token.
pub fn parse_token(text: &str) -> Option<[u8; 16]> {
    parse_hex128(text).map(u128::to_be_bytes)
}

/// A member key's private half as 64 lowercase hex digits (for a grant,
/// over the guard's own-uid socket; never logged).
pub fn member_key_hex(key: &StaticKey) -> MemberKeyHex {
    MemberKeyHex(key.private().iter().map(|b| format!("{b:02x}")).collect())
}

/// Exactly 64 hex digits to a member key.
pub fn parse_member_key(MemberKeyHex(text): &MemberKeyHex) -> Option<StaticKey> {
    let (high, low) = (text.get(..32)?, text.get(32..)?);
    let mut private = [0u8; 32];
    let (first, second) = private.split_at_mut(16);
    first.copy_from_slice(&parse_token(high)?);
    second.copy_from_slice(&parse_token(low)?);
    StaticKey::from_private(private)
}
