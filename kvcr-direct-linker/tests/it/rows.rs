//! The driver-batch copier's row copies on a real GPU (`KVCR_TEST_GPU=1`):
//! a group of spans with constant strides on both sides (consecutive slots)
//! moves as one 2D copy, anything else through the batches, and every byte
//! lands where its span says, in both directions, with nothing written
//! between the spans.

use kvcr_direct_linker::cuda::DeviceBuffer;
use kvcr_direct_linker::{CopyMode, CudaCopier};
use kvcr_foundation::runner::{CopySpan, DeviceCopier, PoolRange};
use rstest::rstest;

use crate::fixture::{gpu, gpu_required};

/// A page of the host pool: four 4 KiB spans (two layers, K and V).
const SPAN: u64 = 4096;
const SPANS: u64 = 4;
const PAGE: u64 = SPAN * SPANS;
/// Slots on each side.
const SLOTS: u64 = 32;
const UNTOUCHED: u8 = 0x5a;

fn pattern(at: u64) -> u8 {
    (at.wrapping_mul(131) ^ (at >> 9) ^ (at >> 17)).wrapping_add(3) as u8
}

/// Per key, its host slot and device slot. The device pool is span-major
/// (span `s` of slot `d` at `(s × SLOTS + d) × SPAN`), as a layer-first
/// engine pool is.
fn spans(pairs: &[(u64, u64)], host: u64, device: u64) -> Vec<Vec<CopySpan>> {
    pairs
        .iter()
        .map(|&(h, d)| {
            (0..SPANS)
                .map(|s| CopySpan {
                    src: host + h * PAGE + s * SPAN,
                    dst: device + (s * SLOTS + d) * SPAN,
                    len: SPAN,
                })
                .collect()
        })
        .collect()
}

fn consecutive(n: u64) -> Vec<(u64, u64)> {
    (0..n).map(|i| (i, 3 + i)).collect()
}

#[rstest]
#[case::one_run_per_span_index(consecutive(12), true, SPANS)]
#[case::rows_off(consecutive(12), false, 0)]
#[case::too_few_for_a_run(consecutive(3), true, 0)]
#[case::scattered(vec![(0, 9), (5, 2), (1, 30), (7, 7), (2, 0)], true, 0)]
#[case::run_and_strays([consecutive(6), vec![(20, 28), (11, 1)]].concat(), true, SPANS)]
fn strided_runs_move_as_row_copies_byte_exact(
    #[case] pairs: Vec<(u64, u64)>,
    #[case] row_copies: bool,
    #[case] want_rows: u64,
) {
    if !gpu_required() {
        return;
    }
    let device = gpu();
    if CopyMode::best_for(&device).unwrap() != CopyMode::DriverBatch {
        panic!("row copies belong to the driver-batch mode; this driver lacks it");
    }
    let copier = CudaCopier::new(&device, CopyMode::DriverBatch, 2).unwrap();
    copier.set_row_copies(row_copies);
    let len = (SLOTS * PAGE) as usize;
    let mut memory = vec![0u8; len + 4096];
    let skew = (4096 - memory.as_ptr() as usize % 4096) % 4096;
    let pool = &mut memory[skew..skew + len];
    for (at, byte) in pool.iter_mut().enumerate() {
        *byte = pattern(at as u64);
    }
    let host = pool.as_ptr() as u64;
    let range = PoolRange {
        base: host,
        len: len as u64,
    };
    copier.attach(&[range]).unwrap();
    let buffer = DeviceBuffer::allocate(&device, len).unwrap();
    buffer.fill(UNTOUCHED).unwrap();

    // Host → device.
    let keys = spans(&pairs, host, buffer.address());
    let slices: Vec<&[CopySpan]> = keys.iter().map(Vec::as_slice).collect();
    copier.copy(&slices).unwrap();
    let profile = copier.last_profile();
    assert_eq!(profile.row_copies, want_rows, "{profile:?}");
    assert_eq!(profile.bytes, pairs.len() as u64 * PAGE);
    let landed = buffer.read(0, len).unwrap();
    let mut expected = vec![UNTOUCHED; len];
    for &(h, d) in &pairs {
        for s in 0..SPANS {
            let at = ((s * SLOTS + d) * SPAN) as usize;
            for b in 0..SPAN {
                expected[at + b as usize] = pattern(h * PAGE + s * SPAN + b);
            }
        }
    }
    assert!(
        landed == expected,
        "device bytes differ from the spans' sources"
    );

    // Device → host, into a cleared pool: the same spans reversed.
    let pool = &mut memory[skew..skew + len];
    pool.fill(UNTOUCHED);
    let back: Vec<Vec<CopySpan>> = keys
        .iter()
        .map(|key| {
            key.iter()
                .map(|s| CopySpan {
                    src: s.dst,
                    dst: s.src,
                    len: s.len,
                })
                .collect()
        })
        .collect();
    let slices: Vec<&[CopySpan]> = back.iter().map(Vec::as_slice).collect();
    copier.copy(&slices).unwrap();
    assert_eq!(copier.last_profile().row_copies, want_rows);
    let pool = &memory[skew..skew + len];
    for (at, &byte) in pool.iter().enumerate() {
        let (slot, within) = (at as u64 / PAGE, at as u64 % PAGE);
        let want = if pairs.iter().any(|&(h, _)| h == slot) {
            pattern(at as u64)
        } else {
            UNTOUCHED
        };
        assert_eq!(byte, want, "host byte {at} (slot {slot} + {within})");
    }
    copier.detach(&[range]);
}
