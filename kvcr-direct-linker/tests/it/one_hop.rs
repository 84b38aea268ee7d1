//! The one-hop route's CUDA side between two real processes (GPU only,
//! `KVCR_TEST_GPU=1`): this process allocates device memory and exports an
//! extent of it; a second process (this test binary again, running
//! [`import_process`]) imports the name and copies a pinned pattern into it
//! through its own copier. The parent then checks every byte of the
//! allocation: the spans hold the pattern, everything else is untouched
//! (so a refused copy wrote nothing).

use std::process::Command;

use kvcr_direct_linker::cuda::{Device, DeviceBuffer};
use kvcr_direct_linker::error::NameRefusal;
use kvcr_direct_linker::{CopyMode, CudaCopier, Error};
use kvcr_foundation::runner::{CopySpan, DeviceCopier, DeviceImport, PoolRange};

use crate::fixture::{gpu, gpu_required};

const CHILD_ENV: &str = "KVCR_ONE_HOP_EXPORT";
const CHILD_TEST: &str = "one_hop::import_process";
const DONE: &str = "KVCR-ONE-HOP DONE";

/// The parent's allocation, the extent it exports inside it, and the byte
/// everything outside the written spans keeps.
const ALLOCATION: usize = 1 << 20;
const OFFSET: u64 = 64 << 10;
const EXTENT: u64 = 256 << 10;
const UNTOUCHED: u8 = 0xa5;
/// The child's pinned pool.
const POOL: usize = 1 << 20;

/// The pool's byte at `at` (no period a misplaced span could hide in).
fn pattern(at: u64) -> u8 {
    (at.wrapping_mul(31) ^ (at >> 8) ^ (at >> 16)).wrapping_add(7) as u8
}

/// The copies the child makes, as (pool offset, extent offset, bytes) per
/// key: aligned spans (the copier's batched paths), one unaligned span (its
/// per-span path), the last span ending exactly at the extent's end.
fn written() -> Vec<Vec<(u64, u64, u64)>> {
    vec![
        vec![(0, 0, 4096), (8192, 16384, 8192)],
        vec![(65536, 65536, 32768)],
        vec![(100_000, EXTENT - 1024, 1024)],
        vec![(3, 40_001, 77)],
    ]
}

/// A region of the extent no successful copy writes: the refused copies
/// aim their in-range spans here.
const SPARE: u64 = 200_000;

fn spans(keys: &[Vec<(u64, u64, u64)>], src_base: u64, dst_base: u64) -> Vec<Vec<CopySpan>> {
    keys.iter()
        .map(|key| {
            key.iter()
                .map(|&(src, dst, len)| CopySpan {
                    src: src_base + src,
                    dst: dst_base + dst,
                    len,
                })
                .collect()
        })
        .collect()
}

fn slices(keys: &[Vec<CopySpan>]) -> Vec<&[CopySpan]> {
    keys.iter().map(Vec::as_slice).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

fn refusal(outcome: Result<impl std::fmt::Debug, Error>) -> NameRefusal {
    match outcome {
        Err(Error::ExportName { refusal }) => refusal,
        other => panic!("not refused as a name: {other:?}"),
    }
}

/// The importing process's entry point (returns at once in a normal run):
/// pins a patterned pool, checks that bad names and bad spans are refused,
/// then copies `written()` into the parent's extent.
#[test]
fn import_process() {
    let Ok(name) = std::env::var(CHILD_ENV) else {
        return;
    };
    let name = unhex(&name);
    let device = Device::open(0).unwrap();
    let copier = CudaCopier::new(&device, CopyMode::best_for(&device).unwrap(), 2).unwrap();
    // A page-aligned pool inside a plain vector, patterned.
    let mut memory = vec![0u8; POOL + 4096];
    let skew = (4096 - memory.as_ptr() as usize % 4096) % 4096;
    let pool = &mut memory[skew..skew + POOL];
    for (at, byte) in pool.iter_mut().enumerate() {
        *byte = pattern(at as u64);
    }
    let range = PoolRange {
        base: pool.as_ptr() as u64,
        len: POOL as u64,
    };
    copier.attach(&[range]).unwrap();

    // Names a peer garbled or forged: refused, typed, nothing opened.
    let with = |at: usize, byte: u8| {
        let mut forged = name.clone();
        forged[at] ^= byte;
        forged
    };
    assert_eq!(
        refusal(copier.import(&with(0, 1), EXTENT)),
        NameRefusal::Magic
    );
    assert_eq!(
        refusal(copier.import(&with(4, 3), EXTENT)),
        NameRefusal::Version { got: 2 }
    );
    assert_eq!(
        refusal(copier.import(&name[..100], EXTENT)),
        NameRefusal::Size { got: 100 }
    );
    let oversized = [name.as_slice(), &[0u8; 200]].concat();
    assert_eq!(
        refusal(copier.import(&oversized, EXTENT)),
        NameRefusal::Size { got: 312 }
    );
    assert_eq!(
        refusal(copier.import(&name, EXTENT + 16)),
        NameRefusal::Length {
            named: EXTENT,
            expected: EXTENT + 16
        }
    );
    assert_eq!(
        refusal(copier.import(&with(90, 0xff), EXTENT)),
        NameRefusal::UnknownDevice
    );
    // An offset that puts the extent past the allocation: refused once
    // opened (and closed again: the good name opens below).
    let mut past = name.clone();
    past[72..80].copy_from_slice(&(1u64 << 40).to_le_bytes());
    match refusal(copier.import(&past, EXTENT)) {
        NameRefusal::PastAllocation { end, allocation } => {
            assert_eq!(end, (1 << 40) + EXTENT);
            assert!(allocation >= ALLOCATION as u64 && allocation < end);
        }
        other => panic!("{other:?}"),
    }
    assert!(copier.import_device(&with(0, 1), EXTENT).is_err());

    let import = copier.import(&name, EXTENT).unwrap();
    assert_eq!(DeviceImport::len(&import), EXTENT);
    let base = range.base;
    // A span past the extent, after one inside it: refused, nothing written.
    for bad in [
        (0, EXTENT - 512, 1024),
        (0, u64::MAX - 8, 16),
        (0, EXTENT, 16),
    ] {
        let keys = spans(&[vec![(0, SPARE, 4096)], vec![bad]], base, 0);
        let refused = import.copy(&slices(&keys));
        assert!(
            matches!(refused, Err(Error::OutsideImport { .. })),
            "{bad:?}: {refused:?}"
        );
        assert!(import.copy_into(&slices(&keys)).is_err());
    }
    // A source outside the attached pool: refused, nothing written.
    let keys = spans(&[vec![(0, SPARE, 4096), (POOL as u64, SPARE, 16)]], base, 0);
    assert!(matches!(
        import.copy(&slices(&keys)),
        Err(Error::UnattachedSpan { .. })
    ));

    // The copies: the first keys with the copier's default machinery, the
    // rest with the kernel, through the runner's seam.
    let keys = spans(&written(), base, 0);
    let all = slices(&keys);
    import.copy_into(&all[..2]).unwrap();
    copier.set_mode(CopyMode::Batched).unwrap();
    import.copy_into(&all[2..]).unwrap();
    drop(import);
    copier.detach(&[range]);
    let (errors, more) = device.take_drop_errors();
    assert!(errors.is_empty() && more == 0, "{errors:?}");
    println!("{DONE}");
}

/// A second process imports this one's export and copies into it: every
/// written byte is the pool's, every other byte untouched; bad names, bad
/// spans and this process's own export are refused (typed); the device
/// digest of what landed equals the CPU's xxh3 of it.
#[test]
fn a_peer_process_copies_into_the_exported_extent() {
    if !gpu_required() {
        return;
    }
    let device = gpu();
    let copier = CudaCopier::new(&device, CopyMode::best_for(&device).unwrap(), 2).unwrap();
    let buffer = DeviceBuffer::allocate(&device, ALLOCATION).unwrap();
    buffer.fill(UNTOUCHED).unwrap();
    let base = buffer.address() + OFFSET;
    let name = copier
        .export(base, EXTENT)
        .unwrap()
        .expect("legacy IPC shares cuMemAlloc");
    assert_eq!(
        copier.export_device(base, EXTENT).unwrap(),
        Some(name.clone())
    );
    // CUDA cannot open a handle in its own process: refused before trying.
    assert_eq!(
        refusal(copier.import(&name, EXTENT)),
        NameRefusal::OwnProcess
    );
    // A range over the allocation's end cannot be one handle; host memory
    // is no device memory at all.
    assert_eq!(copier.export(base, 1 << 40).unwrap(), None);
    let host = vec![0u8; 4096];
    assert!(matches!(
        copier.export(host.as_ptr() as u64, 4096),
        Err(Error::Layout { .. })
    ));

    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, hex(&name))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&child.stdout);
    assert!(
        child.status.success() && stdout.contains(DONE),
        "the importing process failed: {stdout}\n{}",
        String::from_utf8_lossy(&child.stderr)
    );

    let landed = buffer.read(0, ALLOCATION).unwrap();
    let mut expected = vec![UNTOUCHED; ALLOCATION];
    for &(src, dst, len) in written().iter().flatten() {
        for i in 0..len {
            expected[(OFFSET + dst + i) as usize] = pattern(src + i);
        }
    }
    let wrong: Vec<usize> = (0..ALLOCATION)
        .filter(|&i| landed[i] != expected[i])
        .collect();
    assert!(
        wrong.is_empty(),
        "{} bytes differ, first at {:?}",
        wrong.len(),
        wrong.first()
    );

    // What landed, hashed on the device: the CPU's xxh3 of the same bytes.
    let aligned = &written()[..3];
    let on_device = |keys: &[Vec<(u64, u64, u64)>]| -> Vec<Vec<CopySpan>> {
        let moved: Vec<Vec<(u64, u64, u64)>> = keys
            .iter()
            .map(|key| key.iter().map(|&(_, dst, len)| (dst, 0, len)).collect())
            .collect();
        spans(&moved, base, 0)
    };
    let keys = on_device(aligned);
    let digests = copier.digest_device(&slices(&keys)).unwrap().unwrap();
    for (key, digest) in aligned.iter().zip(&digests) {
        let bytes: Vec<u8> = key
            .iter()
            .flat_map(|&(_, dst, len)| {
                landed[(OFFSET + dst) as usize..(OFFSET + dst + len) as usize].to_vec()
            })
            .collect();
        assert_eq!(*digest, kvcr_foundation::sys::digest::digest_bytes(&bytes));
    }
    let via_seam = DeviceCopier::digest_device(&copier, &slices(&keys)).unwrap();
    assert_eq!(via_seam, Some(digests));
    // Spans that are not whole 1 KiB blocks are not hashed on the device.
    let ragged = on_device(&written()[3..]);
    assert_eq!(copier.digest_device(&slices(&ragged)).unwrap(), None);
    drop(buffer);
    let (errors, more) = device.take_drop_errors();
    assert!(errors.is_empty() && more == 0, "{errors:?}");
}
