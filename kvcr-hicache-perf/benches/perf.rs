//! Each performance control on vs off, as ratios measured in one run:
//!
//! - `perf.coalesce_ops`: transfer operations of a `page_first` restore of
//!   Qwen3-0.6B pages without ÷ with coalescing;
//! - `perf.coalesce_speedup`: that restore through the coalesced fast path
//!   (GB/s) against the normal path (`deliver`, the control off) as anchor;
//! - `perf.hugepage_speedup`: runner deposit + deliver through an anonymous
//!   pool with huge pages, against the same without them;
//! - `perf.split_tcp_16mib`: peer fetch of a 16 MiB page over tcp between two
//!   processes with split sizing, against `ucx_perftest -O 1` at 16 MiB.
//!
//! `cargo bench -p kvcr-hicache-perf --bench perf [-- --quick]` (or
//! `cargo xtask bench`). Without `--bench` it only prints a line.

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock and sleeps
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvcr_foundation::hint::FetchMode;
use kvcr_foundation::protocol::{ElementRef, OpHandle};
use kvcr_foundation::runner::{
    DeliverEntry, DepositEntry, OpResult, PeerOptions, PoolConfig, PutSplit, RegionDesc, Runner,
    RunnerConfig,
};
use kvcr_foundation::{
    BlockKey, CompatDigest, ControlEndpoint, FetchHint, Namespace, NamespaceId, RequestId,
    ScopedKey,
};
use kvcr_hicache_perf::coalesce::CoalesceOptions;
use kvcr_hicache_perf::layout::PageGeometry;
use kvcr_hicache_perf::placement::{self, HugePages, PoolMemory};
use kvcr_hicache_perf::restore::{HostRegion, restore};

const CHILD: &str = "KVCR_BENCH_PERF_SOURCE";
const MIB16: u64 = 16 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn line(name: &str, value: f64, unit: &str, anchor: Option<f64>) {
    match anchor {
        Some(a) => println!(
            "BENCH {name} value={value:.3} unit={unit} anchor={a:.3} ratio={:.3}",
            value / a
        ),
        None => println!("BENCH {name} value={value:.3} unit={unit}"),
    }
}

fn wait(runner: &mut Runner, op: OpHandle) -> OpResult {
    loop {
        if let Some(r) = runner
            .wait_completed(Duration::from_secs(5))
            .into_iter()
            .find(|r| r.op == op)
        {
            return r;
        }
    }
}

fn key(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

/// A page_first host buffer (K half, V half) registered as `k:<part>` and
/// `v:<part>`, one element per page.
struct PageFirstHost {
    buf: Vec<u8>,
    k: HostRegion,
    v: HostRegion,
}

impl PageFirstHost {
    fn new(runner: &mut Runner, part: &str, pages: u64, run: u64) -> Self {
        let mut buf: Vec<u8> = (0..2 * pages * run).map(|i| (i >> 9) as u8).collect();
        let base = buf.as_mut_ptr() as u64;
        let region = |pool: &str, offset| {
            let desc = RegionDesc {
                label: format!("{pool}:{part}"),
                base: base + offset,
                size: run,
                stride: 0,
                count: pages,
            };
            // SAFETY: `buf` outlives the runner (the bench drops the runner
            // first) and is not touched while operations run.
            let id = unsafe { runner.register_region(desc.clone()) }.unwrap();
            HostRegion { id, desc }
        };
        let k = region("k", 0);
        let v = region("v", pages * run);
        Self { buf, k, v }
    }

    fn at(&self, p: u64) -> Vec<ElementRef> {
        vec![
            ElementRef {
                region: self.k.id,
                index: p,
            },
            ElementRef {
                region: self.v.id,
                index: p,
            },
        ]
    }
}

/// Coalescing: returns (ops without / with, fast path GB/s, normal path GB/s,
/// uncoalesced fast path GB/s).
fn coalesce(pages: u64, reps: usize) -> (f64, f64, f64, f64) {
    let run = PageGeometry::QWEN3_0_6B.run_bytes();
    let pool = |name: &str| PoolConfig {
        name: name.into(),
        block_size: run,
        blocks: pages as u32,
    };
    let mut runner = Runner::start(
        RunnerConfig {
            pools: vec![pool("k"), pool("v")],
            operation_timeout: Duration::from_secs(30),
            ..RunnerConfig::default()
        },
        None,
    )
    .unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(11)));
    let src = PageFirstHost::new(&mut runner, "src", pages, run);
    let dst = PageFirstHost::new(&mut runner, "dst", pages, run);
    let op = runner
        .deposit(
            (0..pages)
                .map(|p| DepositEntry {
                    key: key(ns, p),
                    spans: src.at(p),
                    page: None,
                })
                .collect(),
            false,
        )
        .unwrap();
    assert!(
        wait(&mut runner, op)
            .entries
            .iter()
            .all(|(_, e)| e.is_success())
    );
    let layout = [runner.pool("k").unwrap(), runner.pool("v").unwrap()];
    let entries = || -> Vec<DeliverEntry> {
        (0..pages)
            .map(|p| DeliverEntry {
                key: key(ns, p),
                destinations: dst.at(p),
            })
            .collect()
    };
    let bytes = (2 * pages * run) as f64;
    let hosts = [dst.k.clone(), dst.v.clone()];
    let mut ops = (0, 0);
    let mut fast = |runner: &mut Runner, options: CoalesceOptions| {
        let start = Instant::now();
        let report = restore(runner, &hosts, &layout, entries(), None, options).unwrap();
        let secs = start.elapsed().as_secs_f64();
        assert!(report.restored.iter().all(|r| *r));
        if options.enabled {
            ops = (report.ops_uncoalesced, report.ops);
        }
        bytes / secs / 1e9
    };
    let normal = |runner: &mut Runner| {
        let start = Instant::now();
        let op = runner.deliver(entries()).unwrap();
        let result = wait(runner, op);
        let secs = start.elapsed().as_secs_f64();
        assert!(result.entries.iter().all(|(_, e)| e.is_success()));
        bytes / secs / 1e9
    };
    let (mut on, mut off, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        off.push(normal(&mut runner));
        on.push(fast(&mut runner, CoalesceOptions::on()));
        plain.push(fast(&mut runner, CoalesceOptions::default()));
    }
    let (without, with) = ops;
    // The fast path wrote the same pages: check them once.
    let half = (pages * run) as usize;
    assert_eq!(&dst.buf[..half], &src.buf[..half]);
    drop(runner);
    (
        without as f64 / with.max(1) as f64,
        median(on),
        median(off),
        median(plain),
    )
}

/// A runner whose pool is `memory`, with a host region of `blocks` 4 MiB
/// blocks, for deposit + deliver rounds.
struct PoolBench {
    runner: Runner,
    ns: NamespaceId,
    region: kvcr_foundation::protocol::RegionId,
    blocks: u64,
    round: u64,
    _host: Vec<u8>,
}

const POOL_BLOCK: u64 = 4 << 20;

impl PoolBench {
    fn new(memory: PoolMemory, blocks: u64) -> Self {
        let runner = Runner::start(
            RunnerConfig {
                pool_memory: memory,
                operation_timeout: Duration::from_secs(30),
                ..RunnerConfig::single_pool("kv", POOL_BLOCK, blocks as u32)
            },
            None,
        )
        .unwrap();
        let ns = runner.register_namespace(Namespace::base(CompatDigest(12)));
        let mut host: Vec<u8> = (0..POOL_BLOCK * blocks).map(|i| (i >> 11) as u8).collect();
        // SAFETY: `host` lives in this struct, declared after the runner, so
        // it is freed after the runner stops.
        let region = unsafe {
            runner.register_region(RegionDesc {
                label: "kv:host".into(),
                base: host.as_mut_ptr() as u64,
                size: POOL_BLOCK,
                stride: 0,
                count: blocks,
            })
        }
        .unwrap();
        Self {
            runner,
            ns,
            region,
            blocks,
            round: 0,
            _host: host,
        }
    }

    /// One deposit + deliver round of every block; GB/s.
    fn round(&mut self) -> f64 {
        let (blocks, region, ns) = (self.blocks, self.region, self.ns);
        self.round += 1;
        let keys: Vec<ScopedKey> = (0..blocks)
            .map(|b| key(ns, self.round * blocks + b))
            .collect();
        let start = Instant::now();
        let op = self
            .runner
            .deposit(
                keys.iter()
                    .enumerate()
                    .map(|(b, k)| DepositEntry {
                        key: *k,
                        spans: vec![ElementRef {
                            region,
                            index: b as u64,
                        }],
                        page: None,
                    })
                    .collect(),
                false,
            )
            .unwrap();
        assert!(
            wait(&mut self.runner, op)
                .entries
                .iter()
                .all(|(_, e)| e.is_success())
        );
        let op = self
            .runner
            .deliver(
                keys.iter()
                    .enumerate()
                    .map(|(b, k)| DeliverEntry {
                        key: *k,
                        destinations: vec![ElementRef {
                            region,
                            index: blocks - 1 - b as u64,
                        }],
                    })
                    .collect(),
            )
            .unwrap();
        assert!(
            wait(&mut self.runner, op)
                .entries
                .iter()
                .all(|(_, e)| e.is_success())
        );
        (2 * POOL_BLOCK * blocks) as f64 / start.elapsed().as_secs_f64() / 1e9
    }
}

/// Deposit + deliver GB/s with and without huge pages, rounds alternating
/// between the two runners so both see the same machine load.
fn huge_pages(blocks: u64, reps: usize) -> (f64, f64) {
    let mut huge = PoolBench::new(placement::anonymous(HugePages::Prefer), blocks);
    let mut small = PoolBench::new(placement::anonymous(HugePages::Off), blocks);
    for (name, bench) in [("with", &huge), ("without", &small)] {
        let audit = &placement::audit_runner(&bench.runner, 1024).unwrap()[0];
        println!(
            "# perf.hugepage audit {name}: AnonHugePages {} MiB of {} MiB, pages on nodes {:?}",
            audit.anon_huge_bytes >> 20,
            audit.len >> 20,
            audit.pages_per_node
        );
    }
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        with.push(huge.round());
        without.push(small.round());
    }
    (median(with), median(without))
}

fn peer_options(tls: &str, split: PutSplit) -> PeerOptions {
    let mut o = PeerOptions::loopback();
    o.ucx_tls = Some(tls.to_owned());
    o.put_split = split;
    // Unsplit means whole puts, two in flight (with nothing set, a runner
    // splits its tcp puts by default).
    if split == PutSplit::default() {
        o.max_puts_in_flight = 2;
    }
    // Through UCX: with the same-host mapping (on by default since the
    // one-copy path landed) the two processes here never touch tcp, and
    // the figure measured memcpy (12 GB/s) against a tcp anchor.
    o.same_host_mapping = false;
    o
}

fn peer_config(blocks: u64) -> RunnerConfig {
    RunnerConfig {
        operation_timeout: Duration::from_secs(30),
        ..RunnerConfig::single_pool("kv", MIB16, blocks as u32)
    }
}

/// The source process: `n` keys of 16 MiB, puts split as `chunk:in_flight`.
fn source(spec: &str) {
    let mut parts = spec.split(':');
    let tls = parts.next().unwrap().replace('+', ",");
    let n: u64 = parts.next().unwrap().parse().unwrap();
    let split = PutSplit {
        chunk_bytes: parts.next().unwrap().parse().unwrap(),
        max_chunks_in_flight: parts.next().unwrap().parse().unwrap(),
    };
    let first: u64 = parts.next().unwrap().parse().unwrap();
    let mut runner =
        Runner::start_with_peers(peer_config(n), None, &peer_options(&tls, split)).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(13)));
    let mut host: Vec<u8> = (0..MIB16 * n).map(|i| (i >> 7) as u8).collect();
    // SAFETY: `host` outlives the runner (dropped after it, below).
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: host.as_mut_ptr() as u64,
            size: MIB16,
            stride: 0,
            count: n,
        })
    }
    .unwrap();
    let op = runner
        .deposit(
            (0..n)
                .map(|k| DepositEntry {
                    key: key(ns, first + k),
                    spans: vec![ElementRef { region, index: k }],
                    page: None,
                })
                .collect(),
            false,
        )
        .unwrap();
    wait(&mut runner, op);
    println!("{}", runner.peers().endpoint().unwrap());
    std::io::stdout().flush().unwrap();
    let mut l = String::new();
    let _ = std::io::stdin().read_line(&mut l);
    drop(runner);
    drop(host);
}

struct Source {
    child: std::process::Child,
    endpoint: ControlEndpoint,
}

impl Source {
    /// A source holding keys `first .. first + n`.
    fn start(tls: &str, first: u64, n: u64, split: PutSplit) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(
                CHILD,
                format!(
                    "{}:{n}:{}:{}:{first}",
                    tls.replace(',', "+"),
                    split.chunk_bytes,
                    split.max_chunks_in_flight
                ),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut l = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut l)
            .unwrap();
        Self {
            child,
            endpoint: l.trim().parse().unwrap(),
        }
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// GB/s of fetching one 16 MiB key at a time over `tls`, from a source
/// whose puts are split as `split` and from one whose puts are not,
/// alternating between the two so both see the same machine load.
fn peer_fetch_16mib(tls: &str, split: PutSplit, reps: usize) -> (f64, f64) {
    // Distinct keys per source: a key fetched once is resident here after.
    const OTHER: u64 = 1 << 20;
    let sources = [
        Source::start(tls, 0, reps as u64 + 1, split),
        Source::start(tls, OTHER, reps as u64 + 1, PutSplit::default()),
    ];
    let mut target = Runner::start_with_peers(
        peer_config(2),
        None,
        &peer_options(tls, PutSplit::default()),
    )
    .unwrap();
    let ns = target.register_namespace(Namespace::base(CompatDigest(13)));
    let pool = target.pool("kv").unwrap();
    let mut fetch_one = |source: &Source, s: usize, k: u64| {
        let request = RequestId(format!("perf-{s}-{k}"));
        let scoped = [key(ns, k + s as u64 * OTHER)];
        target.hints().submit(
            request.clone(),
            &FetchHint {
                source: source.endpoint.clone(),
                block_hashes: vec![scoped[0].key],
                mode: FetchMode::Copy,
                action_id: None,
            },
        );
        let start = Instant::now();
        let op = target.hints().fetch(&request, &scoped, &[pool]).unwrap();
        let result = wait(&mut target, op);
        let secs = start.elapsed().as_secs_f64();
        let handles: Vec<_> = result
            .entries
            .iter()
            .filter_map(|(_, e)| e.release)
            .collect();
        assert_eq!(handles.len(), 1, "the key was not fetched");
        target.release(&handles);
        target.hints().discard(&request);
        MIB16 as f64 / secs / 1e9
    };
    // Warm each route (metadata, endpoint, rkeys) outside the measurement.
    for (s, source) in sources.iter().enumerate() {
        fetch_one(source, s, 0);
    }
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for k in 1..=reps as u64 {
        with.push(fetch_one(&sources[0], 0, k));
        without.push(fetch_one(&sources[1], 1, k));
    }
    drop(target);
    drop(sources);
    (median(with), median(without))
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        source(&spec);
        return;
    }
    if !std::env::args().any(|a| a == "--bench") {
        println!("perf bench: run with `cargo bench` or `cargo xtask bench`");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 5 } else { 11 };

    let pages = if quick { 16 } else { 64 };
    let (ops_ratio, on, off, plain) = coalesce(pages, reps);
    line("perf.coalesce_ops", ops_ratio, "x", None);
    line("perf.coalesce_speedup", on, "GB/s", Some(off));
    println!(
        "# perf.coalesce: {pages} Qwen3-0.6B pages page_first, K and V pools; fast path coalesced {on:.2} GB/s, fast path uncoalesced {plain:.2} GB/s, normal path (deliver) {off:.2} GB/s"
    );

    let blocks = if quick { 32 } else { 64 };
    let (huge, small) = huge_pages(blocks, reps * 2);
    line("perf.hugepage_speedup", huge, "GB/s", Some(small));
    println!(
        "# perf.hugepage: deposit + deliver of {blocks} x 4 MiB through an anonymous pool, THP {} (host buffers are plain heap memory)",
        placement::transparent_huge_page_mode().unwrap_or_else(|| "absent".into())
    );

    const TCP: &str = "tcp,self";
    let split = placement::split_for(Some(TCP));
    let peer_reps = if quick { 7 } else { 15 };
    // The anchor runs before and after the fetches; their mean is the anchor.
    let before = kvcr_ucx::perftest::put_bw_gbs("tcp", 16 << 20, 60, &["-O", "1"]);
    let (with, without) = peer_fetch_16mib(TCP, split, peer_reps);
    let after = kvcr_ucx::perftest::put_bw_gbs("tcp", 16 << 20, 60, &["-O", "1"]);
    let anchor = match (before, after) {
        (Some(a), Some(b)) => Some((a + b) / 2.0),
        (a, b) => a.or(b),
    };
    line("perf.split_tcp_16mib", with, "GB/s", anchor);
    println!(
        "# perf.split_tcp_16mib: chunks of {} KiB, {} in flight; whole puts (2 in flight) {without:.3} GB/s",
        split.chunk_bytes >> 10,
        split.max_chunks_in_flight
    );
    if let Ok(chunks) = std::env::var("KVCR_BENCH_SPLIT_SWEEP") {
        for spec in chunks.split(',') {
            let (c, n) = spec.split_once('x').unwrap();
            let s = PutSplit {
                chunk_bytes: c.parse::<u64>().unwrap() << 10,
                max_chunks_in_flight: n.parse().unwrap(),
            };
            let (with, without) = peer_fetch_16mib(TCP, s, peer_reps);
            println!("# sweep {c} KiB x {n}: {with:.3} GB/s (unsplit alongside: {without:.3})");
        }
    }
}
