//! The consumer side of the KV-event wire, for tools that follow a stream
//! (the demo's router, the e2e event tap, the HiCache example's router):
//! what each event of a `KVEventBatch` says about which block hashes a worker
//! holds (feature `decode`).
//!
//! Lenient where a router is lenient: extra keys are ignored and an event it
//! does not know is reported as [`EventKind::Unknown`] for the caller to skip
//! or refuse. Only a payload that is not a batch at all is an error. The
//! strict, byte-order check of what vLLM accepts lives in the publisher's
//! tests, not here.

use rmpv::Value;

/// What an event does to the set of hashes its stream advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// `BlockStored`: the hashes are held.
    Stored,
    /// `BlockRemoved`: the hashes are gone.
    Removed,
    /// `AllBlocksCleared`: nothing is held any more.
    AllCleared,
    /// Any other `type`, or an event that is not a map (the text says which).
    Unknown(String),
}

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedEvent {
    /// Its type.
    pub kind: EventKind,
    /// `block_hashes` (unsigned integers only; empty when absent).
    pub block_hashes: Vec<u64>,
    /// `ownership` is `"kvcr"`: the page lives in KVCR DRAM, not in the
    /// framework's tiers.
    pub kvcr_owned: bool,
}

/// Why a payload is not a `KVEventBatch`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack.
    #[error("the batch is not msgpack")]
    NotMsgpack,
    /// Not `[ts, [events...], dp_rank]`.
    #[error("the batch has no event list")]
    NoEventList,
}

/// Decodes the events of one batch payload (the third frame of a message).
pub fn decode_batch(payload: &[u8]) -> Result<Vec<DecodedEvent>, DecodeError> {
    let batch = rmpv::decode::read_value(&mut &payload[..]).map_err(|_| DecodeError::NotMsgpack)?;
    let events = batch
        .as_array()
        .and_then(|b| b.get(1))
        .and_then(Value::as_array)
        .ok_or(DecodeError::NoEventList)?;
    Ok(events.iter().map(decode_event).collect())
}

fn decode_event(event: &Value) -> DecodedEvent {
    let Some(map) = event.as_map() else {
        return DecodedEvent {
            kind: EventKind::Unknown("an event that is not a map".to_owned()),
            block_hashes: Vec::new(),
            kvcr_owned: false,
        };
    };
    let field = |name: &str| {
        map.iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v)
    };
    let kind = match field("type").and_then(Value::as_str) {
        Some("BlockStored") => EventKind::Stored,
        Some("BlockRemoved") => EventKind::Removed,
        Some("AllBlocksCleared") => EventKind::AllCleared,
        other => EventKind::Unknown(format!("event type {other:?}")),
    };
    let block_hashes = field("block_hashes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_u64)
        .collect();
    let kvcr_owned = field("ownership").and_then(Value::as_str) == Some("kvcr");
    DecodedEvent {
        kind,
        block_hashes,
        kvcr_owned,
    }
}

#[cfg(test)]
mod tests {
    use kvcr_contracts::tier::{Medium, Owner};

    use super::*;
    use crate::wire::{OwnershipWire, WireBatch, WireEvent, encode_batch_to_vec};

    /// What the publisher encodes, the decoder reads back: kinds, hashes in
    /// order, and ownership as the wire mode writes it.
    #[test]
    fn reads_back_what_the_publisher_encodes() {
        let events = vec![
            WireEvent::Stored {
                hashes: vec![1, u64::MAX, 7],
                parent: None,
                token_ids: vec![0; 3 * 4],
                block_size: 4,
                lora_name: None,
                lora_id: None,
                cache_salt: None,
                medium: Medium::CpuPinned,
                owner: Owner::Kvcr,
            },
            WireEvent::Removed {
                hashes: vec![7],
                medium: Medium::Gpu,
                owner: Owner::Framework,
            },
            WireEvent::Cleared { owner: Owner::Kvcr },
        ];
        let decode = |ownership| {
            decode_batch(&encode_batch_to_vec(&WireBatch {
                ts: 1.5,
                events: events.clone(),
                dp_rank: Some(0),
                ownership,
            }))
            .unwrap()
        };
        let field = decode(OwnershipWire::Field);
        let kinds: Vec<_> = field.iter().map(|e| e.kind.clone()).collect();
        assert_eq!(
            kinds,
            [EventKind::Stored, EventKind::Removed, EventKind::AllCleared]
        );
        assert_eq!(field[0].block_hashes, [1, u64::MAX, 7]);
        assert_eq!(field[1].block_hashes, [7]);
        assert!(field[2].block_hashes.is_empty());
        let owned: Vec<bool> = field.iter().map(|e| e.kvcr_owned).collect();
        assert_eq!(owned, [true, false, true]);
        // With the stream as the ownership domain, no event carries the field.
        assert!(decode(OwnershipWire::Stream).iter().all(|e| !e.kvcr_owned));
    }

    #[test]
    fn not_a_batch_is_an_error_and_an_unknown_event_is_reported() {
        assert_eq!(decode_batch(&[]), Err(DecodeError::NotMsgpack));
        assert_eq!(decode_batch(&[0x93]), Err(DecodeError::NotMsgpack));
        assert_eq!(decode_batch(&[0x01]), Err(DecodeError::NoEventList));
        // [0.0, [{"type": "Foo"}, 3], nil]
        let mut payload = vec![0x93, 0xcb];
        payload.extend_from_slice(&0f64.to_be_bytes());
        payload.extend_from_slice(&[0x92, 0x81, 0xa4]);
        payload.extend_from_slice(b"type");
        payload.push(0xa3);
        payload.extend_from_slice(b"Foo");
        payload.extend_from_slice(&[0x03, 0xc0]);
        let events = decode_batch(&payload).unwrap();
        assert_eq!(events.len(), 2);
        assert!(matches!(&events[0].kind, EventKind::Unknown(t) if t.contains("Foo")));
        assert!(matches!(&events[1].kind, EventKind::Unknown(t) if t.contains("not a map")));
    }
}
