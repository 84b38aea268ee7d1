//! The vLLM 0.33 `KVEventBatch` msgpack layout, hand-encoded (pure, no I/O).
//!
//! A batch is a msgpack **array** `[ts (float64), [events…], data_parallel_rank]`
//! (the third element is always present, `nil` when unset). Each event is a
//! msgpack **map** whose first key is `"type"`, followed by vLLM's fields in
//! declaration order; fields without a default are always written (even `nil`),
//! defaulted fields only when set (`omit_defaults`):
//!
//! * `BlockStored`: `type, block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id (nil unless the engine names an adapter by id),
//!   medium, lora_name`, then `ownership` for kvcr-owned pages and
//!   `cache_salt` for a salted tenant's pages (SGLang's field, which vLLM's
//!   class does not declare and Dynamo reads as the cache namespace);
//! * `BlockRemoved`: `type, block_hashes, medium` and then `ownership`;
//! * `AllBlocksCleared`: `type` and then `ownership` for a kvcr-owned barrier
//!   (an extra key vLLM's own class does not declare; msgspec and Dynamo ignore
//!   unknown keys, and it scopes the barrier to kvcr's inventory).
//!
//! Block hashes are msgpack unsigned integers (the `u64` form of [`BlockKey`]),
//! never bytes: Dynamo drops a whole batch whose hashes are bytes. Integers use
//! the smallest encoding and map headers are sized as msgspec sizes them
//! (`map16` for `BlockStored`, `fixmap` for the others), so the bytes equal
//! vLLM's own encoder's.
//!
//! [`BlockKey`]: kvcr_contracts::key::BlockKey

use kvcr_contracts::tier::{Medium, Owner};

/// One KV event as it goes on the wire.
#[derive(Debug, Clone, PartialEq)]
pub enum WireEvent {
    /// `BlockStored`.
    Stored {
        /// `block_hashes`, in chain order.
        hashes: Vec<u64>,
        /// `parent_block_hash`.
        parent: Option<u64>,
        /// `token_ids`: `hashes.len() * block_size` real tokens.
        token_ids: Vec<u32>,
        /// `block_size`.
        block_size: u32,
        /// `lora_name`.
        lora_name: Option<String>,
        /// `lora_id` (vLLM keeps the field, deprecated; Dynamo reads it).
        lora_id: Option<u64>,
        /// `cache_salt` (SGLang's field, which Dynamo honours; written only
        /// when set).
        cache_salt: Option<String>,
        /// `medium`.
        medium: Medium,
        /// Sets `ownership`.
        owner: Owner,
    },
    /// `BlockRemoved`.
    Removed {
        /// `block_hashes`.
        hashes: Vec<u64>,
        /// `medium`.
        medium: Medium,
        /// Sets `ownership`.
        owner: Owner,
    },
    /// `AllBlocksCleared`.
    Cleared {
        /// Sets `ownership`.
        owner: Owner,
    },
}

impl WireEvent {
    /// Block hashes this event carries (0 for a clear).
    pub fn block_count(&self) -> usize {
        match self {
            Self::Stored { hashes, .. } | Self::Removed { hashes, .. } => hashes.len(),
            Self::Cleared { .. } => 0,
        }
    }
}

/// How kvcr's ownership is put on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum OwnershipWire {
    /// vLLM 0.33's `ownership: "kvcr"` on every kvcr-owned event: Dynamo's
    /// CacheOwner residency domain (its state-agent `vllm_residency_v1`
    /// ingress). Dynamo 1.6.1's standalone indexer silently ignores such
    /// events (measured).
    #[default]
    Field,
    /// No `ownership` field: the stream itself is kvcr's (its own endpoint,
    /// registered as its own worker), and consumers that know only the
    /// worker domain, such as Dynamo 1.6.1's standalone indexer, index it.
    Stream,
}

/// One `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct WireBatch {
    /// `ts`: seconds since the Unix epoch (injected; the encoder reads no clock).
    pub ts: f64,
    /// `events`.
    pub events: Vec<WireEvent>,
    /// `data_parallel_rank`.
    pub dp_rank: Option<u32>,
    /// Whether kvcr-owned events carry `ownership`.
    pub ownership: OwnershipWire,
}

/// Appends the msgpack encoding of `batch` to `out`.
pub fn encode_batch(batch: &WireBatch, out: &mut Vec<u8>) {
    array_header(out, 3);
    out.push(0xcb);
    out.extend_from_slice(&batch.ts.to_bits().to_be_bytes());
    array_header(out, batch.events.len());
    for event in &batch.events {
        encode_event(event, batch.ownership, out);
    }
    match batch.dp_rank {
        Some(rank) => uint(out, u64::from(rank)),
        None => out.push(0xc0),
    }
}

/// The msgpack encoding of `batch`, in a fresh buffer.
pub fn encode_batch_to_vec(batch: &WireBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 96);
    encode_batch(batch, &mut out);
    out
}

fn ownership_of(owner: Owner, mode: OwnershipWire) -> Option<&'static str> {
    match mode {
        OwnershipWire::Field => owner.wire_ownership(),
        OwnershipWire::Stream => None,
    }
}

fn encode_event(event: &WireEvent, mode: OwnershipWire, out: &mut Vec<u8>) {
    match event {
        WireEvent::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            lora_id,
            cache_salt,
            medium,
            owner,
        } => {
            let ownership = ownership_of(*owner, mode);
            // vLLM's `BlockStored` has 15 fields besides the tag, so msgspec
            // reserves a `map16` header for it.
            map16_header(
                out,
                8 + usize::from(ownership.is_some()) + usize::from(cache_salt.is_some()),
            );
            str(out, "type");
            str(out, "BlockStored");
            str(out, "block_hashes");
            array_header(out, hashes.len());
            for &h in hashes {
                uint(out, h);
            }
            str(out, "parent_block_hash");
            match parent {
                Some(p) => uint(out, *p),
                None => out.push(0xc0),
            }
            str(out, "token_ids");
            array_header(out, token_ids.len());
            for &t in token_ids {
                uint(out, u64::from(t));
            }
            str(out, "block_size");
            uint(out, u64::from(*block_size));
            str(out, "lora_id");
            match lora_id {
                Some(id) => uint(out, *id),
                None => out.push(0xc0),
            }
            str(out, "medium");
            str(out, medium.as_str());
            str(out, "lora_name");
            match lora_name {
                Some(name) => str(out, name),
                None => out.push(0xc0),
            }
            if let Some(o) = ownership {
                str(out, "ownership");
                str(out, o);
            }
            if let Some(salt) = cache_salt {
                str(out, "cache_salt");
                str(out, salt);
            }
        }
        WireEvent::Removed {
            hashes,
            medium,
            owner,
        } => {
            let ownership = ownership_of(*owner, mode);
            fixmap_header(out, 3 + usize::from(ownership.is_some()));
            str(out, "type");
            str(out, "BlockRemoved");
            str(out, "block_hashes");
            array_header(out, hashes.len());
            for &h in hashes {
                uint(out, h);
            }
            str(out, "medium");
            str(out, medium.as_str());
            if let Some(o) = ownership {
                str(out, "ownership");
                str(out, o);
            }
        }
        WireEvent::Cleared { owner } => {
            let ownership = ownership_of(*owner, mode);
            fixmap_header(out, 1 + usize::from(ownership.is_some()));
            str(out, "type");
            str(out, "AllBlocksCleared");
            if let Some(o) = ownership {
                str(out, "ownership");
                str(out, o);
            }
        }
    }
}

/// Smallest unsigned encoding (positive fixint, uint8/16/32/64).
fn uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v <= 0xff {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= 0xffff {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn str(out: &mut Vec<u8>, s: &str) {
    let len = s.len();
    if len < 32 {
        out.push(0xa0 | len as u8);
    } else if len <= 0xff {
        out.extend_from_slice(&[0xd9, len as u8]);
    } else if len <= 0xffff {
        out.push(0xda);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

fn array_header(out: &mut Vec<u8>, len: usize) {
    if len < 16 {
        out.push(0x90 | len as u8);
    } else if len <= 0xffff {
        out.push(0xdc);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

/// msgspec sizes a struct's map header by the most keys the struct can have
/// (fields plus tag): a `fixmap` up to 15, else `map16`.
fn map16_header(out: &mut Vec<u8>, len: usize) {
    out.push(0xde);
    out.extend_from_slice(&(len as u16).to_be_bytes());
}

fn fixmap_header(out: &mut Vec<u8>, len: usize) {
    out.push(0x80 | len as u8);
}
