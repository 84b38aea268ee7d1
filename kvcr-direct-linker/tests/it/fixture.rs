//! Fixtures: a direct linker over a KV pool in host memory (copied by the
//! runner's copy thread) or on a GPU (copied by the CUDA copier).

use std::sync::Arc;
use std::time::Duration;

use kvcr_direct_linker::cuda::{Device, DeviceBuffer};
use kvcr_direct_linker::{
    CopyMode, CudaCopier, DirectLinker, DirectLinkerConfig, KvLayout, KvMemory,
};
use kvcr_foundation::Incarnation;
use kvcr_linker_contracts::conformance::{FixtureSpec, LinkerFixture};
use kvcr_linker_contracts::{DeviceSlot, LinkerEvent};

/// Whether the GPU tests must run (and fail without a GPU).
pub(crate) fn gpu_required() -> bool {
    std::env::var("KVCR_TEST_GPU").is_ok_and(|v| v == "1")
}

/// Opens GPU 0, or panics saying why (only called when the GPU is required).
pub(crate) fn gpu() -> Arc<Device> {
    Device::open(0).expect("KVCR_TEST_GPU=1 but no usable GPU")
}

/// A small geometry whose page is `page_bytes`: two layers, so a page is four
/// 16-byte-multiple spans.
pub(crate) fn layout_for(page_bytes: usize, device_pages: u32) -> KvLayout {
    assert_eq!(page_bytes % 64, 0, "pages of the suite are multiples of 64");
    KvLayout {
        layers: 2,
        page_tokens: 1,
        kv_heads: 1,
        head_dim: (page_bytes / 8) as u32,
        dtype_bytes: 2,
        device_pages,
        tp_rank: 0,
        tp_size: 1,
        k_bases: Vec::new(),
        v_bases: Vec::new(),
    }
}

/// Where the fixture's KV buffers live.
pub(crate) enum Buffers {
    Host(Vec<Box<[u8]>>),
    Cuda(Vec<DeviceBuffer>),
}

/// A linker plus its engine-side KV pool. Field order: the linker drops
/// before the buffers it has registered.
pub(crate) struct Fixture {
    pub(crate) linker: DirectLinker,
    pub(crate) buffers: Buffers,
    pub(crate) layout: KvLayout,
}

impl Fixture {
    /// Host-resident pool.
    pub(crate) fn host(layout: KvLayout, store_pages: u32, incarnation: Incarnation) -> Self {
        let span = layout.span_bytes() as usize * layout.device_pages as usize;
        let mut buffers: Vec<Box<[u8]>> = (0..layout.spans_per_page())
            .map(|_| vec![0u8; span].into_boxed_slice())
            .collect();
        let mut layout = layout;
        let bases: Vec<u64> = buffers.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
        layout.k_bases = bases.iter().step_by(2).copied().collect();
        layout.v_bases = bases.iter().skip(1).step_by(2).copied().collect();
        let config = config(layout.clone(), store_pages, incarnation);
        // SAFETY: (test) the buffers live in the fixture and drop after the
        // linker; tests touch a slot only between landed transfers.
        let linker = unsafe { DirectLinker::new(config, KvMemory::Host) }.unwrap();
        Self {
            linker,
            buffers: Buffers::Host(buffers),
            layout,
        }
    }

    /// GPU-resident pool on `device`, copied by a copier in `mode`.
    pub(crate) fn cuda(
        device: &Arc<Device>,
        mode: CopyMode,
        layout: KvLayout,
        store_pages: u32,
        incarnation: Incarnation,
    ) -> Self {
        let span = layout.span_bytes() as usize * layout.device_pages as usize;
        let buffers: Vec<DeviceBuffer> = (0..layout.spans_per_page())
            .map(|_| {
                let buffer = DeviceBuffer::allocate(device, span).unwrap();
                buffer.write(0, &vec![0u8; span]).unwrap();
                buffer
            })
            .collect();
        let mut layout = layout;
        let bases: Vec<u64> = buffers.iter().map(DeviceBuffer::address).collect();
        layout.k_bases = bases.iter().step_by(2).copied().collect();
        layout.v_bases = bases.iter().skip(1).step_by(2).copied().collect();
        let copier = Arc::new(CudaCopier::new(device, mode, 2).unwrap());
        let config = config(layout.clone(), store_pages, incarnation);
        // SAFETY: (test) as in `host`, on the device.
        let linker = unsafe { DirectLinker::new(config, KvMemory::Cuda(copier)) }.unwrap();
        Self {
            linker,
            buffers: Buffers::Cuda(buffers),
            layout,
        }
    }

    fn span(&self) -> usize {
        self.layout.span_bytes() as usize
    }

    /// Writes a whole page (spans in layout order) into `slot`.
    pub(crate) fn write_page(&mut self, slot: DeviceSlot, bytes: &[u8]) {
        let span = self.span();
        let at = slot.0 as usize * span;
        for (i, chunk) in bytes.chunks(span).enumerate() {
            match &mut self.buffers {
                Buffers::Host(b) => b[i][at..at + chunk.len()].copy_from_slice(chunk),
                Buffers::Cuda(b) => b[i].write(at, chunk).unwrap(),
            }
        }
    }

    /// Reads a whole page back.
    pub(crate) fn read_page(&self, slot: DeviceSlot) -> Vec<u8> {
        let span = self.span();
        let at = slot.0 as usize * span;
        let mut out = Vec::with_capacity(span * self.layout.spans_per_page());
        for i in 0..self.layout.spans_per_page() {
            match &self.buffers {
                Buffers::Host(b) => out.extend_from_slice(&b[i][at..at + span]),
                Buffers::Cuda(b) => out.extend(b[i].read(at, span).unwrap()),
            }
        }
        out
    }
}

pub(crate) fn config(
    layout: KvLayout,
    store_pages: u32,
    incarnation: Incarnation,
) -> DirectLinkerConfig {
    DirectLinkerConfig {
        layout,
        store_pages,
        operation_timeout: Duration::from_secs(30),
        incarnation,
        peer: None,
        prefault: true,
    }
}

impl LinkerFixture for Fixture {
    type Linker = DirectLinker;

    fn linker(&mut self) -> &mut DirectLinker {
        &mut self.linker
    }

    fn write_device(&mut self, slot: DeviceSlot, bytes: &[u8]) {
        self.write_page(slot, bytes);
    }

    fn read_device(&mut self, slot: DeviceSlot) -> Vec<u8> {
        self.read_page(slot)
    }

    fn settle(&mut self) -> Vec<LinkerEvent> {
        self.linker.settle(Duration::from_secs(30))
    }
}

/// The conformance factory for a host pool.
pub(crate) fn host_fixture(spec: &FixtureSpec) -> Fixture {
    Fixture::host(
        layout_for(spec.page_bytes, spec.device_slots),
        spec.store_pages as u32,
        spec.incarnation,
    )
}

/// The conformance factory for a GPU pool (batched kernels).
pub(crate) fn cuda_fixture(spec: &FixtureSpec) -> Fixture {
    Fixture::cuda(
        &gpu(),
        CopyMode::default(),
        layout_for(spec.page_bytes, spec.device_slots),
        spec.store_pages as u32,
        spec.incarnation,
    )
}
