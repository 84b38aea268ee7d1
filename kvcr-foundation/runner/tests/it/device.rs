//! The device seam: framework regions registered as device memory are copied
//! by the framework's [`DeviceCopier`], never by the copy thread, with every
//! runner rule (claims, failure, inventory) unchanged. The "device" here is
//! host memory behind a recording copier (the seam's own contract); the CUDA
//! copier is tested on a GPU in `kvcr-direct-linker`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvcr_contracts::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_contracts::{BlockKey, CompatDigest, Namespace, NamespaceId, ScopedKey};
use kvcr_runner::Error;
use kvcr_runner::error::RunnerReason;
use kvcr_runner::{
    CopySpan, DeliverEntry, DepositEntry, DeviceCopier, EntryStatus, FailReason, OpResult,
    PoolRange, RegionDesc, Runner, RunnerConfig,
};

const BLOCK: usize = 256;

#[derive(Default)]
struct Recorder {
    attached: Mutex<Vec<PoolRange>>,
    calls: AtomicUsize,
    spans: AtomicUsize,
    detached: AtomicBool,
    fail_next: AtomicBool,
    /// The lead each `copy_led` call asked for.
    leads: Mutex<Vec<usize>>,
}

/// Copies host bytes, like a device would, and records what it was asked.
struct RecordingCopier(Arc<Recorder>);

impl DeviceCopier for RecordingCopier {
    fn attach(&self, pools: &[PoolRange]) -> kvcr_runner::Result<()> {
        self.0.attached.lock().unwrap().extend_from_slice(pools);
        Ok(())
    }

    fn copy(&self, keys: &[&[CopySpan]]) -> kvcr_runner::Result<()> {
        assert!(!self.0.detached.load(Ordering::SeqCst), "copy after detach");
        self.0.calls.fetch_add(1, Ordering::SeqCst);
        if self.0.fail_next.swap(false, Ordering::SeqCst) {
            return Err(Error::runner(RunnerReason::DeviceCopy(
                kvcr_contracts::error::Echo::new("injected"),
            )));
        }
        for span in keys.iter().flat_map(|k| k.iter()) {
            self.0.spans.fetch_add(1, Ordering::SeqCst);
            // SAFETY: (test) the runner bounds-checked both sides against the
            // registered "device" buffer and its own pool, both alive.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    span.src as usize as *const u8,
                    span.dst as usize as *mut u8,
                    span.len as usize,
                );
            }
        }
        Ok(())
    }

    fn copy_led(
        &self,
        keys: &[&[CopySpan]],
        lead: usize,
        landed: &mut dyn FnMut(),
    ) -> kvcr_runner::Result<()> {
        self.0.leads.lock().unwrap().push(lead);
        self.copy(keys)?;
        landed();
        Ok(())
    }

    fn detach(&self, pools: &[PoolRange]) {
        assert_eq!(
            *self.0.attached.lock().unwrap(),
            pools,
            "detach names the attached pools"
        );
        self.0.detached.store(true, Ordering::SeqCst);
    }
}

struct Fixture {
    runner: Runner,
    ns: NamespaceId,
    device: Vec<u8>,
    region: RegionId,
    recorder: Arc<Recorder>,
}

fn fixture(pages: usize) -> Fixture {
    let runner = Runner::start(RunnerConfig::single_pool("kv", BLOCK as u64, 8), None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(9)));
    let recorder = Arc::new(Recorder::default());
    runner
        .pools()
        .set_device_copier(Arc::new(RecordingCopier(Arc::clone(&recorder))))
        .unwrap();
    let mut device = vec![0u8; pages * BLOCK];
    // SAFETY: (test) `device` outlives the runner inside the fixture (the
    // runner field drops first), and no test touches an element in flight.
    let region = unsafe {
        runner.register_device_region(RegionDesc {
            label: "kv:gpu".into(),
            base: device.as_mut_ptr() as u64,
            size: BLOCK as u64,
            stride: 0,
            count: pages as u64,
        })
    }
    .unwrap();
    Fixture {
        runner,
        ns,
        device,
        region,
        recorder,
    }
}

fn key(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

fn wait(runner: &mut Runner, op: OpHandle) -> OpResult {
    for _ in 0..1000 {
        for result in runner.wait_completed(Duration::from_millis(50)) {
            if result.op == op {
                return result;
            }
        }
    }
    panic!("operation {op:?} did not complete");
}

impl Fixture {
    fn at(&self, page: usize) -> ElementRef {
        ElementRef {
            region: self.region,
            index: page as u64,
        }
    }

    fn deposit(&mut self, k: u64, page: usize) -> EntryStatus {
        let entry = DepositEntry {
            key: key(self.ns, k),
            spans: vec![self.at(page)],
            page: None,
        };
        let op = self.runner.deposit(vec![entry], false).unwrap();
        wait(&mut self.runner, op).entries[0].1.status
    }

    fn deliver(&mut self, k: u64, page: usize) -> EntryStatus {
        let entry = DeliverEntry {
            key: key(self.ns, k),
            destinations: vec![self.at(page)],
        };
        let op = self.runner.deliver(vec![entry]).unwrap();
        wait(&mut self.runner, op).entries[0].1.status
    }
}

#[test]
fn device_jobs_go_to_the_copier_byte_exact() {
    let mut f = fixture(4);
    let attached = f.recorder.attached.lock().unwrap().clone();
    assert_eq!(
        attached,
        f.runner.pools().ranges(),
        "attach sees every pool"
    );
    assert_eq!(attached[0].len, 8 * BLOCK as u64);
    for (i, b) in f.device[..BLOCK].iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    assert_eq!(f.deposit(1, 0), EntryStatus::Success);
    // The device wrote the pool: the page's digest is of the bytes it wrote.
    assert_eq!(
        f.runner.page_digest(&key(f.ns, 1)),
        Some(kvcr_sys::digest::digest_bytes(&f.device[..BLOCK]))
    );
    assert_eq!(f.deliver(1, 2), EntryStatus::Success);
    assert_eq!(f.device[..BLOCK], f.device[2 * BLOCK..3 * BLOCK]);
    assert_eq!(f.recorder.calls.load(Ordering::SeqCst), 2);
    assert_eq!(f.recorder.spans.load(Ordering::SeqCst), 2);
    let recorder = Arc::clone(&f.recorder);
    let Fixture { runner, device, .. } = f;
    assert!(!recorder.detached.load(Ordering::SeqCst));
    runner.close().map_err(|(_, e)| e).unwrap();
    assert!(
        recorder.detached.load(Ordering::SeqCst),
        "dropping the runner detaches the copier"
    );
    drop(device);
}

/// A deliver into device memory with a first layer set asks the copier
/// for it (`copy_led` with the lead, every key's first span here), and the
/// runner reports the deliver's pages ready once the copier says they
/// landed: once, before or with the result. A failed copy says nothing;
/// without a first layer nothing is asked.
#[rstest::rstest]
#[case::reported(1, false, true)]
#[case::copy_failed(1, true, false)]
#[case::not_asked(0, false, false)]
fn a_device_deliver_reports_its_first_layer(
    #[case] lead: u16,
    #[case] fail: bool,
    #[case] reported: bool,
) {
    let mut f = fixture(8);
    for page in 0..3 {
        f.device[page * BLOCK..(page + 1) * BLOCK].fill(page as u8 + 1);
        assert_eq!(f.deposit(page as u64 + 1, page), EntryStatus::Success);
    }
    f.runner.set_lead_elements(lead);
    f.recorder.fail_next.store(fail, Ordering::SeqCst);
    let entries = (0..3)
        .map(|i| DeliverEntry {
            key: key(f.ns, i as u64 + 1),
            destinations: vec![f.at(4 + i)],
        })
        .collect();
    let op = f.runner.deliver(entries).unwrap();
    let result = wait(&mut f.runner, op);
    let leads = f.runner.poll_leads_landed();
    let asked = f.recorder.leads.lock().unwrap().clone();
    assert_eq!(asked, if lead > 0 { vec![1] } else { vec![] });
    if reported {
        assert_eq!(leads, [(op, 3)], "every page's first layer, once");
        assert!(result.entries.iter().all(|(_, e)| e.is_success()));
        for page in 0..3 {
            assert_eq!(f.device[(4 + page) * BLOCK], page as u8 + 1);
        }
    } else {
        assert!(leads.is_empty(), "{leads:?}");
    }
    assert!(f.runner.poll_leads_landed().is_empty(), "taken once");
}

#[test]
fn a_failed_device_copy_fails_the_key_and_frees_the_slot() {
    let mut f = fixture(2);
    f.recorder.fail_next.store(true, Ordering::SeqCst);
    assert_eq!(f.deposit(5, 0), EntryStatus::Failed(FailReason::CopyFailed));
    assert_eq!(
        f.runner.pools().resident_blocks(),
        0,
        "no half-written page stays"
    );
    assert_eq!(f.runner.stats().pools[0].free_slots, 8);
    // The runner keeps serving: the same key deposits fine afterwards.
    assert_eq!(f.deposit(5, 0), EntryStatus::Success);
    f.recorder.fail_next.store(true, Ordering::SeqCst);
    assert_eq!(f.deliver(5, 1), EntryStatus::Failed(FailReason::CopyFailed));
    assert_eq!(f.runner.stats().public_claims, 0);
    assert_eq!(f.deliver(5, 1), EntryStatus::Success);
    f.runner.check_invariants().unwrap();
}

#[test]
fn device_regions_need_a_copier_and_calls_never_mix_memories() {
    let runner = Runner::start(RunnerConfig::single_pool("kv", BLOCK as u64, 4), None).unwrap();
    let mut buf = vec![0u8; BLOCK];
    let desc = RegionDesc {
        label: "kv:gpu".into(),
        base: buf.as_mut_ptr() as u64,
        size: BLOCK as u64,
        stride: 0,
        count: 1,
    };
    // SAFETY: (test) refused before anything is registered.
    let refused = unsafe { runner.register_device_region(desc) };
    assert!(matches!(
        refused,
        Err(Error::Runner {
            reason: RunnerReason::NoDeviceCopier
        })
    ));
    drop(runner);

    let f = fixture(2);
    let second = f
        .runner
        .pools()
        .set_device_copier(Arc::new(RecordingCopier(Arc::default())));
    assert!(matches!(
        second,
        Err(Error::Runner {
            reason: RunnerReason::DeviceCopierSet
        })
    ));
    // SAFETY: (test) `buf` outlives the runner's use of it: the runner is
    // dropped at the end of this test, before `buf`.
    let host = unsafe {
        f.runner.register_region(RegionDesc {
            label: "kv:host".into(),
            base: buf.as_mut_ptr() as u64,
            size: BLOCK as u64,
            stride: 0,
            count: 1,
        })
    }
    .unwrap();
    let entries = vec![
        DepositEntry {
            key: key(f.ns, 1),
            spans: vec![f.at(0)],
            page: None,
        },
        DepositEntry {
            key: key(f.ns, 2),
            spans: vec![ElementRef {
                region: host,
                index: 0,
            }],
            page: None,
        },
    ];
    assert!(matches!(
        f.runner.deposit(entries, false),
        Err(Error::Runner {
            reason: RunnerReason::MixedMemory
        })
    ));
    assert_eq!(
        f.recorder.calls.load(Ordering::SeqCst),
        0,
        "refused unchanged"
    );
    drop(f);
    drop(buf);
}

/// Host memory in `memfd`s posing as a device that another process can
/// open: the one-hop route's contract test (`one_hop`). Its export names the
/// owner's pid, the file's descriptor, the offset and a random token, which
/// the importer finds in the file's name as `/proc/<pid>/fd/<n>` shows it.
pub(crate) mod memfd {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use kvcr_runner::error::RunnerReason;
    use kvcr_runner::{CopySpan, DeviceCopier, DeviceImport, Error, PoolRange};
    use memmap2::MmapMut;

    fn failed(why: &str) -> Error {
        Error::runner(RunnerReason::DeviceCopy(kvcr_contracts::error::Echo::new(
            why,
        )))
    }

    /// One "device" buffer: a memfd mapped here.
    struct Buffer {
        fd: OwnedFd,
        map: MmapMut,
        token: [u8; 16],
    }

    /// Host memory posing as a device: copies are memcpys, and its buffers are
    /// memfds another process can import.
    #[derive(Default)]
    pub(crate) struct MemfdCopier {
        buffers: Mutex<Vec<Buffer>>,
        /// Refuse every import (a source without the target's GPU).
        pub(crate) refuse_imports: AtomicBool,
        /// Imports flip each span's first byte after copying it (a copy that
        /// claims success over the wrong bytes).
        pub(crate) corrupt_imports: AtomicBool,
        /// Imports copy a write's first span, print `KVCR-ONE-HOP COPYING`
        /// and never return (a process to kill mid-copy).
        pub(crate) hang_imports: AtomicBool,
        /// How many imports were asked for.
        pub(crate) imports: std::sync::atomic::AtomicUsize,
        /// Imports resolve offsets to addresses, so a write spanning several
        /// goes through `copy_to_imports` in one pass (the CUDA copier's way).
        pub(crate) one_pass_imports: AtomicBool,
        /// How many one-pass copies ran.
        pub(crate) passes: std::sync::atomic::AtomicUsize,
        /// Imports opened and not yet dropped (closed).
        pub(crate) live_imports: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl MemfdCopier {
        /// A zeroed buffer of `len` bytes; its address.
        pub(crate) fn alloc(&self, len: usize) -> u64 {
            let mut token = [0u8; 16];
            getrandom::fill(&mut token).unwrap();
            let name = std::ffi::CString::new(format!("kvcr-test-gpu-{}", hex(&token))).unwrap();
            // SAFETY: (test) a valid C string; the returned descriptor is owned.
            let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
            assert!(raw >= 0, "memfd_create");
            // SAFETY: (test) `raw` is a fresh descriptor nobody else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            let file = std::fs::File::from(fd.try_clone().unwrap());
            file.set_len(len as u64).unwrap();
            // SAFETY: (test) the file is ours and stays the length mapped.
            let mut map = unsafe { MmapMut::map_mut(&file) }.unwrap();
            let base = map.as_mut_ptr() as u64;
            self.buffers.lock().unwrap().push(Buffer { fd, map, token });
            base
        }

        /// The bytes at `[addr, addr + len)` of one of our buffers.
        pub(crate) fn read(&self, addr: u64, len: u64) -> Option<Vec<u8>> {
            let buffers = self.buffers.lock().unwrap();
            buffers.iter().find_map(|b| {
                let at = usize::try_from(addr.checked_sub(b.map.as_ptr() as u64)?).ok()?;
                b.map.get(at..at + len as usize).map(<[u8]>::to_vec)
            })
        }
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn memcpy(keys: &[&[CopySpan]]) {
        for span in keys.iter().flat_map(|k| k.iter()) {
            // SAFETY: (test) the runner bounds-checked both sides against its
            // pools and the registered "device" buffer, both alive.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    span.src as usize as *const u8,
                    span.dst as usize as *mut u8,
                    span.len as usize,
                );
            }
        }
    }

    impl DeviceCopier for MemfdCopier {
        fn attach(&self, _pools: &[PoolRange]) -> kvcr_runner::Result<()> {
            Ok(())
        }

        fn copy(&self, keys: &[&[CopySpan]]) -> kvcr_runner::Result<()> {
            memcpy(keys);
            Ok(())
        }

        fn detach(&self, _pools: &[PoolRange]) {}

        fn export_device(&self, base: u64, len: u64) -> kvcr_runner::Result<Option<Vec<u8>>> {
            let buffers = self.buffers.lock().unwrap();
            let Some(b) = buffers.iter().find(|b| {
                let start = b.map.as_ptr() as u64;
                base >= start && base + len <= start + b.map.len() as u64
            }) else {
                return Ok(None);
            };
            let mut name = Vec::with_capacity(32);
            name.extend_from_slice(&std::process::id().to_le_bytes());
            name.extend_from_slice(&(b.fd.as_raw_fd() as u32).to_le_bytes());
            name.extend_from_slice(&(base - b.map.as_ptr() as u64).to_le_bytes());
            name.extend_from_slice(&b.token);
            Ok(Some(name))
        }

        fn import_device(
            &self,
            export: &[u8],
            len: u64,
        ) -> kvcr_runner::Result<Box<dyn DeviceImport>> {
            self.imports.fetch_add(1, Ordering::SeqCst);
            if self.refuse_imports.load(Ordering::SeqCst) {
                return Err(failed("imports refused"));
            }
            let (Some(pid), Some(fd), Some(offset), Some(token)) = (
                export.get(0..4),
                export.get(4..8),
                export.get(8..16),
                export.get(16..32),
            ) else {
                return Err(failed("a short export name"));
            };
            let pid = u32::from_le_bytes(pid.try_into().unwrap());
            let fd = u32::from_le_bytes(fd.try_into().unwrap());
            let offset = u64::from_le_bytes(offset.try_into().unwrap());
            let path = format!("/proc/{pid}/fd/{fd}");
            let link = std::fs::read_link(&path).map_err(|_| failed("no such export"))?;
            if !link.to_string_lossy().contains(&hex(token)) {
                return Err(failed("not the file the export names"));
            }
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|_| failed("cannot open the export"))?;
            // SAFETY: (test) a shared mapping of the target's buffer, which
            // outlives every write the runner makes through it.
            let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(|_| failed("mmap"))?;
            if offset + len > map.len() as u64 {
                return Err(failed("the export is shorter than the region"));
            }
            let at = map.as_mut_ptr() as u64 + offset;
            self.live_imports.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(MemfdImport {
                live: std::sync::Arc::clone(&self.live_imports),
                _map: map,
                at,
                len,
                corrupt: self.corrupt_imports.load(Ordering::SeqCst),
                hang: self.hang_imports.load(Ordering::SeqCst),
                one_pass: self.one_pass_imports.load(Ordering::SeqCst),
            }))
        }

        fn copy_to_imports(&self, keys: &[&[CopySpan]]) -> kvcr_runner::Result<()> {
            if !self.one_pass_imports.load(Ordering::SeqCst) {
                return Err(failed("one-pass copies are off"));
            }
            self.passes.fetch_add(1, Ordering::SeqCst);
            memcpy(keys);
            Ok(())
        }

        fn digest_device(&self, keys: &[&[CopySpan]]) -> kvcr_runner::Result<Option<Vec<u64>>> {
            let digests = keys
                .iter()
                .map(|spans| {
                    let bytes: Vec<u8> = spans
                        .iter()
                        .flat_map(|s| self.read(s.src, s.len).unwrap_or_default())
                        .collect();
                    kvcr_sys::digest::digest_bytes(&bytes)
                })
                .collect();
            Ok(Some(digests))
        }
    }

    /// A peer's buffer mapped here.
    struct MemfdImport {
        /// The copier's count of live imports, taken back on drop.
        live: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        _map: MmapMut,
        at: u64,
        len: u64,
        corrupt: bool,
        hang: bool,
        one_pass: bool,
    }

    impl Drop for MemfdImport {
        fn drop(&mut self) {
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl DeviceImport for MemfdImport {
        fn len(&self) -> u64 {
            self.len
        }

        fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
            let end = offset.checked_add(len)?;
            (self.one_pass && end <= self.len).then(|| self.at + offset)
        }

        fn copy_into(&self, keys: &[&[CopySpan]]) -> kvcr_runner::Result<()> {
            let inside = keys
                .iter()
                .flat_map(|k| k.iter())
                .all(|s| s.dst.checked_add(s.len).is_some_and(|end| end <= self.len));
            if !inside {
                return Err(failed("a span outside the import"));
            }
            let spans: Vec<Vec<CopySpan>> = keys
                .iter()
                .map(|k| {
                    k.iter()
                        .map(|s| CopySpan {
                            src: s.src,
                            dst: self.at + s.dst,
                            len: s.len,
                        })
                        .collect()
                })
                .collect();
            let refs: Vec<&[CopySpan]> = spans.iter().map(Vec::as_slice).collect();
            if self.hang {
                memcpy(&refs[..1]);
                println!("KVCR-ONE-HOP COPYING");
                loop {
                    std::thread::park();
                }
            }
            memcpy(&refs);
            if self.corrupt {
                for span in spans.iter().flatten() {
                    // SAFETY: (test) inside the mapping (checked above).
                    unsafe { *(span.dst as usize as *mut u8) ^= 0xff };
                }
            }
            Ok(())
        }
    }
}
