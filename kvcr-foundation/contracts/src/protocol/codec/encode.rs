//! Writing peer control frames: [`FrameCodec::encode`] and the per-field writers.
//!
//! Every rule the decoder enforces is checked here before a byte is written, so
//! a refused message leaves the destination buffer untouched.

use bytes::{BufMut, BytesMut};

use super::validate::{check_device_regions, check_doorbell, check_regions, check_segments};
use super::{
    FrameCodec, KIND_ROUTE_PROOF, KIND_START_WRITE, KIND_TARGET_METADATA, KIND_TARGET_METADATA_ACK,
    KIND_WRITE_DONE, KIND_WRITE_LEAD_LANDED, KIND_WRITE_PROBE, KIND_WRITE_PROBE_ACK,
    KIND_WRITE_REFUSED, LEN_PREFIX, MAGIC, MAX_DEVICE_EXPORT, MAX_ELEMENTS_PER_WRITE,
    MAX_KEYS_PER_WRITE, MAX_RKEY, MAX_SPANS_PER_KEY, MAX_WORKER_ADDRESS, OUTCOME_COMPLETED,
    OUTCOME_COMPLETED_CHECKED_IN_COPY, OUTCOME_FAILED_NONTERMINAL, OUTCOME_FAILED_TERMINAL,
    VERSION, bound, frame, lead_within,
};
use crate::error::{FrameReason, Result};
use crate::incarnation::Incarnation;
use crate::protocol::{Body, ElementRuns, Header, Message, WriteOutcome};

impl FrameCodec {
    /// Appends one frame for `message` to `dst`. Refuses (and writes nothing)
    /// if the message breaks a bound or rule the decoder enforces.
    pub fn encode(&self, message: &Message, dst: &mut BytesMut) -> Result<()> {
        let mut body = BytesMut::with_capacity(64);
        body.put_u16(MAGIC);
        body.put_u8(VERSION);
        body.put_u8(kind_of(&message.body));
        put_header(&mut body, &message.header)?;
        put_body(&mut body, &message.body)?;
        if body.len() > self.max_frame_len {
            return Err(frame(FrameReason::TooLarge {
                len: body.len(),
                max: self.max_frame_len,
            }));
        }
        let len = u32::try_from(body.len()).map_err(|_| {
            frame(FrameReason::TooLarge {
                len: body.len(),
                max: self.max_frame_len,
            })
        })?;
        dst.reserve(LEN_PREFIX + body.len());
        dst.put_u32(len);
        dst.extend_from_slice(&body);
        Ok(())
    }

    /// Encodes one message into a fresh buffer.
    pub fn encode_to_vec(&self, message: &Message) -> Result<Vec<u8>> {
        let mut buf = BytesMut::new();
        self.encode(message, &mut buf)?;
        Ok(buf.to_vec())
    }
}

fn kind_of(body: &Body) -> u8 {
    match body {
        Body::TargetMetadata { .. } => KIND_TARGET_METADATA,
        Body::TargetMetadataAck { .. } => KIND_TARGET_METADATA_ACK,
        Body::StartWrite { .. } => KIND_START_WRITE,
        Body::WriteRefused { .. } => KIND_WRITE_REFUSED,
        Body::WriteDone { .. } => KIND_WRITE_DONE,
        Body::WriteProbe { .. } => KIND_WRITE_PROBE,
        Body::WriteProbeAck { .. } => KIND_WRITE_PROBE_ACK,
        Body::RouteProof { .. } => KIND_ROUTE_PROOF,
        Body::WriteLeadLanded { .. } => KIND_WRITE_LEAD_LANDED,
    }
}

fn put_str8(dst: &mut BytesMut, field: &'static str, s: &str) -> Result<()> {
    bound(field, s.len(), u8::MAX as usize)?;
    dst.put_u8(s.len() as u8);
    dst.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_bytes16(dst: &mut BytesMut, field: &'static str, b: &[u8], max: usize) -> Result<()> {
    bound(field, b.len(), max.min(u16::MAX as usize))?;
    dst.put_u16(b.len() as u16);
    dst.extend_from_slice(b);
    Ok(())
}

/// A key's elements as runs (`region:u32 regions:u16 index:u64`, after
/// their count), as [`ElementRuns`] holds them. `dests` holds at most
/// [`MAX_SPANS_PER_KEY`] elements (checked by the caller), so there are no
/// more runs than fit `u16`.
fn put_runs(dst: &mut BytesMut, dests: &ElementRuns) {
    let runs = dests.runs();
    dst.put_u16(u16::try_from(runs.len()).unwrap_or(u16::MAX));
    for run in runs {
        dst.put_u32(run.first().0);
        dst.put_u16(run.regions());
        dst.put_u64(run.index());
    }
}

fn put_opt_incarnation(dst: &mut BytesMut, inc: Option<Incarnation>) {
    match inc {
        None => dst.put_u8(0),
        Some(inc) => {
            dst.put_u8(1);
            dst.put_u128(inc.raw());
        }
    }
}

fn put_header(dst: &mut BytesMut, header: &Header) -> Result<()> {
    dst.put_u128(header.sender.raw());
    dst.put_u64(header.route_generation.0);
    put_str8(dst, "sender_endpoint", &header.sender_endpoint.to_string())
}

fn put_body(dst: &mut BytesMut, body: &Body) -> Result<()> {
    match body {
        Body::TargetMetadata {
            worker_address,
            regions,
            shared_memory,
            doorbell,
            device_regions,
        } => {
            if worker_address.is_empty() {
                return Err(frame(FrameReason::Empty("worker_address")));
            }
            put_bytes16(dst, "worker_address", worker_address, MAX_WORKER_ADDRESS)?;
            check_regions(regions)?;
            dst.put_u16(regions.len() as u16);
            for region in regions {
                dst.put_u32(region.id.0);
                put_str8(dst, "region label", &region.label)?;
                dst.put_u64(region.base);
                dst.put_u64(region.element_size);
                dst.put_u64(region.stride);
                dst.put_u64(region.count);
                put_bytes16(dst, "rkey", &region.rkey, MAX_RKEY)?;
            }
            match shared_memory {
                None => dst.put_u8(0),
                Some(shared) => {
                    check_segments(regions, &shared.segments)?;
                    dst.put_u8(1);
                    dst.extend_from_slice(&shared.boot_id);
                    dst.put_u64(shared.pid_namespace);
                    dst.put_u32(shared.pid);
                    dst.put_u16(shared.segments.len() as u16);
                    for segment in &shared.segments {
                        dst.put_u32(segment.region.0);
                        dst.put_u32(segment.fd);
                        dst.extend_from_slice(&segment.token);
                    }
                }
            }
            match doorbell {
                None => dst.put_u8(0),
                Some(doorbell) => {
                    check_doorbell(regions, doorbell)?;
                    dst.put_u8(1);
                    dst.put_u32(doorbell.region.0);
                    dst.extend_from_slice(&doorbell.key);
                }
            }
            check_device_regions(regions, device_regions)?;
            dst.put_u16(device_regions.len() as u16);
            for device in device_regions {
                dst.put_u32(device.id.0);
                dst.put_u64(device.base);
                dst.put_u64(device.element_size);
                dst.put_u64(device.stride);
                dst.put_u64(device.count);
                put_bytes16(dst, "device export", &device.export, MAX_DEVICE_EXPORT)?;
            }
        }
        Body::TargetMetadataAck {
            op_handle,
            one_copy,
            device,
        } => {
            match op_handle {
                None => dst.put_u8(0),
                Some(op) => {
                    dst.put_u8(1);
                    dst.put_u64(op.0);
                }
            }
            dst.put_u8(u8::from(*one_copy));
            dst.put_u8(u8::from(*device));
        }
        Body::StartWrite {
            op_handle,
            remaining_timeout_ms,
            source_incarnation,
            namespace,
            keys,
            destinations,
            lead_elements,
        } => {
            if *remaining_timeout_ms == 0 {
                return Err(frame(FrameReason::Zero("remaining_timeout_ms")));
            }
            if keys.len() != destinations.len() {
                return Err(frame(FrameReason::LengthMismatch {
                    keys: keys.len(),
                    destinations: destinations.len(),
                }));
            }
            if keys.is_empty() {
                return Err(frame(FrameReason::Empty("keys")));
            }
            bound("keys", keys.len(), MAX_KEYS_PER_WRITE)?;
            dst.put_u64(op_handle.0);
            dst.put_u32(*remaining_timeout_ms);
            put_opt_incarnation(dst, *source_incarnation);
            dst.put_u64(namespace.0);
            dst.put_u16(*lead_elements);
            dst.put_u32(keys.len() as u32);
            let mut elements = 0usize;
            for (key, dests) in keys.iter().zip(destinations) {
                if dests.is_empty() {
                    return Err(frame(FrameReason::Empty("destinations of a key")));
                }
                bound("destinations of a key", dests.len(), MAX_SPANS_PER_KEY)?;
                lead_within(*lead_elements, dests.len())?;
                elements += dests.len();
                bound("destinations of a write", elements, MAX_ELEMENTS_PER_WRITE)?;
                dst.put_u64(key.as_u64());
                put_runs(dst, dests);
            }
        }
        Body::WriteRefused { op_handle } => dst.put_u64(op_handle.0),
        Body::WriteDone { op_handle, outcome } => {
            dst.put_u64(op_handle.0);
            match outcome {
                WriteOutcome::Completed(completed) => {
                    let indices = completed.as_slice();
                    bound("completed indices", indices.len(), MAX_KEYS_PER_WRITE)?;
                    if indices.windows(2).any(|w| w.first() >= w.get(1)) {
                        return Err(frame(FrameReason::IndicesOrder));
                    }
                    dst.put_u8(if completed.is_checked_in_copy() {
                        OUTCOME_COMPLETED_CHECKED_IN_COPY
                    } else {
                        OUTCOME_COMPLETED
                    });
                    dst.put_u32(indices.len() as u32);
                    for index in indices {
                        dst.put_u32(*index);
                    }
                    let digests = completed.digests().unwrap_or_default();
                    dst.put_u32(digests.len() as u32);
                    for digest in digests {
                        dst.put_u64(*digest);
                    }
                }
                WriteOutcome::Failed { terminal: true } => dst.put_u8(OUTCOME_FAILED_TERMINAL),
                WriteOutcome::Failed { terminal: false } => {
                    dst.put_u8(OUTCOME_FAILED_NONTERMINAL);
                }
            }
        }
        Body::WriteProbe {
            op_handle,
            source_incarnation,
        } => {
            dst.put_u64(op_handle.0);
            put_opt_incarnation(dst, *source_incarnation);
        }
        Body::WriteProbeAck {
            op_handle,
            terminal,
            dead_incarnation,
        } => {
            dst.put_u64(op_handle.0);
            dst.put_u8(u8::from(*terminal));
            put_opt_incarnation(dst, *dead_incarnation);
        }
        Body::RouteProof { nonce } => dst.extend_from_slice(nonce),
        Body::WriteLeadLanded {
            op_handle,
            elements,
        } => {
            if *elements == 0 {
                return Err(frame(FrameReason::Zero("lead elements")));
            }
            dst.put_u64(op_handle.0);
            dst.put_u16(*elements);
        }
    }
    Ok(())
}
