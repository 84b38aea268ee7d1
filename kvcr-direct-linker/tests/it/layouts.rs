//! Bad layouts and configurations from an engine are typed errors, checked
//! before anything is allocated or registered.

use kvcr_direct_linker::{DirectLinker, Error, KvLayout, KvMemory};
use kvcr_foundation::Incarnation;
use rstest::rstest;

use crate::fixture::config;

fn good() -> KvLayout {
    KvLayout {
        layers: 2,
        page_tokens: 16,
        kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
        device_pages: 4,
        tp_rank: 0,
        tp_size: 1,
        k_bases: vec![0x1000, 0x9000],
        v_bases: vec![0x11000, 0x19000],
    }
}

fn with(change: impl FnOnce(&mut KvLayout)) -> KvLayout {
    let mut layout = good();
    change(&mut layout);
    layout
}

#[rstest]
#[case::no_layers(with(|l| l.layers = 0), "layers")]
#[case::too_many_layers(with(|l| { l.layers = 257; l.k_bases = vec![0x1000; 257]; l.v_bases = vec![0x1000; 257]; }), "layers")]
#[case::zero_heads(with(|l| l.kv_heads = 0), "geometry")]
#[case::odd_dtype(with(|l| l.dtype_bytes = 3), "dtype_bytes")]
#[case::span_not_16_aligned(with(|l| { l.page_tokens = 1; l.kv_heads = 1; l.head_dim = 3; }), "geometry")]
#[case::rank_out_of_range(with(|l| { l.tp_rank = 2; l.tp_size = 2; }), "tp_rank")]
#[case::zero_tp(with(|l| l.tp_size = 0), "tp_rank")]
#[case::no_pages(with(|l| l.device_pages = 0), "device_pages")]
#[case::missing_base(with(|l| l.v_bases.pop().map(drop).unwrap_or(())), "k_bases/v_bases")]
#[case::null_base(with(|l| l.k_bases[0] = 0), "k_bases/v_bases")]
#[case::unaligned_base(with(|l| l.k_bases[1] = 0x9008), "k_bases/v_bases")]
#[case::overflowing_buffer(with(|l| l.v_bases[0] = u64::MAX - 15), "k_bases/v_bases")]
fn bad_layouts_are_typed_errors(#[case] layout: KvLayout, #[case] field: &str) {
    match layout.validate() {
        Err(Error::Layout { field: got, .. }) => assert_eq!(got, field),
        other => panic!("expected a layout error on {field}, got {other:?}"),
    }
    // The linker refuses it (before it allocates or registers anything:
    // validation is its first step).
    let cfg = config(layout, 4, Incarnation::from_raw(1).unwrap());
    // SAFETY: (test) refused before any address is used.
    let refused = unsafe { DirectLinker::new(cfg, KvMemory::Host) };
    assert!(matches!(refused, Err(Error::Layout { .. })));
}

#[test]
fn a_good_layout_passes_and_zero_store_pages_is_refused() {
    good().validate().unwrap();
    let cfg = config(good(), 0, Incarnation::from_raw(1).unwrap());
    // SAFETY: (test) refused before any address is used.
    let refused = unsafe { DirectLinker::new(cfg, KvMemory::Host) };
    assert!(matches!(
        refused,
        Err(Error::Layout {
            field: "store_pages",
            ..
        })
    ));
}

/// What the Python face asks the driver before it registers a tensor: a
/// device buffer passes whole; a range that runs past every mapping, host
/// memory and an address no allocation holds are layout errors (looked up,
/// never dereferenced). GPU only (`KVCR_TEST_GPU=1`).
#[test]
fn device_buffers_are_checked_against_the_driver() {
    if !crate::fixture::gpu_required() {
        return;
    }
    let device = crate::fixture::gpu();
    let buffer = kvcr_direct_linker::cuda::DeviceBuffer::allocate(&device, 1 << 20).unwrap();
    let (addr, len) = (buffer.address(), buffer.len() as u64);
    device.check_allocation(addr, len).unwrap();
    device.check_allocation(addr + 4096, len - 8192).unwrap();
    let host = vec![0u8; 4096];
    let refused = [
        (addr, 1 << 40),
        (host.as_ptr() as u64, 4096),
        (0x10, 16),
        (addr, u64::MAX),
    ];
    for (at, bytes) in refused {
        let error = device.check_allocation(at, bytes).unwrap_err();
        assert!(
            matches!(error, Error::Layout { .. }),
            "{at:#x}+{bytes}: {error}"
        );
    }
}
