//! The CRC-32 that seals every frame and commit slot.

use super::layout::Half;

/// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), table-driven.
pub(super) struct Crc32(u32);

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
    pub(super) fn new() -> Self {
        Self(u32::MAX)
    }

    pub(super) fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            let index = usize::from(self.0.to_le_bytes()[0] ^ b);
            self.0 = (self.0 >> 8) ^ CRC_TABLE.get(index).copied().unwrap_or(0);
        }
    }

    pub(super) fn finish(self) -> u32 {
        !self.0
    }
}

pub(super) fn frame_crc(epoch: u64, len: u32, seq: u64, payload: &[u8]) -> u32 {
    let mut crc = Crc32::new();
    crc.update(&epoch.to_le_bytes());
    crc.update(&len.to_le_bytes());
    crc.update(&seq.to_le_bytes());
    crc.update(payload);
    crc.finish()
}

pub(super) fn slot_crc(half: Half, epoch: u64) -> u32 {
    let mut crc = Crc32::new();
    crc.update(b"KVCRSLOT");
    crc.update(&[half.byte()]);
    crc.update(&epoch.to_le_bytes());
    crc.finish()
}
