//! Peer-fetch benchmarks between two processes on loopback (this binary
//! re-executes itself as the source), each beside `ucx_perftest` measured in
//! the same run at the same size and transports.
//!
//! `cargo bench -p kvcr-foundation --bench peer [-- --quick]` (or `cargo xtask bench`).

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock and sleeps
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(missing_docs, unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvcr_foundation::hint::FetchMode;
use kvcr_foundation::protocol::ElementRef;
use kvcr_foundation::runner::{DepositEntry, PeerOptions, RegionDesc, Runner, RunnerConfig};
use kvcr_foundation::{
    BlockKey, CompatDigest, ControlEndpoint, FetchHint, Namespace, RequestId, ScopedKey,
};

const CHILD: &str = "KVCR_BENCH_PEER_SOURCE";

fn options(tls: &str) -> PeerOptions {
    let mut o = PeerOptions::loopback();
    o.ucx_tls = Some(tls.to_owned());
    o
}

fn config(block: usize, blocks: u32) -> RunnerConfig {
    RunnerConfig {
        operation_timeout: Duration::from_secs(30),
        ..RunnerConfig::single_pool("kv", block as u64, blocks)
    }
}

/// The source process: holds `n` keys of `block` bytes, prints its endpoint,
/// serves until stdin closes.
fn source(spec: &str) {
    let mut parts = spec.split(':');
    let tls = parts.next().unwrap().replace('+', ",");
    let block: usize = parts.next().unwrap().parse().unwrap();
    let n: u64 = parts.next().unwrap().parse().unwrap();
    let runner = Runner::start_with_peers(config(block, n as u32), None, &options(&tls)).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(9)));
    let mut host = vec![0u8; block * n as usize];
    for (i, b) in host.iter_mut().enumerate() {
        *b = (i >> 7) as u8;
    }
    // SAFETY: `host` outlives the runner (dropped after it, below).
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: host.as_mut_ptr() as u64,
            size: block as u64,
            stride: 0,
            count: n,
        })
    }
    .unwrap();
    let entries = (0..n)
        .map(|k| DepositEntry {
            key: ScopedKey {
                namespace: ns,
                key: BlockKey::from_u64(k),
            },
            spans: vec![ElementRef { region, index: k }],
            page: None,
        })
        .collect();
    let op = runner.deposit(entries, false).unwrap();
    while !runner
        .wait_completed(Duration::from_secs(1))
        .iter()
        .any(|r| r.op == op)
    {}
    println!("{}", runner.endpoint().unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(runner);
    drop(host);
}

struct Source {
    child: std::process::Child,
    endpoint: ControlEndpoint,
}

impl Source {
    fn start(tls: &str, block: usize, n: u64) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(CHILD, format!("{}:{block}:{n}", tls.replace(',', "+")))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        Self {
            child,
            endpoint: line.trim().parse().unwrap(),
        }
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Fetches keys `keys` from the source; returns seconds.
fn fetch(
    target: &mut Runner,
    source: &ControlEndpoint,
    ns: kvcr_foundation::NamespaceId,
    keys: std::ops::Range<u64>,
    round: usize,
) -> f64 {
    let request = RequestId(format!("r{round}-{}", keys.start));
    let scoped: Vec<ScopedKey> = keys
        .clone()
        .map(|k| ScopedKey {
            namespace: ns,
            key: BlockKey::from_u64(k),
        })
        .collect();
    target.submit_hint(
        request.clone(),
        &FetchHint {
            source: source.clone(),
            block_hashes: scoped.iter().map(|k| k.key).collect(),
            mode: FetchMode::Copy,
            action_id: None,
        },
    );
    let pool = target.pool("kv").unwrap();
    let start = Instant::now();
    let op = target.fetch_hinted(&request, &scoped, &[pool]).unwrap();
    let result = loop {
        if let Some(r) = target
            .wait_completed(Duration::from_secs(5))
            .into_iter()
            .find(|r| r.op == op)
        {
            break r;
        }
    };
    let secs = start.elapsed().as_secs_f64();
    let handles: Vec<_> = result
        .entries
        .iter()
        .filter_map(|(_, e)| e.release)
        .collect();
    assert_eq!(handles.len(), scoped.len(), "not every key was fetched");
    target.release(&handles);
    target.discard_hint(&request);
    secs
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bandwidth (GB/s) of `n` fetches of `keys` keys of `block` bytes.
fn bandwidth(tls: &str, block: usize, keys: u64, reps: usize) -> f64 {
    let source = Source::start(tls, block, keys * reps as u64);
    let mut target =
        Runner::start_with_peers(config(block, keys as u32), None, &options(tls)).unwrap();
    let ns = target.register_namespace(Namespace::base(CompatDigest(9)));
    // Warm up the route (metadata, endpoint, rkeys) on a key outside the measurement.
    fetch(&mut target, &source.endpoint, ns, 0..1, usize::MAX);
    let samples: Vec<f64> = (0..reps)
        .map(|r| {
            let first = r as u64 * keys;
            let secs = fetch(&mut target, &source.endpoint, ns, first..first + keys, r);
            (block as u64 * keys) as f64 / secs / 1e9
        })
        .collect();
    median(samples)
}

/// Latencies (µs) of `iters` one-key fetches of `block` bytes, sorted.
fn one_block(tls: &str, block: usize, iters: usize) -> Vec<f64> {
    let source = Source::start(tls, block, iters as u64 + 1);
    let mut target = Runner::start_with_peers(config(block, 64), None, &options(tls)).unwrap();
    let ns = target.register_namespace(Namespace::base(CompatDigest(9)));
    fetch(&mut target, &source.endpoint, ns, 0..1, usize::MAX);
    let mut samples: Vec<f64> = (1..=iters as u64)
        .map(|k| fetch(&mut target, &source.endpoint, ns, k..k + 1, 0) * 1e6)
        .collect();
    samples.sort_by(f64::total_cmp);
    samples
}

fn at(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The distribution for the report's plot: `DIST <name> unit=us p0=.. p5=.. … p100=..`.
fn dist(name: &str, sorted: &[f64]) {
    let points: Vec<String> = (0..=20)
        .map(|i| format!("p{}={:.2}", i * 5, at(sorted, i as f64 / 20.0)))
        .collect();
    println!("DIST {name} unit=us {}", points.join(" "));
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

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        source(&spec);
        return;
    }
    if !std::env::args().any(|a| a == "--bench") {
        println!("peer bench: run with `cargo bench` or `cargo xtask bench`");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 3 } else { 7 };
    let shm_tls =
        std::env::var("KVCR_BENCH_SHM_TLS").unwrap_or_else(|_| "posix,cma,self".to_owned());
    let shm_tls = shm_tls.as_str();
    const TCP: &str = "tcp,self";
    const MIB16: usize = 16 << 20;

    let shm16 = bandwidth(shm_tls, MIB16, 8, reps);
    line(
        "peer.fetch_16mib_shm",
        shm16,
        "GB/s",
        kvcr_ucx::perftest::put_bw_gbs("posix,cma", MIB16, if quick { 60 } else { 200 }, &[]),
    );
    let shm256 = bandwidth(shm_tls, 256 << 10, 512, reps);
    let perftest256 =
        kvcr_ucx::perftest::put_bw_gbs("posix,cma", 256 << 10, if quick { 500 } else { 2000 }, &[]);
    line("peer.fetch_256kib_shm", shm256, "GB/s", perftest256);
    if let Some(p) = perftest256 {
        line("ucx.perftest_put_bw_256kib_shm", p, "GB/s", None);
    }
    let samples = one_block(shm_tls, 256 << 10, if quick { 100 } else { 500 });
    dist("peer.one_block_256kib_shm", &samples);
    line(
        "peer.one_block_p50",
        at(&samples, 0.5),
        "us",
        kvcr_ucx::perftest::put_lat_us("posix,cma", 256 << 10, if quick { 100 } else { 500 }),
    );
    println!(
        "# peer.one_block p99={:.0}us (reference runner: 4,350 us one-block hinted fetch)",
        at(&samples, 0.99)
    );
    let tcp16 = bandwidth(TCP, MIB16, 4, reps.min(3));
    line(
        "peer.fetch_16mib_tcp",
        tcp16,
        "GB/s",
        kvcr_ucx::perftest::put_bw_gbs("tcp", MIB16, if quick { 20 } else { 60 }, &["-O", "1"]),
    );
    // `cargo xtask bench --peers`: kvcr's side of the peers' workloads, over
    // TCP on loopback as they run here (the reference runner's NIXL moves
    // bytes over tcp/lo; Mooncake uses its TCP transport): 256 × 256 KiB
    // hinted fetches, and one key of 64 KiB / 1 MiB / 16 MiB per request.
    if std::env::var("KVCR_BENCH_PEERS").is_ok_and(|v| v == "1") {
        let tcp256 = bandwidth(TCP, 256 << 10, 256, reps);
        line(
            "peer.fetch_256kib_tcp",
            tcp256,
            "GB/s",
            kvcr_ucx::perftest::put_bw_gbs(
                "tcp",
                256 << 10,
                if quick { 200 } else { 400 },
                &["-O", "1"],
            ),
        );
        let iters = if quick { 50 } else { 200 };
        let samples = one_block(TCP, 256 << 10, iters);
        dist("peer.one_block_256kib_tcp", &samples);
        line(
            "peer.one_block_tcp_p50",
            at(&samples, 0.5),
            "us",
            kvcr_ucx::perftest::put_lat_us("tcp", 256 << 10, iters),
        );
        for (label, size) in [
            ("64kib", 64usize << 10),
            ("1mib", 1 << 20),
            ("16mib", MIB16),
        ] {
            let iters = if quick { 20 } else { 60 }.min((256 << 20) / size).max(8);
            let samples = one_block(TCP, size, iters);
            line(
                &format!("peer.request_{label}_tcp"),
                size as f64 / (at(&samples, 0.5) * 1e-6) / 1e9,
                "GB/s",
                kvcr_ucx::perftest::put_bw_gbs("tcp", size, iters.max(20), &["-O", "1"]),
            );
        }
    }
}
