//! `--one-hop-raw [PAGES]`: the one-hop route's CUDA mechanics alone, on the
//! seed's workload (Qwen3-32B: 64 layers, K and V, 128 KiB spans, 16 MiB
//! pages; 1812 pages = 30.4 GB). This process (the destination) allocates the
//! layer-first device pool and exports it; a second process
//! (`--one-hop-source`, the source) pins a pool of patterned pages, imports
//! the export and copies every page into its slot ([`CudaImport::copy`]);
//! the destination checks every byte. Three rounds, medians (then three in
//! the kernel copy mode, for comparison). The source
//! times its copy call and the CPU it spent (getrusage, all its threads).
//!
//! [`CudaImport::copy`]: kvcr_direct_linker::CudaImport::copy

use std::sync::Arc;
use std::time::Instant;

use kvcr_direct_linker::cuda::{Device, DeviceBuffer};
use kvcr_direct_linker::{CopyMode, CudaCopier};
use kvcr_foundation::runner::{CopySpan, DeviceCopier, PoolRange};

use super::median;
use super::peer::Child;

/// Bytes of one span (one layer's K or V of a page).
const SPAN: u64 = 128 << 10;
/// Spans per page: 64 layers, K and V.
const SPANS: u64 = 128;
const PAGE: u64 = SPAN * SPANS;
const ROUNDS: usize = 3;
const THREADS: u64 = 16;

/// Word `w` of span `span` of page `page`: every word of the workload
/// differs, so a span landing in the wrong slot is caught.
fn word(page: u64, span: u64, w: u64) -> u64 {
    let seed = ((page << 8) | span)
        .wrapping_add(1)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    seed ^ w.wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(17)
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

/// This process's resource usage so far, all threads.
fn usage() -> libc::rusage {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the zeroed value.
    let status = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    assert_eq!(status, 0, "getrusage failed");
    // SAFETY: written by the successful call above (and zeroed before).
    unsafe { usage.assume_init() }
}

/// CPU seconds this process has used so far, user and system, all threads.
pub(crate) fn cpu_seconds() -> f64 {
    let usage = usage();
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Minor page faults this process has taken so far (first touches of fresh
/// heap among them), all threads.
pub(crate) fn minor_faults() -> u64 {
    u64::try_from(usage().ru_minflt).unwrap_or(0)
}

/// The destination: pool, export, the source process, three checked
/// rounds, the BENCH lines.
pub(crate) fn run(device: &Arc<Device>, h2d: f64, pages: u32) {
    let pages64 = u64::from(pages);
    let bytes = PAGE * pages64;
    let layer_bytes = SPAN * pages64;
    println!(
        "# one-hop: {pages} pages, {:.1} GB, source a second process on {}",
        bytes as f64 / 1e9,
        device.name()
    );
    // The layer-first pool: span index `s` (layer s/2, K or V) is one
    // buffer of `pages` slots, the 128 buffers back to back in one
    // allocation (exported once).
    let pool = DeviceBuffer::allocate(device, bytes as usize).unwrap();
    let copier = CudaCopier::new(device, CopyMode::best_for(device).unwrap(), 2).unwrap();
    let name = copier
        .export_device(pool.address(), bytes)
        .unwrap()
        .expect("legacy CUDA IPC refused a cuMemAlloc pool");
    let mut source = Child::spawn(&["--one-hop-source".to_owned(), pages.to_string(), hex(&name)]);
    let ready = source.expect("READY");
    let mut setup = ready.split_whitespace().map(|v| v.parse::<f64>().unwrap());
    let (fill, register, import) = (
        setup.next().unwrap(),
        setup.next().unwrap(),
        setup.next().unwrap(),
    );
    println!(
        "# one-hop: source pool patterned in {fill:.2} s, pinned (cuMemHostRegister of {:.1} GiB) in {register:.2} s, export imported in {:.1} ms",
        bytes as f64 / f64::from(1u32 << 30),
        import * 1e3
    );
    // Rounds in the source copier's default mode (the figures), then
    // without row copies (every span a batch descriptor) and in the kernel
    // mode (the SMs move the bytes), for comparison.
    let mut rounds = |mode: &str| -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut seconds, mut cpu, mut first) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            pool.fill(0).unwrap();
            source.say(&format!("GO {mode}"));
            let result = source.expect("RESULT");
            let mut it = result.split_whitespace().map(|v| v.parse::<f64>().unwrap());
            let (secs, cpu_s, first_ms) =
                (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
            let checked = Instant::now();
            check(&pool, pages64, layer_bytes);
            println!(
                "# one-hop: {mode} round {round}: {:.1} ms ({:.2} GB/s), source CPU {:.1} ms, first layer landed at {first_ms:.2} ms (GPU); every byte checked in {:.1} s",
                secs * 1e3,
                bytes as f64 / secs / 1e9,
                cpu_s * 1e3,
                checked.elapsed().as_secs_f64()
            );
            seconds.push(secs);
            cpu.push(cpu_s);
            first.push(first_ms);
        }
        (seconds, cpu, first)
    };
    let (seconds, cpu, first) = rounds("default");
    // `--compare flat,kernel` (the default) names the comparison modes;
    // `--compare none` skips them (each round's byte check takes ~25 s).
    let compare = crate::arg("--compare").unwrap_or_else(|| "flat,kernel".to_owned());
    let others: Vec<&str> = compare
        .split(',')
        .filter(|m| matches!(*m, "flat" | "kernel"))
        .collect();
    for mode in others {
        let (other_seconds, other_cpu, other_first) = rounds(mode);
        println!(
            "# one-hop: {mode} mode: {:.2} GB/s, source CPU {:.5} s/GB, first layer {:.2} ms (medians)",
            bytes as f64 / median(other_seconds) / 1e9,
            median(other_cpu) / (bytes as f64 / 1e9),
            median(other_first)
        );
    }
    drop(source);
    let secs = median(seconds);
    let gbps = bytes as f64 / secs / 1e9;
    let anchor_s = bytes as f64 / h2d / 1e9;
    println!(
        "BENCH direct.peer_restore_32b_one_hop_raw value={gbps:.2} unit=GB/s anchor={h2d:.2} ratio={:.3}",
        gbps / h2d
    );
    println!(
        "BENCH direct.peer_restore_32b_one_hop_raw_s value={secs:.3} unit=s anchor={anchor_s:.3} ratio={:.3}",
        secs / anchor_s
    );
    let per_gb = median(cpu) / (bytes as f64 / 1e9);
    println!("BENCH direct.peer_restore_source_cpu value={per_gb:.5} unit=s/GB");
    // One layer's bytes (K and V of every page) at the same round's H2D rate.
    let layer_ms = 2.0 * layer_bytes as f64 / h2d / 1e6;
    let first_ms = median(first);
    println!(
        "BENCH direct.peer_first_layer_raw_ms value={first_ms:.2} unit=ms anchor={layer_ms:.2} ratio={:.3}",
        first_ms / layer_ms
    );
    drop(copier);
    drop(pool);
}

/// Every byte of the pool against the pattern, one layer buffer per task.
fn check(pool: &DeviceBuffer, pages: u64, layer_bytes: u64) {
    let next = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|scope| {
        for _ in 0..THREADS.min(8) {
            scope.spawn(|| {
                loop {
                    let span = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if span >= SPANS {
                        break;
                    }
                    let at = (span * layer_bytes) as usize;
                    let landed = pool.read(at, layer_bytes as usize).unwrap();
                    for page in 0..pages {
                        let slot = &landed[(page * SPAN) as usize..((page + 1) * SPAN) as usize];
                        for (w, bytes) in slot.chunks_exact(8).enumerate() {
                            let got = u64::from_le_bytes(bytes.try_into().unwrap());
                            assert_eq!(
                                got,
                                word(page, span, w as u64),
                                "page {page} span {span} word {w} differs"
                            );
                        }
                    }
                }
            });
        }
    });
}

/// `--one-hop-source PAGES NAME`: the source process. Patterns and pins
/// its pool, imports `NAME`, prints `READY <fill s> <pin s> <import s>`,
/// then per `GO default`, `GO flat` (no row copies) or `GO kernel` line
/// copies every page in that copier mode and prints `RESULT <s> <CPU s> <first layer ms>`; exits when
/// stdin closes.
pub(crate) fn source(pages: u32, name: &str) {
    let pages64 = u64::from(pages);
    let bytes = PAGE * pages64;
    let device = Device::open(0).unwrap();
    let copier = CudaCopier::new(&device, CopyMode::best_for(&device).unwrap(), 2).unwrap();
    // A page-aligned pool inside a vector of words.
    let t = Instant::now();
    let mut memory = vec![0u64; (bytes / 8 + 512) as usize];
    let skew = (512 - (memory.as_ptr() as usize % 4096) / 8) % 512;
    let pool = &mut memory[skew..skew + (bytes / 8) as usize];
    let base = pool.as_ptr() as u64;
    let per_thread = pages64.div_ceil(THREADS);
    std::thread::scope(|scope| {
        for (chunk, words) in pool
            .chunks_mut((per_thread * PAGE / 8) as usize)
            .enumerate()
        {
            scope.spawn(move || {
                let first = chunk as u64 * per_thread;
                for (i, slot) in words.chunks_exact_mut((SPAN / 8) as usize).enumerate() {
                    let (page, span) = (first + i as u64 / SPANS, i as u64 % SPANS);
                    for (w, word_out) in slot.iter_mut().enumerate() {
                        *word_out = word(page, span, w as u64);
                    }
                }
            });
        }
    });
    let fill = t.elapsed().as_secs_f64();
    let range = PoolRange { base, len: bytes };
    let t = Instant::now();
    copier.attach(&[range]).unwrap();
    let register = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let import = copier.import(&unhex(name), bytes).unwrap();
    let imported = t.elapsed().as_secs_f64();
    // Page p's span s goes to slot p of layer buffer s.
    let keys: Vec<Vec<CopySpan>> = (0..pages64)
        .map(|page| {
            (0..SPANS)
                .map(|span| CopySpan {
                    src: base + page * PAGE + span * SPAN,
                    dst: span * SPAN * pages64 + page * SPAN,
                    len: SPAN,
                })
                .collect()
        })
        .collect();
    let keys: Vec<&[CopySpan]> = keys.iter().map(Vec::as_slice).collect();
    println!("READY {fill} {register} {imported}");
    let default = copier.mode();
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        if let Some(mode) = line.trim().strip_prefix("GO ") {
            copier.set_row_copies(mode != "flat");
            let mode = if mode == "kernel" {
                CopyMode::Batched
            } else {
                default
            };
            copier.set_mode(mode).unwrap();
            let (cpu, t) = (cpu_seconds(), Instant::now());
            import.copy(&keys).unwrap();
            let secs = t.elapsed().as_secs_f64();
            let cpu = cpu_seconds() - cpu;
            let first = copier.last_profile().first_group_ms;
            println!("RESULT {secs} {cpu} {first}");
        }
        line.clear();
    }
    drop(import);
    copier.detach(&[range]);
    drop(memory);
}
