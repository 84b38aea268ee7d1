//! The versioned, length-prefixed binary frame codec of the peer control protocol.
//!
//! ```text
//! frame   := len:u32be  body[len]
//! body    := magic:u16be=0x4B56 ("KV")  version:u8=8  kind:u8  header  fields(kind)
//! header  := incarnation:u128be  route_generation:u64be  endpoint:str8
//! str8    := n:u8 utf8[n]          bytes16 := n:u16be u8[n]
//! opt<T>  := 0 | 1 T               bool    := 0 | 1
//! list<T> := n:(u16be|u32be) T[n]  (width per field, see below)
//! ```
//!
//! Field layouts per kind (all integers big-endian):
//!
//! | kind | message | fields |
//! |---|---|---|
//! | 1 | `target_metadata` | `worker_address:bytes16, regions:list16<region>, shared_memory:opt<shared>, doorbell:opt<(region:u32, key:u8[32])>, device_regions:list16<device>` |
//! | 2 | `target_metadata_ack` | `op_handle:opt<u64>, one_copy:bool, device:bool` |
//! | 3 | `start_write` | `op:u64, remaining_ms:u32, source_inc:opt<u128>, namespace:u64, lead:u16, entries:list32<(key:u64, dests:list16<run>)>` (`lead` at most every key's destination count) |
//! | 4 | `write_refused` | `op:u64` |
//! | 5 | `write_done` | `op:u64, outcome:u8` (0 completed, 1 failed-terminal, 2 failed-nonterminal, 3 completed with each page checked in the source's copy), then `indices:list32<u32>, digests:list32<u64>` when completed (no digests, or one page digest per index; with 3, one per index) |
//! | 6 | `write_probe` | `op:u64, source_inc:opt<u128>` |
//! | 7 | `write_probe_ack` | `op:u64, terminal:bool, dead_inc:opt<u128>` |
//! | 8 | `route_proof` | `nonce:u8[32]` |
//! | 9 | `write_lead_landed` | `op:u64, elements:u16` |
//!
//! `run := region:u32 regions:u16 index:u64`: the elements `(region + i, index)`
//! for `i` in `0..regions` (`regions` at least 1), so a layer-first page, one
//! slot in each of a model's K and V regions, is one run (version 7 spent 12
//! bytes per element: 3.7 MB to seal and decode per restore of the seed's
//! workload). A key names at most [`MAX_SPANS_PER_KEY`] elements, a write at
//! most [`MAX_ELEMENTS_PER_WRITE`].
//! `region := id:u32 label:str8 base:u64 element_size:u64 stride:u64 count:u64 rkey:bytes16`.
//! `shared := boot_id:u8[16] pid_namespace:u64 pid:u32 segments:list16<(region:u32, fd:u32, token:u8[16])>`
//! (at most one segment per advertised region, each naming one of them; the
//! doorbell names an advertised region too).
//! `device := id:u32 base:u64 element_size:u64 stride:u64 count:u64 export:bytes16`
//! (ids distinct from each other and from the regions', extents as regions',
//! `export` of 1..=256 bytes).
//!
//! Decoding validates every field (bounds, UTF-8, endpoint grammar, non-zero
//! incarnations and timeouts, region extents, ascending indices, no trailing
//! bytes) and never allocates more than the frame's own length justifies,
//! except a `start_write`'s runs, whose elements are bounded per write.
//! Encoding applies the same rules, so a frame this codec writes is one it reads.
//!
//! Writing lives in `encode`, reading in `decode`, and the region rules both
//! apply in `validate`.

mod decode;
mod encode;
mod validate;

use crate::error::{Error, FrameReason, Result};

/// Frame magic: `"KV"`.
pub const MAGIC: u16 = 0x4B56;
/// The codec version this build writes and reads.
pub const VERSION: u8 = 8;
/// Default bound on one frame's length (after the length prefix).
pub const DEFAULT_MAX_FRAME_LEN: usize = 16 << 20;
/// Most keys in one `start_write` (and completed indices in one `write_done`).
pub const MAX_KEYS_PER_WRITE: usize = 1 << 16;
/// Most destination elements for one key (spans of one page).
pub const MAX_SPANS_PER_KEY: usize = 4096;
/// Most destination elements in one `start_write`, all keys together: what
/// a decoder allocates for a write's runs (16 MiB of elements, about what a
/// frame of the default length carried at 12 bytes an element).
pub const MAX_ELEMENTS_PER_WRITE: usize = 1 << 20;
/// Most regions in one advertisement.
pub const MAX_REGIONS: usize = 1024;
/// Largest packed UCX worker address.
pub const MAX_WORKER_ADDRESS: usize = 16 << 10;
/// Largest packed remote key.
pub const MAX_RKEY: usize = 4096;
/// Longest region label.
pub const MAX_LABEL: usize = 64;
/// Most device regions in one advertisement (a 64-layer model registers 128:
/// a K and a V per layer).
pub const MAX_DEVICE_REGIONS: usize = 1024;
/// Largest exported name of one device region.
pub const MAX_DEVICE_EXPORT: usize = 256;

const LEN_PREFIX: usize = 4;
/// magic + version + kind
const PREAMBLE: usize = 4;

const KIND_TARGET_METADATA: u8 = 1;
const KIND_TARGET_METADATA_ACK: u8 = 2;
const KIND_START_WRITE: u8 = 3;
const KIND_WRITE_REFUSED: u8 = 4;
const KIND_WRITE_DONE: u8 = 5;
const KIND_WRITE_PROBE: u8 = 6;
const KIND_WRITE_PROBE_ACK: u8 = 7;
const KIND_ROUTE_PROOF: u8 = 8;
const KIND_WRITE_LEAD_LANDED: u8 = 9;

const OUTCOME_COMPLETED: u8 = 0;
const OUTCOME_FAILED_TERMINAL: u8 = 1;
const OUTCOME_FAILED_NONTERMINAL: u8 = 2;
const OUTCOME_COMPLETED_CHECKED_IN_COPY: u8 = 3;

/// Encoder and streaming decoder with a configurable frame bound.
#[derive(Debug, Clone, Copy)]
pub struct FrameCodec {
    max_frame_len: usize,
}

impl Default for FrameCodec {
    fn default() -> Self {
        Self {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
        }
    }
}

impl FrameCodec {
    /// A codec refusing frames longer than `max_frame_len` bytes.
    pub fn new(max_frame_len: usize) -> Self {
        Self {
            max_frame_len: max_frame_len.min(u32::MAX as usize),
        }
    }

    /// The frame bound.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }
}

fn frame(reason: FrameReason) -> Error {
    Error::frame(reason)
}

/// Refuses a `start_write` whose `lead_elements` exceed a key's
/// destination count (shared by encode and decode).
fn lead_within(lead: u16, destinations: usize) -> Result<()> {
    bound("lead elements", usize::from(lead), destinations)
}

/// Refuses a list or byte string longer than its bound (shared by encode and decode).
fn bound(field: &'static str, count: usize, max: usize) -> Result<()> {
    if count > max {
        return Err(frame(FrameReason::Bound { field, count, max }));
    }
    Ok(())
}
