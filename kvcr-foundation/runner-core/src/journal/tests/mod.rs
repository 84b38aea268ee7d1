//! Tests of the residency journal: round trips, compaction, overflow, damage,
//! resume, a byte-level golden, and crash images cut at every byte (a
//! scripted workload exhaustively, random workloads against a model).

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::codec::*;
use super::crc::*;
use super::layout::*;
use super::writer::*;
use super::*;

mod damage;
mod format;
mod props;
mod restart;
mod writer;

// ---------------------------------------------------------------------------
// Harness

/// A region that keeps every write in order, so a crash can be cut after any
/// byte of them (program order is what a killed writer leaves behind).
struct Recording {
    bytes: Vec<u8>,
    log: Vec<(usize, Vec<u8>)>,
    fences: usize,
}

impl Recording {
    fn new(bytes: Vec<u8>) -> Self {
        Self {
            bytes,
            log: Vec::new(),
            fences: 0,
        }
    }

    /// Bytes written, in all.
    fn written(&self) -> usize {
        self.log.iter().map(|(_, b)| b.len()).sum()
    }

    /// `pre` with the first `cut` written bytes applied.
    fn crash_image(&self, pre: &[u8], cut: usize) -> Vec<u8> {
        let mut image = pre.to_vec();
        let mut left = cut;
        for (at, bytes) in &self.log {
            let n = left.min(bytes.len());
            image[*at..*at + n].copy_from_slice(&bytes[..n]);
            left -= n;
            if left == 0 {
                break;
            }
        }
        image
    }

    /// Every distinct crash image, in order: `(cut, image)` for the cut of
    /// no byte and after each written byte that changed the image.
    fn each_crash_image(&self, pre: &[u8], mut visit: impl FnMut(usize, &[u8])) {
        let mut image = pre.to_vec();
        visit(0, &image);
        let mut cut = 0;
        for (at, bytes) in &self.log {
            for (i, &b) in bytes.iter().enumerate() {
                cut += 1;
                if image[at + i] != b {
                    image[at + i] = b;
                    visit(cut, &image);
                }
            }
        }
    }
}

impl Region for Recording {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn put(&mut self, at: usize, bytes: &[u8]) -> Result<(), JournalError> {
        self.bytes.as_mut_slice().put(at, bytes)?;
        self.log.push((at, bytes.to_vec()));
        Ok(())
    }

    fn zero(&mut self, at: usize, len: usize) -> Result<(), JournalError> {
        self.put(at, &vec![0; len])
    }

    fn fence(&mut self) {
        self.fences += 1;
    }
}

/// The state a journal should hold: what `recover` must give back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Model {
    namespaces: Vec<RecoveredNamespace>,
    pages: Vec<RecoveredPage>,
    held: BTreeSet<u32>,
}

impl Model {
    fn of(r: &Recovered) -> Self {
        Self {
            namespaces: r.namespaces.clone(),
            pages: r.pages.clone(),
            held: r.held.iter().copied().collect(),
        }
    }

    /// Applies a record the writer accepted.
    fn apply(&mut self, record: &JournalRecord) {
        match record.clone() {
            JournalRecord::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => {
                if !self.namespaces.iter().any(|n| n.id == id) {
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
            } => self.pages.push(RecoveredPage {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            }),
            JournalRecord::Removed { namespace, key } => self
                .pages
                .retain(|p| (p.namespace, p.key) != (namespace, key)),
            JournalRecord::Held { slots } => self.held.extend(slots),
            JournalRecord::Freed { slots } => {
                for s in slots {
                    self.held.remove(&s);
                }
            }
        }
    }

    fn used(&self) -> BTreeSet<u32> {
        let mut used = self.held.clone();
        for p in &self.pages {
            used.extend(p.slots.iter().copied());
        }
        used
    }

    fn free(&self, universe: u32) -> Vec<u32> {
        let used = self.used();
        (0..universe).filter(|s| !used.contains(s)).collect()
    }
}

fn namespace(id: u64) -> JournalRecord {
    JournalRecord::Namespace {
        id,
        compat: id * 3,
        lora_name: None,
        cache_salt: None,
    }
}

fn ready(ns: u64, key: u64, slots: &[u32]) -> JournalRecord {
    JournalRecord::Ready {
        namespace: ns,
        key,
        layout: 1,
        slots: slots.to_vec(),
        parent: key.checked_sub(1),
        token_ids: (0..8).map(|t| key as u32 * 8 + t).collect(),
    }
}

fn removed(ns: u64, key: u64) -> JournalRecord {
    JournalRecord::Removed { namespace: ns, key }
}

fn held(slots: &[u32]) -> JournalRecord {
    JournalRecord::Held {
        slots: slots.to_vec(),
    }
}

fn freed(slots: &[u32]) -> JournalRecord {
    JournalRecord::Freed {
        slots: slots.to_vec(),
    }
}

/// A formatted region of `len` bytes with `records` appended; the model too.
fn journal(len: usize, records: &[JournalRecord]) -> (Vec<u8>, JournalWriter, Model) {
    let mut region = vec![0u8; len];
    let mut writer = JournalWriter::format(&mut region).unwrap();
    let mut model = Model::default();
    for r in records {
        writer.append(&mut region, r).unwrap();
        model.apply(r);
    }
    (region, writer, model)
}

#[track_caller]
fn check(region: &[u8], model: &Model) -> Recovered {
    let r = recover(region).unwrap();
    assert_eq!(Model::of(&r), *model);
    assert!(!r.torn_tail, "a complete journal reads as torn");
    r
}

/// The active half's frames: (offset in the region, frame length).
fn frames(region: &[u8]) -> Vec<(usize, usize)> {
    let head = read_header(region).unwrap();
    let base = half_start(head.active, head.half_len);
    let half = &region[base..base + head.half_len];
    let mut at = 0;
    let mut out = Vec::new();
    while let Some(f) = frame_at(half, at, head.epoch) {
        out.push((base + at, f.next - at));
        at = f.next;
    }
    out
}

/// What every recovered state must satisfy, whatever the bytes were.
fn consistent(r: &Recovered) -> bool {
    let mut seen = BTreeSet::new();
    let held_sorted = r.held.windows(2).all(|w| w[0] < w[1]);
    let mut ok = held_sorted && r.held.iter().all(|s| seen.insert(*s));
    for p in &r.pages {
        ok &= !p.slots.is_empty() && p.slots.iter().all(|s| seen.insert(*s));
        ok &= r.namespaces.iter().any(|n| n.id == p.namespace);
    }
    ok
}

fn five_records() -> (Vec<u8>, Model) {
    let (region, _, model) = journal(
        4096,
        &[
            namespace(1),
            ready(1, 1, &[1]),
            ready(1, 2, &[2]),
            removed(1, 1),
            ready(1, 3, &[1]),
        ],
    );
    (region, model)
}
