//! The residency journal: which KVCR DRAM pages a runner holds READY, kept in
//! a byte region that outlives the runner (issue 21, the Guard).
//!
//! The runner (the primary) appends a [`JournalRecord`] for every change that
//! matters to a restart: a namespace registered, a page READY with all its
//! bytes, a page's residency ended (journaled before its slots can be written
//! again), slots granted to a peer's remote write and freed again. The region
//! is a slice of a shared memfd mapping that a guard process keeps open; this
//! module only ever sees `&[u8]` / `&mut [u8]` (no I/O, no unsafe).
//!
//! When the primary dies (SIGKILL at any instant, so a record may be half
//! written), a restarted primary or the guard calls [`recover`] on the same
//! bytes and gets back exactly the pages whose records were complete, plus the
//! slots it must never reuse ([`Recovered::held`]). Recovering fewer pages is
//! allowed; recovering a page whose slots were reused or never fully written is
//! not, so anything the reader cannot explain as a torn tail is
//! [`JournalError::Corrupt`]. A warm restart then continues with
//! [`JournalWriter::resume`].
//!
//! # Format (version 1, all integers little-endian)
//!
//! ```text
//! region = header (64 bytes) | half 0 | half 1 | (< 16 unused bytes)
//! half   = ((region length - 64) / 2) rounded down to a multiple of 8
//!
//! header:  0  magic "KVCRJNL1"
//!          8  version u32 (1)
//!         12  state u32: 0 = Ok, anything else = Disabled (1 Overflow, 2 Requested)
//!         16  region length u64
//!         24  half length u64
//!         32  commit slot of half 0: epoch u64 | crc32 u32 | 0 u32
//!         48  commit slot of half 1: epoch u64 | crc32 u32 | 0 u32
//!
//! record frame (8-byte aligned inside its half, zero padded to 8 bytes):
//!          0  len u32     payload length, 1..=MAX_PAYLOAD
//!          4  crc32 u32   over epoch u64 | len u32 | seq u64 | payload
//!          8  seq u64     1 for a half's first record, then +1 each
//!         16  payload     tag u8, then the fields below
//!
//! payloads:  1 Namespace  id u64 | compat u64 | lora_name opt-str | cache_salt opt-str
//!            2 Ready      namespace u64 | key u64 | layout u16 | parent opt-u64
//!                         | slots u32-list | token_ids u32-list
//!            3 Removed    namespace u64 | key u64
//!            4 Held       slots u32-list
//!            5 Freed      slots u32-list
//! opt-str  = 0 | 1, len u32 (<= MAX_STRING), UTF-8 bytes
//! opt-u64  = 0 | 1, u64
//! u32-list = count u32 (<= MAX_SLOTS slots, <= MAX_TOKEN_IDS tokens), count u32s
//! ```
//!
//! A commit slot is valid when its epoch is at least 1, its reserved word is
//! zero and its crc32 (over `"KVCRSLOT"`, the half's index as one byte and the
//! epoch) matches. The active half is the one whose slot is valid with the
//! higher epoch; the checksum makes a torn slot write read as invalid, never as
//! another epoch. A frame's checksum covers its half's epoch, so a stale frame
//! never passes in another epoch.
//!
//! # Writing
//!
//! [`JournalWriter::format`] zeroes the region, writes the header and commits
//! half 0 at epoch 1. Appends go to the active half: the payload, then the
//! frame header (a compiler fence after each record keeps program order, which
//! is the order a killed process leaves its stores in). A half is all zeroes
//! past its last record, so the end of the records is well defined.
//!
//! Compaction: when a record does not fit in the active half, the writer
//! zeroes the other half, writes its mirror of the live state there as a
//! snapshot (namespaces, then the held slots, then every live page, oldest
//! first), commits that half by writing its slot with the epoch plus one (the
//! flip: one 16-byte write), invalidates the old half's slot, and then appends
//! the record. A crash before the flip leaves the old half active and intact;
//! after it, the new half holds the same state.
//!
//! If the snapshot plus the record does not fit in a half, the journal is
//! overflowed: the state word becomes `Disabled(Overflow)` and every later
//! append is refused with [`JournalError::Disabled`]; [`recover`] then answers
//! `Disabled` too, so a restart is cold (the runner keeps serving, only
//! without warm recovery).
//!
//! # Reading
//!
//! [`recover`] checks the header, picks the active half and reads its records
//! in order, checking each against the state so far (a Ready of a page live
//! already, of an unknown namespace, or on slots another page or a hold owns;
//! a Removed of a page not live; a Freed of a slot not held: all corrupt). The
//! records end at the first frame that is not complete and in sequence. If the
//! rest of the half is zero, that is the clean end; if not, it is a torn tail
//! (the record being written when the writer died) unless a complete frame
//! numbered at or after the expected one starts at any 8-byte boundary after
//! it, which only damage in the middle of the half can cause: that is corrupt,
//! because dropping a record in the middle (a Removed, say) could serve a page
//! whose slots were written again. (A LoRA name or salt crafted to hold such a
//! frame inside a torn record can only make a restart cold, never wrong.)
//!
//! No length read from the region is trusted before it is checked against its
//! cap and against the bytes that remain, so no input makes the reader panic or
//! allocate more than the input's size.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

// hashbrown's default (foldhash, seeded at random per process, as the core's
// own index): the mirror is updated on every append, under the runner's lock,
// and SipHash made that a measurable share of a deposit.
use hashbrown::{HashMap, HashSet};
use std::sync::atomic::{Ordering, compiler_fence};

#[cfg(test)]
mod tests;

/// The header's magic.
pub const MAGIC: [u8; 8] = *b"KVCRJNL1";
/// The format version this module writes and reads.
pub const VERSION: u32 = 1;
/// Bytes of the header.
pub const HEADER_LEN: usize = 64;
/// Bytes of a record frame's header (len, crc32, seq).
pub const FRAME_HEADER_LEN: usize = 16;
/// The smallest half a journal is formatted with.
pub const MIN_HALF_LEN: usize = 256;
/// The smallest region [`JournalWriter::format`] accepts.
pub const MIN_REGION_LEN: usize = HEADER_LEN + 2 * MIN_HALF_LEN;
/// Most slots in one record (a page's slots, or one Held / Freed record).
pub const MAX_SLOTS: usize = 4096;
/// Most token ids of one page.
pub const MAX_TOKEN_IDS: usize = 65_536;
/// Most bytes of a LoRA name or cache salt.
pub const MAX_STRING: usize = 4096;
/// Most bytes of one record's payload (a Ready at both caps; a Namespace at
/// both string caps is smaller).
pub const MAX_PAYLOAD: usize = 1 + 8 + 8 + 2 + 1 + 8 + 4 + 4 * MAX_SLOTS + 4 + 4 * MAX_TOKEN_IDS;

const OFF_VERSION: usize = 8;
const OFF_STATE: usize = 12;
const OFF_LENGTH: usize = 16;
const OFF_HALF: usize = 24;
const OFF_SLOTS: [usize; 2] = [32, 48];
const SLOT_LEN: usize = 16;

const STATE_OK: u32 = 0;
const CODE_OVERFLOW: u32 = 1;
const CODE_REQUESTED: u32 = 2;

const TAG_NAMESPACE: u8 = 1;
const TAG_READY: u8 = 2;
const TAG_REMOVED: u8 = 3;
const TAG_HELD: u8 = 4;
const TAG_FREED: u8 = 5;

/// One journal entry, as the runner appends it.
///
/// Plain integers (namespace ids are `NamespaceId.0`, keys `BlockKey` as `u64`)
/// so the format stands on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JournalRecord {
    /// A namespace the runner registered.
    Namespace {
        /// The namespace's id (`NamespaceId.0`).
        id: u64,
        /// Its compatibility digest.
        compat: u64,
        /// Its LoRA adapter (at most [`MAX_STRING`] bytes).
        lora_name: Option<String>,
        /// Its cache salt (at most [`MAX_STRING`] bytes).
        cache_salt: Option<String>,
    },
    /// A page became READY with all its bytes (only then is it journaled).
    Ready {
        /// Its namespace (registered earlier).
        namespace: u64,
        /// Its key (`BlockKey` as `u64`).
        key: u64,
        /// The runner's layout code (opaque here).
        layout: u16,
        /// Its DRAM slots, 1..=[`MAX_SLOTS`], distinct, owned by no live page
        /// and not held.
        slots: Vec<u32>,
        /// The key of its parent page, if any.
        parent: Option<u64>,
        /// Its token ids (at most [`MAX_TOKEN_IDS`]).
        token_ids: Vec<u32>,
    },
    /// The page's residency ended. Journaled before its slots can be written
    /// again.
    Removed {
        /// Its namespace.
        namespace: u64,
        /// Its key.
        key: u64,
    },
    /// Slots granted to a peer's remote write: a source may write them at any
    /// time until proof, so they are never reused after a recovery unless
    /// freed. 1..=[`MAX_SLOTS`] distinct slots, none owned or held.
    Held {
        /// The slots.
        slots: Vec<u32>,
    },
    /// Slots of an earlier Held, freed with proof (1..=[`MAX_SLOTS`], all held).
    Freed {
        /// The slots.
        slots: Vec<u32>,
    },
}

/// A namespace a journal holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecoveredNamespace {
    /// The namespace's id (`NamespaceId.0`).
    pub id: u64,
    /// Its compatibility digest.
    pub compat: u64,
    /// Its LoRA adapter.
    pub lora_name: Option<String>,
    /// Its cache salt.
    pub cache_salt: Option<String>,
}

/// A page a journal holds READY.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecoveredPage {
    /// Its namespace.
    pub namespace: u64,
    /// Its key.
    pub key: u64,
    /// The runner's layout code.
    pub layout: u16,
    /// Its DRAM slots.
    pub slots: Vec<u32>,
    /// Its parent's key.
    pub parent: Option<u64>,
    /// Its token ids.
    pub token_ids: Vec<u32>,
}

/// What [`recover`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Recovered {
    /// Registered namespaces, in registration order.
    pub namespaces: Vec<RecoveredNamespace>,
    /// Live READY pages, in journal order (oldest first).
    pub pages: Vec<RecoveredPage>,
    /// Slots held for peers' writes and not freed: never reuse them (sorted,
    /// distinct).
    pub held: Vec<u32>,
    /// The half ended in a record cut short (the one being written when the
    /// writer died); it was left out.
    pub torn_tail: bool,
    /// Complete records read from the active half.
    pub records: u64,
}

/// Why a journal is disabled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DisabledReason {
    /// The live state and one record did not fit in a half.
    #[error("the live state outgrew the journal")]
    Overflow,
    /// The runner turned the journal off.
    #[error("turned off by the runner")]
    Requested,
    /// A state code this version does not know (only read, never written as
    /// such: writing it writes its code, or `u32::MAX` for a code that is 0 or
    /// a known one).
    #[error("unknown reason code {0}")]
    Unknown(u32),
}

impl DisabledReason {
    fn code(self) -> u32 {
        match self {
            Self::Overflow => CODE_OVERFLOW,
            Self::Requested => CODE_REQUESTED,
            Self::Unknown(code) if code > CODE_REQUESTED => code,
            Self::Unknown(_) => u32::MAX,
        }
    }

    fn from_code(code: u32) -> Self {
        match code {
            CODE_OVERFLOW => Self::Overflow,
            CODE_REQUESTED => Self::Requested,
            other => Self::Unknown(other),
        }
    }
}

/// Why a record does not follow the journal's state (the writer refuses it
/// and leaves the region unchanged; the reader calls it corrupt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// A page names a namespace never registered.
    #[error("namespace {0:#018x} is not registered")]
    UnknownNamespace(u64),
    /// A namespace id is registered already with other values.
    #[error("namespace {0:#018x} is registered with other values")]
    NamespaceConflict(u64),
    /// A Ready names a page that is live already.
    #[error("page {key:#018x} of namespace {namespace:#018x} is live already")]
    PageLive {
        /// Its namespace.
        namespace: u64,
        /// Its key.
        key: u64,
    },
    /// A Removed names a page that is not live.
    #[error("page {key:#018x} of namespace {namespace:#018x} is not live")]
    PageNotLive {
        /// Its namespace.
        namespace: u64,
        /// Its key.
        key: u64,
    },
    /// A Ready or Held names a slot a live page owns or a hold keeps.
    #[error("slot {0} belongs to a live page or is held")]
    SlotInUse(u32),
    /// A Freed names a slot that is not held.
    #[error("slot {0} is not held")]
    SlotNotHeld(u32),
    /// A record names a slot twice.
    #[error("slot {0} appears twice in one record")]
    DuplicateSlot(u32),
    /// A Ready, Held or Freed names no slot.
    #[error("a record needs at least one slot")]
    NoSlots,
    /// A list or string is over its cap.
    #[error("{what}: {len} over the cap of {max}")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The cap.
        max: usize,
    },
}

impl Refusal {
    /// The refusal as a fixed phrase (for [`JournalError::Corrupt`]).
    fn why(self) -> &'static str {
        match self {
            Self::UnknownNamespace(_) => "a page names an unknown namespace",
            Self::NamespaceConflict(_) => "a namespace is registered twice with other values",
            Self::PageLive { .. } => "a Ready names a page that is live already",
            Self::PageNotLive { .. } => "a Removed names a page that is not live",
            Self::SlotInUse(_) => "a slot is owned by a live page or held",
            Self::SlotNotHeld(_) => "a Freed names a slot that is not held",
            Self::DuplicateSlot(_) => "a record names a slot twice",
            Self::NoSlots => "a record names no slot",
            Self::TooLong { .. } => "a list or string is over its cap",
        }
    }
}

/// Everything the journal can fail at.
///
/// Its own enum, not a variant of the crate's [`crate::Error`]: the runner
/// maps that one exhaustively, and a journal failure is never a refused
/// runner call (the runner degrades to serving without warm recovery).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// The region is too small for a journal.
    #[error("a journal needs at least {min} bytes, the region has {len}")]
    RegionTooSmall {
        /// The region's length.
        len: usize,
        /// The least accepted.
        min: usize,
    },
    /// A writer was handed a region of another length than it formatted.
    #[error("the region has {got} bytes, the journal was formatted for {expected}")]
    RegionLength {
        /// The region's length.
        got: usize,
        /// The formatted length.
        expected: usize,
    },
    /// The journal is disabled: appends are no-ops and a restart is cold.
    #[error("journal disabled: {0}")]
    Disabled(DisabledReason),
    /// The writer refused a record that does not follow its state; the region
    /// is unchanged.
    #[error("record refused: {0}")]
    Refused(Refusal),
    /// The bytes are not a journal this version can trust.
    #[error("corrupt journal at byte {offset}: {why}")]
    Corrupt {
        /// Byte offset in the region.
        offset: u64,
        /// What is wrong.
        why: &'static str,
    },
}

fn corrupt(offset: usize, why: &'static str) -> JournalError {
    JournalError::Corrupt {
        offset: u64::try_from(offset).unwrap_or(u64::MAX),
        why,
    }
}

/// A writer's counters and sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JournalStats {
    /// Records in the active half (what [`recover`] would count).
    pub records: u64,
    /// Records appended since format or resume (no-op duplicates not counted).
    pub appended: u64,
    /// Compactions (snapshots written and committed), the resume's included.
    pub compactions: u64,
    /// Bytes used in the active half.
    pub bytes_used: u64,
    /// Bytes of one half.
    pub half_bytes: u64,
    /// The active half's epoch.
    pub epoch: u64,
    /// Registered namespaces.
    pub namespaces: u64,
    /// Live pages.
    pub live_pages: u64,
    /// Held slots.
    pub held_slots: u64,
    /// Whether appends are refused.
    pub disabled: bool,
}

// ---------------------------------------------------------------------------
// Checksum

/// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), table-driven.
struct Crc32(u32);

// Const evaluation: an index out of range fails the build, never a run.
#[allow(clippy::indexing_slicing)]
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0usize;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

impl Crc32 {
    fn new() -> Self {
        Self(u32::MAX)
    }

    fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            let index = usize::from(self.0.to_le_bytes()[0] ^ b);
            self.0 = (self.0 >> 8) ^ CRC_TABLE.get(index).copied().unwrap_or(0);
        }
    }

    fn finish(self) -> u32 {
        !self.0
    }
}

fn frame_crc(epoch: u64, len: u32, seq: u64, payload: &[u8]) -> u32 {
    let mut crc = Crc32::new();
    crc.update(&epoch.to_le_bytes());
    crc.update(&len.to_le_bytes());
    crc.update(&seq.to_le_bytes());
    crc.update(payload);
    crc.finish()
}

fn slot_crc(half: Half, epoch: u64) -> u32 {
    let mut crc = Crc32::new();
    crc.update(b"KVCRSLOT");
    crc.update(&[half.byte()]);
    crc.update(&epoch.to_le_bytes());
    crc.finish()
}

// ---------------------------------------------------------------------------
// Geometry

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    Zero,
    One,
}

impl Half {
    fn other(self) -> Self {
        match self {
            Self::Zero => Self::One,
            Self::One => Self::Zero,
        }
    }

    fn byte(self) -> u8 {
        match self {
            Self::Zero => 0,
            Self::One => 1,
        }
    }

    fn slot_offset(self) -> usize {
        match self {
            Self::Zero => OFF_SLOTS[0],
            Self::One => OFF_SLOTS[1],
        }
    }
}

/// Bytes of one half of a region of `len` bytes.
fn half_len(len: usize) -> usize {
    (len.saturating_sub(HEADER_LEN) / 2) & !7
}

fn half_start(half: Half, half_len: usize) -> usize {
    match half {
        Half::Zero => HEADER_LEN,
        Half::One => HEADER_LEN + half_len,
    }
}

const fn align8(n: usize) -> usize {
    (n + 7) & !7
}

/// Bytes a record of `payload` bytes takes in a half.
const fn frame_len(payload: usize) -> usize {
    FRAME_HEADER_LEN + align8(payload)
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_le_bytes(b))
}

fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let b: [u8; 8] = bytes.get(at..at.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

// ---------------------------------------------------------------------------
// Encoding

/// A record's fields, borrowed from a [`JournalRecord`] or from the mirror.
#[derive(Debug, Clone, Copy)]
enum View<'a> {
    Namespace {
        id: u64,
        compat: u64,
        lora_name: Option<&'a str>,
        cache_salt: Option<&'a str>,
    },
    Ready {
        namespace: u64,
        key: u64,
        layout: u16,
        slots: &'a [u32],
        parent: Option<u64>,
        token_ids: &'a [u32],
    },
    Removed {
        namespace: u64,
        key: u64,
    },
    Held(&'a [u32]),
    Freed(&'a [u32]),
}

impl JournalRecord {
    fn view(&self) -> View<'_> {
        match self {
            Self::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => View::Namespace {
                id: *id,
                compat: *compat,
                lora_name: lora_name.as_deref(),
                cache_salt: cache_salt.as_deref(),
            },
            Self::Ready {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            } => View::Ready {
                namespace: *namespace,
                key: *key,
                layout: *layout,
                slots,
                parent: *parent,
                token_ids,
            },
            Self::Removed { namespace, key } => View::Removed {
                namespace: *namespace,
                key: *key,
            },
            Self::Held { slots } => View::Held(slots),
            Self::Freed { slots } => View::Freed(slots),
        }
    }
}

impl RecoveredNamespace {
    fn view(&self) -> View<'_> {
        View::Namespace {
            id: self.id,
            compat: self.compat,
            lora_name: self.lora_name.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
        }
    }
}

impl RecoveredPage {
    fn view(&self) -> View<'_> {
        View::Ready {
            namespace: self.namespace,
            key: self.key,
            layout: self.layout,
            slots: &self.slots,
            parent: self.parent,
            token_ids: &self.token_ids,
        }
    }
}

fn opt_str_len(s: Option<&str>) -> usize {
    s.map_or(1, |s| 1 + 4 + s.len())
}

fn put_opt_str(buf: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => buf.push(0),
        Some(s) => {
            buf.push(1);
            buf.extend_from_slice(&len_u32(s.len()).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }
    }
}

fn put_u32s(buf: &mut Vec<u8>, values: &[u32]) {
    buf.extend_from_slice(&len_u32(values.len()).to_le_bytes());
    for v in values {
        buf.extend_from_slice(&v.to_le_bytes());
    }
}

impl View<'_> {
    /// Bytes of the payload [`Self::encode`] writes.
    fn payload_len(&self) -> usize {
        match self {
            Self::Namespace {
                lora_name,
                cache_salt,
                ..
            } => 1 + 8 + 8 + opt_str_len(*lora_name) + opt_str_len(*cache_salt),
            Self::Ready {
                slots,
                parent,
                token_ids,
                ..
            } => {
                1 + 8
                    + 8
                    + 2
                    + 1
                    + parent.map_or(0, |_| 8)
                    + 4
                    + 4 * slots.len()
                    + 4
                    + 4 * token_ids.len()
            }
            Self::Removed { .. } => 1 + 8 + 8,
            Self::Held(slots) | Self::Freed(slots) => 1 + 4 + 4 * slots.len(),
        }
    }

    fn encode(&self, buf: &mut Vec<u8>) {
        match self {
            Self::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => {
                buf.push(TAG_NAMESPACE);
                buf.extend_from_slice(&id.to_le_bytes());
                buf.extend_from_slice(&compat.to_le_bytes());
                put_opt_str(buf, *lora_name);
                put_opt_str(buf, *cache_salt);
            }
            Self::Ready {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            } => {
                buf.push(TAG_READY);
                buf.extend_from_slice(&namespace.to_le_bytes());
                buf.extend_from_slice(&key.to_le_bytes());
                buf.extend_from_slice(&layout.to_le_bytes());
                match parent {
                    None => buf.push(0),
                    Some(p) => {
                        buf.push(1);
                        buf.extend_from_slice(&p.to_le_bytes());
                    }
                }
                put_u32s(buf, slots);
                put_u32s(buf, token_ids);
            }
            Self::Removed { namespace, key } => {
                buf.push(TAG_REMOVED);
                buf.extend_from_slice(&namespace.to_le_bytes());
                buf.extend_from_slice(&key.to_le_bytes());
            }
            Self::Held(slots) => {
                buf.push(TAG_HELD);
                put_u32s(buf, slots);
            }
            Self::Freed(slots) => {
                buf.push(TAG_FREED);
                put_u32s(buf, slots);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Decoding

/// A cursor over untrusted payload bytes; every read is bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

const TRUNCATED: &str = "a record's payload is truncated";

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        let end = self.pos.checked_add(n).ok_or(TRUNCATED)?;
        let out = self.bytes.get(self.pos..end).ok_or(TRUNCATED)?;
        self.pos = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, &'static str> {
        self.take(1)?.first().copied().ok_or(TRUNCATED)
    }

    fn u16(&mut self) -> Result<u16, &'static str> {
        let b: [u8; 2] = self.take(2)?.try_into().map_err(|_| TRUNCATED)?;
        Ok(u16::from_le_bytes(b))
    }

    fn u32(&mut self) -> Result<u32, &'static str> {
        let b: [u8; 4] = self.take(4)?.try_into().map_err(|_| TRUNCATED)?;
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, &'static str> {
        let b: [u8; 8] = self.take(8)?.try_into().map_err(|_| TRUNCATED)?;
        Ok(u64::from_le_bytes(b))
    }

    fn flag(&mut self) -> Result<bool, &'static str> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err("an option flag is neither 0 nor 1"),
        }
    }

    /// A count-prefixed list of at most `max` u32s, allocated only once the
    /// bytes are known to be there.
    fn u32s(&mut self, max: usize) -> Result<Vec<u32>, &'static str> {
        let count = usize::try_from(self.u32()?).map_err(|_| "a list is over its cap")?;
        if count > max {
            return Err("a list is over its cap");
        }
        let bytes = self.take(count.checked_mul(4).ok_or(TRUNCATED)?)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| <[u8; 4]>::try_from(c).map_or(0, u32::from_le_bytes))
            .collect())
    }

    fn opt_str(&mut self) -> Result<Option<String>, &'static str> {
        if !self.flag()? {
            return Ok(None);
        }
        let len = usize::try_from(self.u32()?).map_err(|_| "a string is over its cap")?;
        if len > MAX_STRING {
            return Err("a string is over its cap");
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map(Some)
            .map_err(|_| "a string is not UTF-8")
    }

    fn opt_u64(&mut self) -> Result<Option<u64>, &'static str> {
        if self.flag()? {
            Ok(Some(self.u64()?))
        } else {
            Ok(None)
        }
    }
}

fn decode(payload: &[u8]) -> Result<JournalRecord, &'static str> {
    let mut r = Reader {
        bytes: payload,
        pos: 0,
    };
    let record = match r.u8()? {
        TAG_NAMESPACE => JournalRecord::Namespace {
            id: r.u64()?,
            compat: r.u64()?,
            lora_name: r.opt_str()?,
            cache_salt: r.opt_str()?,
        },
        TAG_READY => JournalRecord::Ready {
            namespace: r.u64()?,
            key: r.u64()?,
            layout: r.u16()?,
            parent: r.opt_u64()?,
            slots: r.u32s(MAX_SLOTS)?,
            token_ids: r.u32s(MAX_TOKEN_IDS)?,
        },
        TAG_REMOVED => JournalRecord::Removed {
            namespace: r.u64()?,
            key: r.u64()?,
        },
        TAG_HELD => JournalRecord::Held {
            slots: r.u32s(MAX_SLOTS)?,
        },
        TAG_FREED => JournalRecord::Freed {
            slots: r.u32s(MAX_SLOTS)?,
        },
        _ => return Err("unknown record tag"),
    };
    if r.pos != payload.len() {
        return Err("a record's payload has trailing bytes");
    }
    Ok(record)
}

// ---------------------------------------------------------------------------
// Live state (the writer's mirror, and what the reader rebuilds)

#[derive(Debug, Clone, Default)]
struct Live {
    /// In registration order.
    namespaces: Vec<RecoveredNamespace>,
    /// Id → index in `namespaces`.
    namespace_index: HashMap<u64, usize>,
    /// (namespace, key) → (order, page).
    pages: HashMap<(u64, u64), (u64, RecoveredPage)>,
    /// Journal order → (namespace, key).
    order: BTreeMap<u64, (u64, u64)>,
    next_order: u64,
    /// Slots owned by live pages.
    page_slots: HashSet<u32>,
    /// Held slots.
    held: BTreeSet<u32>,
}

fn cap(what: &'static str, len: usize, max: usize) -> Result<(), Refusal> {
    if len > max {
        return Err(Refusal::TooLong { what, len, max });
    }
    Ok(())
}

fn slot_list(slots: &[u32]) -> Result<(), Refusal> {
    if slots.is_empty() {
        return Err(Refusal::NoSlots);
    }
    cap("slots", slots.len(), MAX_SLOTS)?;
    let mut seen = HashSet::with_capacity(slots.len());
    for &slot in slots {
        if !seen.insert(slot) {
            return Err(Refusal::DuplicateSlot(slot));
        }
    }
    Ok(())
}

impl Live {
    /// Whether `record` may follow this state: `Ok(true)` when applying it
    /// changes the state, `Ok(false)` for a namespace registered already with
    /// the same values.
    fn check(&self, record: &JournalRecord) -> Result<bool, Refusal> {
        match record {
            JournalRecord::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => {
                cap(
                    "lora_name",
                    lora_name.as_ref().map_or(0, String::len),
                    MAX_STRING,
                )?;
                cap(
                    "cache_salt",
                    cache_salt.as_ref().map_or(0, String::len),
                    MAX_STRING,
                )?;
                match self
                    .namespace_index
                    .get(id)
                    .and_then(|&i| self.namespaces.get(i))
                {
                    None => Ok(true),
                    Some(ns)
                        if ns.compat == *compat
                            && ns.lora_name == *lora_name
                            && ns.cache_salt == *cache_salt =>
                    {
                        Ok(false)
                    }
                    Some(_) => Err(Refusal::NamespaceConflict(*id)),
                }
            }
            JournalRecord::Ready {
                namespace,
                key,
                slots,
                token_ids,
                ..
            } => {
                if !self.namespace_index.contains_key(namespace) {
                    return Err(Refusal::UnknownNamespace(*namespace));
                }
                if self.pages.contains_key(&(*namespace, *key)) {
                    return Err(Refusal::PageLive {
                        namespace: *namespace,
                        key: *key,
                    });
                }
                cap("token_ids", token_ids.len(), MAX_TOKEN_IDS)?;
                slot_list(slots)?;
                self.all_free(slots)?;
                Ok(true)
            }
            JournalRecord::Removed { namespace, key } => {
                if self.pages.contains_key(&(*namespace, *key)) {
                    Ok(true)
                } else {
                    Err(Refusal::PageNotLive {
                        namespace: *namespace,
                        key: *key,
                    })
                }
            }
            JournalRecord::Held { slots } => {
                slot_list(slots)?;
                self.all_free(slots)?;
                Ok(true)
            }
            JournalRecord::Freed { slots } => {
                slot_list(slots)?;
                match slots.iter().find(|s| !self.held.contains(s)) {
                    Some(&slot) => Err(Refusal::SlotNotHeld(slot)),
                    None => Ok(true),
                }
            }
        }
    }

    fn all_free(&self, slots: &[u32]) -> Result<(), Refusal> {
        match slots
            .iter()
            .find(|s| self.page_slots.contains(*s) || self.held.contains(s))
        {
            Some(&slot) => Err(Refusal::SlotInUse(slot)),
            None => Ok(()),
        }
    }

    /// Applies a record [`Self::check`] accepted.
    fn apply(&mut self, record: JournalRecord) {
        match record {
            JournalRecord::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => {
                if !self.namespace_index.contains_key(&id) {
                    self.namespace_index.insert(id, self.namespaces.len());
                    self.namespaces.push(RecoveredNamespace {
                        id,
                        compat,
                        lora_name,
                        cache_salt,
                    });
                }
            }
            JournalRecord::Ready {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            } => {
                self.page_slots.extend(slots.iter().copied());
                let order = self.next_order;
                self.next_order += 1;
                self.order.insert(order, (namespace, key));
                self.pages.insert(
                    (namespace, key),
                    (
                        order,
                        RecoveredPage {
                            namespace,
                            key,
                            layout,
                            slots,
                            parent,
                            token_ids,
                        },
                    ),
                );
            }
            JournalRecord::Removed { namespace, key } => {
                if let Some((order, page)) = self.pages.remove(&(namespace, key)) {
                    self.order.remove(&order);
                    for slot in &page.slots {
                        self.page_slots.remove(slot);
                    }
                }
            }
            JournalRecord::Held { slots } => self.held.extend(slots),
            JournalRecord::Freed { slots } => {
                for slot in &slots {
                    self.held.remove(slot);
                }
            }
        }
    }

    /// Checks and applies.
    fn push(&mut self, record: JournalRecord) -> Result<(), Refusal> {
        self.check(&record)?;
        self.apply(record);
        Ok(())
    }

    fn held_list(&self) -> Vec<u32> {
        self.held.iter().copied().collect()
    }

    /// The live pages, oldest first.
    fn pages_in_order(&self) -> impl Iterator<Item = &RecoveredPage> {
        self.order
            .values()
            .filter_map(|k| self.pages.get(k).map(|(_, page)| page))
    }

    /// Bytes a snapshot of this state takes in a half.
    fn snapshot_len(&self) -> usize {
        let namespaces: usize = self
            .namespaces
            .iter()
            .map(|ns| frame_len(ns.view().payload_len()))
            .sum();
        let held = self.held.len();
        let full = held / MAX_SLOTS;
        let rest = held % MAX_SLOTS;
        let held_len = full * frame_len(1 + 4 + 4 * MAX_SLOTS)
            + if rest > 0 {
                frame_len(1 + 4 + 4 * rest)
            } else {
                0
            };
        let pages: usize = self
            .pages_in_order()
            .map(|p| frame_len(p.view().payload_len()))
            .sum();
        namespaces + held_len + pages
    }

    fn from_recovered(recovered: &Recovered) -> Result<Self, Refusal> {
        let mut live = Self::default();
        for ns in &recovered.namespaces {
            live.push(JournalRecord::Namespace {
                id: ns.id,
                compat: ns.compat,
                lora_name: ns.lora_name.clone(),
                cache_salt: ns.cache_salt.clone(),
            })?;
        }
        let mut held = recovered.held.clone();
        held.sort_unstable();
        held.dedup();
        for chunk in held.chunks(MAX_SLOTS) {
            live.push(JournalRecord::Held {
                slots: chunk.to_vec(),
            })?;
        }
        for page in &recovered.pages {
            live.push(JournalRecord::Ready {
                namespace: page.namespace,
                key: page.key,
                layout: page.layout,
                slots: page.slots.clone(),
                parent: page.parent,
                token_ids: page.token_ids.clone(),
            })?;
        }
        Ok(live)
    }

    fn into_recovered(mut self, torn_tail: bool, records: u64) -> Recovered {
        let held = self.held_list();
        let pages = std::mem::take(&mut self.order)
            .into_values()
            .filter_map(|k| self.pages.remove(&k).map(|(_, page)| page))
            .collect();
        Recovered {
            namespaces: self.namespaces,
            pages,
            held,
            torn_tail,
            records,
        }
    }
}

// ---------------------------------------------------------------------------
// Reading

/// What a valid header says.
#[derive(Debug, Clone, Copy)]
struct Header {
    half_len: usize,
    active: Half,
    epoch: u64,
}

/// A commit slot's epoch, when the slot is valid.
fn slot_epoch(bytes: &[u8], half: Half) -> Option<u64> {
    let at = half.slot_offset();
    let epoch = read_u64(bytes, at)?;
    let crc = read_u32(bytes, at + 8)?;
    let reserved = read_u32(bytes, at + 12)?;
    (epoch >= 1 && reserved == 0 && crc == slot_crc(half, epoch)).then_some(epoch)
}

fn read_header(bytes: &[u8]) -> Result<Header, JournalError> {
    if bytes.len() < MIN_REGION_LEN {
        return Err(corrupt(0, "the region is smaller than a journal"));
    }
    if bytes.get(..MAGIC.len()) != Some(MAGIC.as_slice()) {
        return Err(corrupt(0, "bad magic"));
    }
    if read_u32(bytes, OFF_VERSION) != Some(VERSION) {
        return Err(corrupt(OFF_VERSION, "unsupported version"));
    }
    let length = read_u64(bytes, OFF_LENGTH).and_then(|l| usize::try_from(l).ok());
    if length != Some(bytes.len()) {
        return Err(corrupt(OFF_LENGTH, "the length differs from the region's"));
    }
    let half_len = half_len(bytes.len());
    let stored_half = read_u64(bytes, OFF_HALF).and_then(|l| usize::try_from(l).ok());
    if stored_half != Some(half_len) {
        return Err(corrupt(
            OFF_HALF,
            "the half length does not match the region",
        ));
    }
    match read_u32(bytes, OFF_STATE) {
        Some(STATE_OK) => {}
        Some(code) => return Err(JournalError::Disabled(DisabledReason::from_code(code))),
        None => return Err(corrupt(OFF_STATE, "no state word")),
    }
    let (active, epoch) = match (slot_epoch(bytes, Half::Zero), slot_epoch(bytes, Half::One)) {
        (None, None) => return Err(corrupt(OFF_SLOTS[0], "no valid commit slot")),
        (Some(e), None) => (Half::Zero, e),
        (None, Some(e)) => (Half::One, e),
        (Some(a), Some(b)) if a > b => (Half::Zero, a),
        (Some(a), Some(b)) if b > a => (Half::One, b),
        (Some(_), Some(_)) => return Err(corrupt(OFF_SLOTS[0], "both halves claim one epoch")),
    };
    Ok(Header {
        half_len,
        active,
        epoch,
    })
}

/// A complete frame at `at` in `half`.
struct Frame<'a> {
    seq: u64,
    payload: &'a [u8],
    /// Where the next frame starts.
    next: usize,
}

fn frame_at(half: &[u8], at: usize, epoch: u64) -> Option<Frame<'_>> {
    let len = read_u32(half, at)?;
    let crc = read_u32(half, at + 4)?;
    let seq = read_u64(half, at + 8)?;
    let n = usize::try_from(len).ok()?;
    if n == 0 || n > MAX_PAYLOAD {
        return None;
    }
    let start = at.checked_add(FRAME_HEADER_LEN)?;
    let payload = half.get(start..start.checked_add(n)?)?;
    if frame_crc(epoch, len, seq, payload) != crc {
        return None;
    }
    Some(Frame {
        seq,
        payload,
        next: at.checked_add(frame_len(n))?,
    })
}

/// Whether a complete frame in sequence at or after `expected` starts at an
/// 8-byte boundary after `from`.
fn later_frame(half: &[u8], from: usize, expected: u64, epoch: u64) -> bool {
    let most = u64::try_from(half.len() / FRAME_HEADER_LEN).unwrap_or(u64::MAX);
    let last = expected.saturating_add(most);
    (from + 8..half.len())
        .step_by(8)
        .filter(|&at| read_u64(half, at + 8).is_some_and(|s| s >= expected && s <= last))
        .any(|at| frame_at(half, at, epoch).is_some())
}

/// Reads a journal: the state its complete records describe.
///
/// `bytes` is the whole region the writer formatted (its length is checked
/// against the header's).
///
/// `Err(Disabled)` when the writer turned the journal off (a cold restart);
/// `Err(Corrupt)` when the bytes are not a journal this version can trust
/// (never for a journal whose writer was merely killed mid-append). Never
/// panics, and allocates no more than the input's size, whatever the bytes.
pub fn recover(bytes: &[u8]) -> Result<Recovered, JournalError> {
    let head = read_header(bytes)?;
    let base = half_start(head.active, head.half_len);
    let half = bytes
        .get(base..base + head.half_len)
        .ok_or_else(|| corrupt(base, "the active half is outside the region"))?;
    let mut live = Live::default();
    let mut at = 0usize;
    let mut expected = 1u64;
    let mut torn_tail = false;
    loop {
        match frame_at(half, at, head.epoch) {
            Some(frame) if frame.seq == expected => {
                let record = decode(frame.payload).map_err(|why| corrupt(base + at, why))?;
                live.push(record)
                    .map_err(|refusal| corrupt(base + at, refusal.why()))?;
                expected += 1;
                at = frame.next;
            }
            Some(_) => return Err(corrupt(base + at, "a record is out of sequence")),
            None => {
                let rest = half.get(at..).unwrap_or_default();
                if rest.iter().any(|&b| b != 0) {
                    if later_frame(half, at, expected, head.epoch) {
                        return Err(corrupt(
                            base + at,
                            "a damaged record is followed by complete ones",
                        ));
                    }
                    torn_tail = true;
                }
                break;
            }
        }
    }
    Ok(live.into_recovered(torn_tail, expected - 1))
}

// ---------------------------------------------------------------------------
// Writing

/// Where the writer's bytes go: the region (`[u8]`), or in tests a recorder
/// that keeps every write in order so a crash can be cut at any byte.
trait Region {
    fn bytes(&self) -> &[u8];
    fn put(&mut self, at: usize, bytes: &[u8]) -> Result<(), JournalError>;
    fn zero(&mut self, at: usize, len: usize) -> Result<(), JournalError>;
    /// Keeps the writes before it before the writes after it.
    fn fence(&mut self);
}

/// A write past the end of the region (`needed` bytes long at least).
fn outside(region_len: usize, needed: Option<usize>) -> JournalError {
    JournalError::RegionLength {
        got: region_len,
        expected: needed.unwrap_or(usize::MAX),
    }
}

impl Region for [u8] {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn put(&mut self, at: usize, bytes: &[u8]) -> Result<(), JournalError> {
        let len = self.len();
        let end = at.checked_add(bytes.len());
        self.get_mut(at..end.unwrap_or(usize::MAX))
            .ok_or_else(|| outside(len, end))?
            .copy_from_slice(bytes);
        Ok(())
    }

    fn zero(&mut self, at: usize, n: usize) -> Result<(), JournalError> {
        let len = self.len();
        let end = at.checked_add(n);
        self.get_mut(at..end.unwrap_or(usize::MAX))
            .ok_or_else(|| outside(len, end))?
            .fill(0);
        Ok(())
    }

    fn fence(&mut self) {
        // The stores of a process killed by a signal are those before the
        // instruction it was stopped at, so program order is crash order, as
        // long as the compiler keeps it.
        compiler_fence(Ordering::SeqCst);
    }
}

/// Writes one frame at `at`: the payload, then the header. Returns its length.
fn write_frame<R: Region + ?Sized>(
    region: &mut R,
    scratch: &mut Vec<u8>,
    at: usize,
    epoch: u64,
    seq: u64,
    view: View<'_>,
) -> Result<usize, JournalError> {
    scratch.clear();
    view.encode(scratch);
    let len = len_u32(scratch.len());
    let mut header = [0u8; FRAME_HEADER_LEN];
    header[..4].copy_from_slice(&len.to_le_bytes());
    header[4..8].copy_from_slice(&frame_crc(epoch, len, seq, scratch).to_le_bytes());
    header[8..].copy_from_slice(&seq.to_le_bytes());
    region.put(at + FRAME_HEADER_LEN, scratch)?;
    region.put(at, &header)?;
    // The padding is zero already: a half is zero past its last record.
    Ok(frame_len(scratch.len()))
}

fn write_slot<R: Region + ?Sized>(
    region: &mut R,
    half: Half,
    epoch: u64,
) -> Result<(), JournalError> {
    let mut slot = [0u8; SLOT_LEN];
    slot[..8].copy_from_slice(&epoch.to_le_bytes());
    slot[8..12].copy_from_slice(&slot_crc(half, epoch).to_le_bytes());
    region.put(half.slot_offset(), &slot)
}

/// The primary's side: appends records to a region and compacts it when a
/// half fills up.
///
/// It keeps its own mirror of the live state (namespaces, live pages by
/// `(namespace, key)`, held slots), which is what a compaction snapshots.
/// Every call takes the region: the same bytes each time (the runner owns one
/// mapping); a region of another length is refused.
#[derive(Debug, Clone)]
pub struct JournalWriter {
    /// The region's length.
    total: usize,
    /// One half's length.
    half: usize,
    active: Half,
    epoch: u64,
    /// Bytes used in the active half.
    cursor: usize,
    next_seq: u64,
    /// Per half, bytes from its start that may be nonzero.
    dirty: [usize; 2],
    live: Live,
    disabled: Option<DisabledReason>,
    compactions: u64,
    appended: u64,
    scratch: Vec<u8>,
}

impl JournalWriter {
    /// Formats `region` as an empty journal (zeroes it) and returns a writer.
    ///
    /// A region under [`MIN_REGION_LEN`] bytes is refused.
    pub fn format(region: &mut [u8]) -> Result<Self, JournalError> {
        Self::format_in(region)
    }

    /// Continues a recovered journal: writes `recovered`'s state (or any
    /// subset the runner kept: namespaces, held slots, pages) as a snapshot
    /// into the half that is not active and commits it, so a warm restart
    /// keeps journaling. If the region does not hold a valid journal (or a
    /// disabled one) it is formatted first.
    ///
    /// A crash during `resume` leaves the journal that was there (or, once
    /// formatting began, no journal); a state that does not fit in a half
    /// disables the journal (`Err(Disabled(Overflow))`), and an inconsistent
    /// one is refused before any byte is written.
    pub fn resume(region: &mut [u8], recovered: &Recovered) -> Result<Self, JournalError> {
        Self::resume_in(region, recovered)
    }

    /// Appends `record`.
    ///
    /// A record that does not follow the state ([`Refusal`]) is refused and
    /// the region left unchanged; a namespace registered already with the same
    /// values is a no-op. When the active half is full the journal compacts
    /// first; when even that does not fit it is disabled
    /// (`Err(Disabled(Overflow))`), as are all later appends.
    pub fn append(
        &mut self,
        region: &mut [u8],
        record: &JournalRecord,
    ) -> Result<(), JournalError> {
        self.append_in(region, Cow::Borrowed(record))
    }

    /// [`Self::append`] of a record the caller gives up (its mirror keeps it
    /// without a copy).
    pub fn append_owned(
        &mut self,
        region: &mut [u8],
        record: JournalRecord,
    ) -> Result<(), JournalError> {
        self.append_in(region, Cow::Owned(record))
    }

    /// Turns the journal off: the header's state says `Disabled(reason)`, so
    /// [`recover`] answers `Disabled` and a restart is cold; later appends are
    /// refused. Keeps the first reason when called again.
    pub fn disable(&mut self, region: &mut [u8], reason: DisabledReason) {
        self.disable_in(region, reason);
    }

    /// Whether appends are refused.
    pub fn is_disabled(&self) -> bool {
        self.disabled.is_some()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> JournalStats {
        let n = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        JournalStats {
            records: self.next_seq - 1,
            appended: self.appended,
            compactions: self.compactions,
            bytes_used: n(self.cursor),
            half_bytes: n(self.half),
            epoch: self.epoch,
            namespaces: n(self.live.namespaces.len()),
            live_pages: n(self.live.pages.len()),
            held_slots: n(self.live.held.len()),
            disabled: self.disabled.is_some(),
        }
    }

    fn format_in<R: Region + ?Sized>(region: &mut R) -> Result<Self, JournalError> {
        let total = region.bytes().len();
        if total < MIN_REGION_LEN {
            return Err(JournalError::RegionTooSmall {
                len: total,
                min: MIN_REGION_LEN,
            });
        }
        let half = half_len(total);
        // The header first, so a crash while formatting leaves no journal
        // rather than an old header over zeroed records.
        region.zero(0, HEADER_LEN)?;
        region.fence();
        region.zero(HEADER_LEN, total - HEADER_LEN)?;
        // Magic, version, state, region length, half length (OFF_*).
        let mut header = Vec::with_capacity(OFF_SLOTS[0]);
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&STATE_OK.to_le_bytes());
        header.extend_from_slice(&(total as u64).to_le_bytes());
        header.extend_from_slice(&(half as u64).to_le_bytes());
        region.put(0, &header)?;
        region.fence();
        write_slot(region, Half::Zero, 1)?;
        region.fence();
        Ok(Self {
            total,
            half,
            active: Half::Zero,
            epoch: 1,
            cursor: 0,
            next_seq: 1,
            dirty: [0, 0],
            live: Live::default(),
            disabled: None,
            compactions: 0,
            appended: 0,
            scratch: Vec::new(),
        })
    }

    fn resume_in<R: Region + ?Sized>(
        region: &mut R,
        recovered: &Recovered,
    ) -> Result<Self, JournalError> {
        let live = Live::from_recovered(recovered).map_err(JournalError::Refused)?;
        let total = region.bytes().len();
        if total < MIN_REGION_LEN {
            return Err(JournalError::RegionTooSmall {
                len: total,
                min: MIN_REGION_LEN,
            });
        }
        let mut writer = match read_header(region.bytes()) {
            // (An epoch this high was never written by a writer.)
            Ok(head) if head.epoch < u64::MAX / 2 => Self {
                total,
                half: head.half_len,
                active: head.active,
                epoch: head.epoch,
                // Nothing is appended to this half before the snapshot below
                // replaces it; what either half holds is unknown.
                cursor: head.half_len,
                next_seq: 1,
                dirty: [head.half_len, head.half_len],
                live: Live::default(),
                disabled: None,
                compactions: 0,
                appended: 0,
                scratch: Vec::new(),
            },
            Ok(_) | Err(_) => Self::format_in(region)?,
        };
        writer.live = live;
        if writer.live.snapshot_len() > writer.half {
            writer.disable_in(region, DisabledReason::Overflow);
            return Err(JournalError::Disabled(DisabledReason::Overflow));
        }
        writer.compact_in(region)?;
        Ok(writer)
    }

    fn append_in<R: Region + ?Sized>(
        &mut self,
        region: &mut R,
        record: Cow<'_, JournalRecord>,
    ) -> Result<(), JournalError> {
        let record_ref: &JournalRecord = &record;
        self.same_region(region)?;
        if let Some(reason) = self.disabled {
            return Err(JournalError::Disabled(reason));
        }
        if !self.live.check(record_ref).map_err(JournalError::Refused)? {
            return Ok(());
        }
        let view = record_ref.view();
        let need = frame_len(view.payload_len());
        if self.cursor.saturating_add(need) > self.half {
            if self.live.snapshot_len().saturating_add(need) > self.half {
                self.disable_in(region, DisabledReason::Overflow);
                return Err(JournalError::Disabled(DisabledReason::Overflow));
            }
            self.compact_in(region)?;
        }
        let at = half_start(self.active, self.half) + self.cursor;
        let written = write_frame(
            region,
            &mut self.scratch,
            at,
            self.epoch,
            self.next_seq,
            view,
        )?;
        region.fence();
        self.cursor += written;
        self.next_seq += 1;
        let cursor = self.cursor;
        let dirty = self.dirty_mut(self.active);
        *dirty = (*dirty).max(cursor);
        self.appended += 1;
        self.live.apply(record.into_owned());
        Ok(())
    }

    fn disable_in<R: Region + ?Sized>(&mut self, region: &mut R, reason: DisabledReason) {
        let reason = *self.disabled.get_or_insert(reason);
        // Only a region too short for a header can refuse this write, and
        // such a region was never formatted by this writer.
        let _ = region.put(OFF_STATE, &reason.code().to_le_bytes());
        region.fence();
    }

    /// Writes the mirror into the other half and commits it.
    fn compact_in<R: Region + ?Sized>(&mut self, region: &mut R) -> Result<(), JournalError> {
        let target = self.active.other();
        let start = half_start(target, self.half);
        let epoch = self.epoch + 1;
        region.zero(start, *self.dirty_mut(target))?;
        *self.dirty_mut(target) = 0;
        let mut at = 0usize;
        let mut seq = 1u64;
        for ns in &self.live.namespaces {
            at += write_frame(region, &mut self.scratch, start + at, epoch, seq, ns.view())?;
            seq += 1;
        }
        for chunk in self.live.held_list().chunks(MAX_SLOTS) {
            at += write_frame(
                region,
                &mut self.scratch,
                start + at,
                epoch,
                seq,
                View::Held(chunk),
            )?;
            seq += 1;
        }
        for page in self.live.pages_in_order() {
            at += write_frame(
                region,
                &mut self.scratch,
                start + at,
                epoch,
                seq,
                page.view(),
            )?;
            seq += 1;
        }
        *self.dirty_mut(target) = at;
        region.fence();
        // The flip.
        write_slot(region, target, epoch)?;
        region.fence();
        let old = self.active;
        self.active = target;
        self.epoch = epoch;
        self.cursor = at;
        self.next_seq = seq;
        self.compactions += 1;
        // A later damage to the new slot must not make the stale half active.
        region.zero(old.slot_offset(), SLOT_LEN)?;
        region.fence();
        Ok(())
    }

    fn dirty_mut(&mut self, half: Half) -> &mut usize {
        match half {
            Half::Zero => &mut self.dirty[0],
            Half::One => &mut self.dirty[1],
        }
    }

    fn same_region<R: Region + ?Sized>(&self, region: &R) -> Result<(), JournalError> {
        let got = region.bytes().len();
        if got != self.total {
            return Err(JournalError::RegionLength {
                got,
                expected: self.total,
            });
        }
        Ok(())
    }
}
