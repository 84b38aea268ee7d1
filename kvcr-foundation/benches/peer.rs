//! Peer-fetch benchmarks between two processes on loopback (this binary
//! re-executes itself as the source), each beside an anchor measured in the
//! same run: a DRAM-resident copy of the same bytes over distinct buffers
//! (one thread, or the lane count; `process_vm_readv` at the lane count),
//! and `ucx_perftest` at the same size and transports for reference. Every
//! fetched byte is checked against the source's pattern after the timing.
//!
//! `cargo bench -p kvcr-foundation --bench peer [-- --quick]` (or `cargo xtask bench`).
//! For latency work, `-- --bench --one-block` runs the one-block figure alone
//! (`KVCR_BENCH_GAP_MS=10` idles before each fetch: a cold restore;
//! `KVCR_BENCH_ONE_BLOCK_BYTES` sets another block size) and
//! `-- --bench --requests [--contended]` the one-key-per-request TCP
//! distributions (beside two busy loops), and `-- --bench --tcp-bulk` the
//! 16 MiB TCP bandwidth figure alone. `-- --bench --request-blocks <plan>`
//! serves `cargo xtask bench --peers`, which alternates kvcr's one-key
//! requests with Mooncake's in blocks, each beside the same requests over a
//! plain TCP socket (the host's loopback ceiling).

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock and sleeps
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(missing_docs)]

mod common;
use common::{at, bench, dist, median};

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvcr_foundation::hint::FetchMode;
use kvcr_foundation::protocol::ElementRef;
use kvcr_foundation::runner::{
    ControlCounters, DataStream, DepositEntry, PeerOptions, RegionDesc, Runner, RunnerConfig,
    StreamSealing,
};
use kvcr_foundation::sys;
use kvcr_foundation::{
    BlockKey, CompatDigest, ControlEndpoint, FetchHint, Namespace, RequestId, ScopedKey,
};

const CHILD: &str = "KVCR_BENCH_PEER_SOURCE";

/// How both runners of a measurement take part in the peer protocol.
#[derive(Debug, Clone, Copy)]
struct Path<'a> {
    /// UCX transports.
    tls: &'a str,
    /// Same-host one-copy mapping (off: every byte goes through UCX).
    mapping: bool,
    /// Copy lanes (0: the default, one per core up to 8).
    lanes: usize,
    /// Whether the source's deposits take page digests (the default), which
    /// the target then checks on every restore.
    digests: bool,
}

impl Path<'_> {
    fn spec(&self) -> String {
        format!(
            "{}:{}:{}:{}",
            self.tls.replace(',', "+"),
            u8::from(self.mapping),
            self.lanes,
            u8::from(self.digests)
        )
    }
}

fn options(path: Path<'_>) -> PeerOptions {
    let mut o = PeerOptions::loopback();
    o.ucx_tls = Some(path.tls.to_owned());
    o.same_host_mapping = path.mapping;
    o.lanes = path.lanes;
    // `KVCR_BENCH_WRITE_MESSAGE_BYTES`: the largest write sent as a
    // message (0: puts only), and `KVCR_BENCH_WRITE_PART_BYTES` its largest
    // part, to compare them on one binary.
    if let Some(bytes) = env_number("KVCR_BENCH_WRITE_MESSAGE_BYTES") {
        o.write_message_max_bytes = bytes;
    }
    if let Some(bytes) = env_number("KVCR_BENCH_WRITE_PART_BYTES") {
        o.write_message_part_bytes = bytes;
    }
    // `KVCR_BENCH_WRITE_BATCH_BYTES`: the bytes a fetch asks of its source
    // per write, to compare batchings on one binary.
    if let Some(bytes) = env_number("KVCR_BENCH_WRITE_BATCH_BYTES") {
        o.write_batch_bytes = bytes;
    }
    // `KVCR_BENCH_DATA_STREAM=off|on`: whether targets dial data streams
    // (default: the runner's, on over tcp alone), to compare on one binary.
    match std::env::var("KVCR_BENCH_DATA_STREAM").as_deref() {
        Ok("off") => o.data_stream = DataStream::Off,
        Ok("on") => o.data_stream = DataStream::On,
        _ => {}
    }
    // `KVCR_BENCH_STREAM_SEALING=off|on`: whether data streams carry AEAD
    // records (default: the runner's, plain without a cluster secret), to
    // compare on one binary.
    match std::env::var("KVCR_BENCH_STREAM_SEALING").as_deref() {
        Ok("off") => o.stream_sealing = StreamSealing::Off,
        Ok("on") => o.stream_sealing = StreamSealing::On,
        _ => {}
    }
    // `KVCR_BENCH_MAILBOX=off`: targets post no request to their sources'
    // mailboxes (the control session alone), to compare on one binary.
    if std::env::var("KVCR_BENCH_MAILBOX").as_deref() == Ok("off") {
        o.request_mailbox = false;
    }
    // `KVCR_BENCH_PUTS_IN_FLIGHT` and `KVCR_BENCH_PUT_CHUNK_BYTES`: the
    // source's put depth and split (0: the defaults), for tuning.
    let in_flight = env_number("KVCR_BENCH_PUTS_IN_FLIGHT");
    if let Some(n) = in_flight {
        o.max_puts_in_flight = n;
    }
    if let Some(bytes) = env_number("KVCR_BENCH_PUT_CHUNK_BYTES") {
        o.put_split.chunk_bytes = bytes;
        if let Some(n) = in_flight {
            o.put_split.max_chunks_in_flight = n;
        }
    }
    o
}

/// The number in environment variable `name`, if it is set and parses.
fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.parse().ok()
}

/// The byte at offset `i` of the source's keys laid end to end (key `k`'s
/// block starts at `k * block`): constant over each aligned run of
/// [`RUN`] bytes, so filling and checking gigabytes run at `memset` and
/// compare speed (a byte-by-byte pass took seconds per GiB, most of a
/// quick bench), while every byte is still checked.
fn pattern(i: usize) -> u8 {
    (i >> 7) as u8 ^ (i >> 19) as u8
}

/// Bytes over which [`pattern`] is constant (`i >> 7`).
const RUN: usize = 128;

/// Fills `buf`, which starts at offset `first` of the pattern.
fn fill_pattern(buf: &mut [u8], first: usize) {
    assert_eq!(first % RUN, 0, "pattern runs are {RUN}-byte aligned");
    for (n, run) in buf.chunks_mut(RUN).enumerate() {
        run.fill(pattern(first + n * RUN));
    }
}

/// The first offset in `buf` (which starts at offset `first` of the
/// pattern) whose byte differs from the pattern.
fn pattern_mismatch(buf: &[u8], first: usize) -> Option<usize> {
    assert_eq!(first % RUN, 0, "pattern runs are {RUN}-byte aligned");
    buf.chunks(RUN).enumerate().find_map(|(n, run)| {
        let want = pattern(first + n * RUN);
        run.iter().position(|&b| b != want).map(|at| n * RUN + at)
    })
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
    let mapping = parts.next().unwrap() == "1";
    let lanes: usize = parts.next().unwrap().parse().unwrap();
    let digests = parts.next().unwrap() == "1";
    let block: usize = parts.next().unwrap().parse().unwrap();
    let n: u64 = parts.next().unwrap().parse().unwrap();
    let path = Path {
        tls: &tls,
        mapping,
        lanes,
        digests,
    };
    let runner = Runner::start_with_peers(config(block, n as u32), None, &options(path)).unwrap();
    runner.set_page_digests(digests);
    let ns = runner.register_namespace(Namespace::base(CompatDigest(9)));
    // Deposited in batches through one reused staging buffer, each batch
    // filled with its keys' pattern first: one deposit of gigabytes would
    // outrun its timeout, and a buffer of them would cost a first touch of
    // every page (seconds per GiB on these VMs) for bytes copied once.
    let per_batch = ((256 << 20) / block as u64).clamp(1, n);
    let mut staging = vec![0u8; block * per_batch as usize];
    // SAFETY: `staging` outlives the runner (dropped after it, below).
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: staging.as_mut_ptr() as u64,
            size: block as u64,
            stride: 0,
            count: per_batch,
        })
    }
    .unwrap();
    for first in (0..n).step_by(per_batch as usize) {
        let keys = first..(first + per_batch).min(n);
        // The deposit before has completed: its bytes are in the pool.
        fill_pattern(&mut staging, first as usize * block);
        let entries = keys
            .map(|k| DepositEntry {
                key: ScopedKey {
                    namespace: ns,
                    key: BlockKey::from_u64(k),
                },
                spans: vec![ElementRef {
                    region,
                    index: k - first,
                }],
                page: None,
            })
            .collect();
        let op = runner.deposit(entries, false).unwrap();
        while !runner
            .wait_completed(Duration::from_secs(1))
            .iter()
            .any(|r| r.op == op)
        {}
    }
    println!("{}", runner.peers().endpoint().unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    let stats = runner.peers().control_stats();
    if stats.mailbox_requests_taken + stats.mailbox_requests_refused > 0 {
        eprintln!(
            "# source: {} requests taken from its mailboxes ({} refused), {} socket copies dropped",
            stats.mailbox_requests_taken,
            stats.mailbox_requests_refused,
            stats.early_copies_dropped
        );
    }
    if stats.pages_checked_in_copy + stats.pages_altered_at_source > 0 {
        eprintln!(
            "# source: {} pages checked in its copy, {} found altered",
            stats.pages_checked_in_copy, stats.pages_altered_at_source
        );
    }
    drop(runner);
    drop(staging);
}

struct Source {
    child: std::process::Child,
    endpoint: ControlEndpoint,
}

impl Source {
    fn start(path: Path<'_>, block: usize, n: u64) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(CHILD, format!("{}:{block}:{n}", path.spec()))
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
    target.hints().submit(
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
    let op = target.hints().fetch(&request, &scoped, &[pool]).unwrap();
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
    // Every byte checked, outside the timing: some UCX settings corrupt
    // data silently.
    for (k, handle) in keys.clone().zip(&handles) {
        let bytes = target.read_claimed(*handle, 0).unwrap();
        let first = k as usize * bytes.len();
        if let Some(at) = pattern_mismatch(&bytes, first) {
            panic!("key {k}: byte {at} differs after the fetch");
        }
    }
    target.release(&handles);
    target.hints().discard(&request);
    secs
}

/// Bandwidth (GB/s): the median of `reps` fetches of `keys` keys of
/// `block` bytes, each of distinct pages, after one more that warms up
/// (the source holds `keys * (reps + 1)`).
fn bandwidth(path: Path<'_>, block: usize, keys: u64, reps: usize) -> f64 {
    bandwidth_and_counters(path, block, keys, reps).0
}

/// As [`bandwidth`], with the target's control counters at the end (the
/// source, a process of its own, prints its own as it exits).
fn bandwidth_and_counters(
    path: Path<'_>,
    block: usize,
    keys: u64,
    reps: usize,
) -> (f64, ControlCounters) {
    let source = Source::start(path, block, keys * (reps as u64 + 1));
    let mut target =
        Runner::start_with_peers(config(block, keys as u32), None, &options(path)).unwrap();
    let ns = target.register_namespace(Namespace::base(CompatDigest(9)));
    // Warm up the route (metadata, endpoint, rkeys) and the source's
    // mapping of every target slot with one fetch of keys outside the
    // measurement: each figure is a steady state. A route's first write
    // into fresh slots also builds the source's page tables for them
    // (2-vCPU VM: the first of three fetches ran at 4–11 GB/s quiet and
    // 0.8–6 GB/s beside two busy loops, against 11–22 for the next two,
    // and decided the median); an engine's routes are up, and the source's
    // background population done, long before a large restore, and the
    // one-block figures keep that first touch in their tail.
    fetch(&mut target, &source.endpoint, ns, 0..keys, usize::MAX);
    let samples: Vec<f64> = (0..reps)
        .map(|r| {
            let first = (1 + r as u64) * keys;
            let secs = fetch(&mut target, &source.endpoint, ns, first..first + keys, r);
            (block as u64 * keys) as f64 / secs / 1e9
        })
        .collect();
    (median(samples), target.peers().control_stats())
}

/// `peer.digest_cost_{one,all}_lane(s)`: restore throughput with page
/// digests (taken at the source's deposit, checked by the target on
/// landing) over the same restores without, measured alternately in the
/// same round: 256 MiB of distinct 16 MiB pages per fetch.
fn digest_cost(one_lane: Path<'_>, many_lanes: Path<'_>, reps: usize) {
    const MIB16: usize = 16 << 20;
    for (name, path) in [
        ("peer.digest_cost_one_lane", one_lane),
        ("peer.digest_cost_all_lanes", many_lanes),
    ] {
        let (mut on, mut off) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            let (with, target) = bandwidth_and_counters(path, MIB16, 16, reps);
            println!(
                "# {name}: {} writes taken as checked in the source's copy, not read again \
                 ({} of them completed by a doorbell record)",
                target.landings_checked_in_copy, target.doorbells_taken,
            );
            on.push(with);
            let without = Path {
                digests: false,
                ..path
            };
            off.push(bandwidth(without, MIB16, 16, reps));
        }
        bench(name, median(on), "GB/s", Some(median(off)));
    }
}

/// One key of `block` bytes per request from a source of its own: the
/// route warmed up by one fetch, then each request takes the next key.
struct Requests {
    // Dropped before the source it fetches from (as a target goes first
    // when an engine shuts down).
    target: Runner,
    ns: kvcr_foundation::NamespaceId,
    next_key: u64,
    keys: u64,
    source: Source,
}

impl Requests {
    /// A source holding `requests + 1` keys (one warms the route up) and a
    /// target of 64 slots.
    fn start(path: Path<'_>, block: usize, requests: usize) -> Self {
        let keys = requests as u64 + 1;
        let source = Source::start(path, block, keys);
        let mut target = Runner::start_with_peers(config(block, 64), None, &options(path)).unwrap();
        let ns = target.register_namespace(Namespace::base(CompatDigest(9)));
        fetch(&mut target, &source.endpoint, ns, 0..1, usize::MAX);
        Self {
            target,
            ns,
            next_key: 1,
            keys,
            source,
        }
    }

    /// Fetches the next key; returns µs.
    fn next(&mut self) -> f64 {
        let k = self.next_key;
        assert!(k < self.keys, "more requests than the source holds");
        self.next_key += 1;
        fetch(
            &mut self.target,
            &self.source.endpoint,
            self.ns,
            k..k + 1,
            0,
        ) * 1e6
    }
}

/// The ceiling beside a series of one-key requests over TCP: one plain
/// loopback TCP connection, no protocol at all. A server thread answers
/// each request (an 8-byte page index) with that page of its own buffer of
/// distinct pages, as a source holds distinct keys; the client reads each
/// answer into a destination page (prefaulted, reused after 64, as the
/// target's pool slots are). What one request at a time of this size can
/// get from this host's loopback TCP, against which both kvcr's requests
/// and Mooncake's read are measured in the same blocks.
struct PlainSocket {
    stream: std::net::TcpStream,
    destination: Vec<u8>,
    block: usize,
    next_page: usize,
    pages: usize,
    // Ends when the stream closes (dropped first).
    server: Option<std::thread::JoinHandle<()>>,
}

impl PlainSocket {
    fn start(block: usize, pages: usize) -> Self {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let mut source = vec![0u8; block * pages];
        fill_pattern(&mut source, 0);
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            stream.set_nodelay(true).unwrap();
            let mut index = [0u8; 8];
            while stream.read_exact(&mut index).is_ok() {
                let page = usize::try_from(u64::from_le_bytes(index)).unwrap();
                stream
                    .write_all(&source[page * block..(page + 1) * block])
                    .unwrap();
            }
        });
        let stream = std::net::TcpStream::connect(address).unwrap();
        stream.set_nodelay(true).unwrap();
        let mut socket = Self {
            stream,
            destination: vec![1u8; block * pages.min(64)],
            block,
            next_page: 0,
            pages,
            server: Some(server),
        };
        // Warm up as the kvcr series does: one request outside the figures.
        socket.next();
        socket.next_page = 0;
        socket
    }

    /// Reads the next page; returns µs (its bytes checked after the timing).
    fn next(&mut self) -> f64 {
        use std::io::{Read, Write};
        let page = self.next_page;
        assert!(page < self.pages, "more requests than the server holds");
        self.next_page += 1;
        let slot = page % (self.destination.len() / self.block);
        let into = &mut self.destination[slot * self.block..(slot + 1) * self.block];
        let start = Instant::now();
        self.stream.write_all(&(page as u64).to_le_bytes()).unwrap();
        self.stream.read_exact(into).unwrap();
        let secs = start.elapsed().as_secs_f64();
        if let Some(at) = pattern_mismatch(into, page * self.block) {
            panic!("plain socket page {page}: byte {at} differs");
        }
        secs * 1e6
    }
}

impl Drop for PlainSocket {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

/// Serves `cargo xtask bench --peers`: for each `label:bytes:requests` of
/// `plan`, a source and target of its own, warmed up, and a plain socket
/// pair ([`PlainSocket`]); prints `READY`, then for each line
/// `<label> <count>` on stdin fetches the next `count` keys of that size,
/// reads as many pages through the plain socket (which goes first
/// alternates), and prints `SAMPLES <label> <µs>,… socket=<µs>,…`, until
/// stdin closes. xtask alternates these blocks with the same blocks of
/// Mooncake's driver, so a slow stretch of a shared host falls on every
/// side of a comparison.
fn request_blocks(path: Path<'_>, plan: &str) {
    let mut series: Vec<(String, Requests, PlainSocket)> = plan
        .split(',')
        .map(|entry| {
            let mut fields = entry.split(':');
            let (Some(label), Some(bytes), Some(requests), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                panic!("--request-blocks: {entry:?} is not label:bytes:requests");
            };
            let bytes: usize = bytes.parse().expect("--request-blocks: bytes");
            let requests: usize = requests.parse().expect("--request-blocks: requests");
            (
                label.to_owned(),
                Requests::start(path, bytes, requests),
                PlainSocket::start(bytes, requests),
            )
        })
        .collect();
    let mut socket_first = false;
    println!("READY");
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let Some((label, count)) = line.split_once(' ') else {
            panic!("--request-blocks: {line:?} is not `<label> <count>`");
        };
        let count: usize = count.trim().parse().expect("--request-blocks: count");
        let Some((_, requests, socket)) = series.iter_mut().find(|(l, ..)| l == label) else {
            panic!("--request-blocks: no series {label:?}");
        };
        let run = |next: &mut dyn FnMut() -> f64| -> String {
            let samples: Vec<String> = (0..count).map(|_| format!("{:.1}", next())).collect();
            samples.join(",")
        };
        socket_first = !socket_first;
        let (kvcr, plain) = if socket_first {
            let plain = run(&mut || socket.next());
            (run(&mut || requests.next()), plain)
        } else {
            let kvcr = run(&mut || requests.next());
            (kvcr, run(&mut || socket.next()))
        };
        println!("SAMPLES {label} {kvcr} socket={plain}");
        std::io::stdout().flush().unwrap();
    }
}

/// Latencies (µs) of `iters` one-key fetches of `block` bytes, sorted.
fn one_block(path: Path<'_>, block: usize, iters: usize) -> Vec<f64> {
    let mut requests = Requests::start(path, block, iters);
    let mut samples: Vec<f64> = (1..=iters as u64)
        .map(|k| {
            // `KVCR_BENCH_GAP_MS`: idle this long before each fetch, so every
            // thread on both sides has gone to sleep (a cold restore, as an
            // engine between requests sees it; 10 ms here: ~700 µs against
            // ~180 µs back to back, each hop paying an idle vCPU's wake-up).
            if let Some(gap) = env_number("KVCR_BENCH_GAP_MS") {
                std::thread::sleep(Duration::from_millis(gap));
            }
            let took = requests.next();
            // With `KVCR_BENCH_SERIES`: the monotonic clock every 50
            // requests, to find a stretch in a scheduler trace taken with
            // `perf sched record -k mono`.
            if k % 50 == 0 && std::env::var_os("KVCR_BENCH_SERIES").is_some() {
                let now = sys::process::monotonic_clock();
                println!("# mark {k} {}.{:06}", now.as_secs(), now.subsec_micros());
            }
            took
        })
        .collect();
    let target = &requests.target;
    let stats = target.peers().control_stats();
    println!(
        "# one-block {} B over {}: of {} writes, {} completed on the doorbell ({} records refused), \
         {} write message parts taken ({} refused), {} data stream frames taken ({} refused), \
         {} requests also posted to the source's mailbox",
        block,
        path.tls,
        iters,
        stats.doorbells_taken,
        stats.doorbells_refused,
        stats.write_messages_taken,
        stats.write_messages_refused,
        stats.stream_writes_taken,
        stats.stream_writes_refused,
        stats.mailbox_requests_posted
    );
    if std::env::var_os("KVCR_BENCH_SERIES").is_some() {
        let windows: Vec<String> = samples
            .chunks(50)
            .map(|w| {
                let mut w = w.to_vec();
                w.sort_by(f64::total_cmp);
                format!("{:.0}", w[w.len() / 2])
            })
            .collect();
        println!("# series (median per 50): {}", windows.join(" "));
    }
    samples.sort_by(f64::total_cmp);
    samples
}

/// Anchors: copies of `bytes` between distinct, prefaulted, DRAM-resident
/// buffers (each larger than any cache here), the way a lane copies.
struct CopyAnchor {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl CopyAnchor {
    fn new(bytes: usize) -> Self {
        // 4 KiB pages, as the pools have (shared memory takes no
        // transparent huge pages on these hosts): the same page walk as the
        // route it anchors. Advised before the first touch.
        let mut src: Vec<u8> = Vec::with_capacity(bytes);
        let mut dst: Vec<u8> = Vec::with_capacity(bytes);
        // Best effort, as before: a refusal leaves the default backing.
        let _ = sys::mapping::advise_no_huge_pages(src.spare_capacity_mut());
        let _ = sys::mapping::advise_no_huge_pages(dst.spare_capacity_mut());
        src.resize(bytes, 0);
        fill_pattern(&mut src, 0);
        dst.resize(bytes, 1u8);
        Self { src, dst }
    }

    /// GB/s of `threads` threads each copying its share with `memcpy`.
    /// Each `memcpy` moves at most `piece` bytes (a page of the fetch it
    /// anchors, as the lanes copy page by page; `usize::MAX`: one call).
    fn memcpy(&mut self, threads: usize, piece: usize) -> f64 {
        let share = self.src.len().div_ceil(threads);
        let start = Instant::now();
        std::thread::scope(|scope| {
            for (d, s) in self.dst.chunks_mut(share).zip(self.src.chunks(share)) {
                scope.spawn(move || {
                    for (d, s) in d.chunks_mut(piece).zip(s.chunks(piece)) {
                        d.copy_from_slice(s);
                    }
                });
            }
        });
        let secs = start.elapsed().as_secs_f64();
        assert!(self.dst == self.src, "anchor copy corrupted");
        self.dst.fill(1);
        self.src.len() as f64 / secs / 1e9
    }

    /// GB/s of `threads` threads each reading its share with
    /// `process_vm_readv` (the kernel's cross-process copy; here from this
    /// process, which costs the same page walk and copy); `None` if the
    /// kernel refuses it.
    fn process_vm_readv(&mut self, threads: usize) -> Option<f64> {
        let share = self.src.len().div_ceil(threads);
        let pid = std::process::id();
        let start = Instant::now();
        let ok = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .dst
                .chunks_mut(share)
                .zip(self.src.chunks(share))
                .map(|(d, s)| {
                    scope.spawn(move || {
                        let mut done = 0;
                        while done < d.len() {
                            let from = s[done..].as_ptr() as u64;
                            match sys::process::read_remote(pid, from, &mut d[done..]) {
                                Ok(n) if n > 0 => done += n,
                                _ => return false,
                            }
                        }
                        true
                    })
                })
                .collect();
            handles.into_iter().all(|h| h.join().unwrap())
        });
        let secs = start.elapsed().as_secs_f64();
        if !ok {
            return None;
        }
        assert!(self.dst == self.src, "process_vm_readv anchor corrupted");
        self.dst.fill(1);
        Some(self.src.len() as f64 / secs / 1e9)
    }
}

/// Two processes spinning beside the measurement (`--contended`).
struct BusyLoops(Vec<std::process::Child>);

impl BusyLoops {
    fn start(n: usize) -> Self {
        Self(
            (0..n)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .unwrap()
                })
                .collect(),
        )
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// CPU seconds (user + system) `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command (which may hold spaces) start past its ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    let hz = sys::process::clock_ticks_per_second().unwrap() as f64;
    ticks / hz
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
    let lanes = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let one_lane = Path {
        tls: shm_tls,
        mapping: true,
        lanes: 1,
        digests: true,
    };
    let many_lanes = Path { lanes, ..one_lane };
    let through_ucx = Path {
        mapping: false,
        ..one_lane
    };
    let tcp = Path {
        tls: TCP,
        mapping: false,
        lanes: 1,
        digests: true,
    };

    // `--request-blocks <label>:<bytes>:<requests>,…`: one-key requests over
    // TCP in blocks on command, for `cargo xtask bench --peers`, which
    // alternates them with Mooncake's (see `request_blocks`).
    if let Some(plan) = std::env::args()
        .skip_while(|a| a != "--request-blocks")
        .nth(1)
    {
        request_blocks(tcp, &plan);
        return;
    }
    // `--requests`: only the one-key-per-request TCP figures, with their
    // distributions (for latency work on them).
    if std::env::args().any(|a| a == "--requests") {
        // `--contended`: with two busy loops beside.
        let _busy = std::env::args()
            .any(|a| a == "--contended")
            .then(|| BusyLoops::start(2));
        // `KVCR_BENCH_REQUEST_TLS`: another UCX transport list for the same
        // series (pools never mapped: every byte goes through UCX), e.g.
        // `posix,cma,self`; its figures are named `..._ucx` then.
        let tls = std::env::var("KVCR_BENCH_REQUEST_TLS").ok();
        let (path, route) = match tls.as_deref() {
            Some(tls) => (Path { tls, ..tcp }, "ucx"),
            None => (tcp, "tcp"),
        };
        for (label, size) in [
            ("64kib", 64usize << 10),
            ("128kib", 128 << 10),
            ("256kib", 256 << 10),
            ("1mib", 1 << 20),
        ] {
            // `KVCR_BENCH_REQUEST_ITERS`: requests per size (40); with
            // `KVCR_BENCH_SERIES` set, the medians of each 50 in order are
            // printed too (a slow stretch shows as a run of high medians).
            let n = env_number("KVCR_BENCH_REQUEST_ITERS").unwrap_or(40);
            let samples = one_block(path, size, n);
            dist(&format!("peer.request_{label}_{route}"), &samples);
        }
        return;
    }
    // `--tcp-bulk`: only the 16 MiB TCP bandwidth figure and its anchor
    // (for tuning the tcp transport; `UCX_TCP_*` in the environment wins
    // over kvcr's segment sizes, so settings can be compared run by run).
    if std::env::args().any(|a| a == "--tcp-bulk") {
        // `KVCR_BENCH_TCP_REPS`: fetches to take the median of (a long
        // run to profile).
        let reps = env_number("KVCR_BENCH_TCP_REPS").unwrap_or(reps);
        let tcp16 = bandwidth(tcp, MIB16, 4, reps);
        bench(
            "peer.fetch_16mib_tcp",
            tcp16,
            "GB/s",
            kvcr_ucx::perftest::put_bw_gbs("tcp", MIB16, 20, &["-O", "1"]),
        );
        return;
    }
    // Same-host figures depend on it: with huge pages a source's mapping of
    // a pool is one page-table entry per 2 MiB.
    println!(
        "# peer: shared-memory huge pages {} on this host",
        if kvcr_foundation::runner::shared_memory_huge_pages() {
            "allowed (pools get them)"
        } else {
            "not allowed (4 KiB pages)"
        }
    );
    // `--digest-cost`: only `peer.digest_cost_*` (for digest work).
    if std::env::args().any(|a| a == "--digest-cost") {
        digest_cost(one_lane, many_lanes, reps);
        return;
    }
    // `--one-block`: only the latency figure (for latency work).
    if std::env::args().any(|a| a == "--one-block") {
        // `KVCR_BENCH_ONE_BLOCK_BYTES`: another block size, named by it,
        // to split a restore's fixed cost from its copy.
        let block = env_number("KVCR_BENCH_ONE_BLOCK_BYTES").unwrap_or(256 << 10);
        let samples = one_block(many_lanes, block, if quick { 100 } else { 500 });
        if block == 256 << 10 {
            dist("peer.one_block_256kib_shm", &samples);
            bench("peer.one_block_p50", at(&samples, 0.5), "us", None);
        } else {
            dist(&format!("peer.one_block_{block}b_shm"), &samples);
        }
        return;
    }

    // What checking every page costs a restore: the same fetches with the
    // source's deposits digested (so the target checks every landed page)
    // and not, one lane and all lanes.
    digest_cost(one_lane, many_lanes, reps);
    // `--digest-cost`: only those figures.
    if std::env::args().any(|a| a == "--digest-cost") {
        return;
    }

    // Bulk: 1 GiB of distinct 16 MiB pages per fetch (the source holds
    // `reps + 1` GiB), beside copies of 1 GiB between distinct buffers.
    let bulk_keys = 64;
    let bulk_bytes = bulk_keys as usize * MIB16;
    let mut anchor = CopyAnchor::new(bulk_bytes);
    let memcpy_1 = median((0..reps).map(|_| anchor.memcpy(1, MIB16)).collect());
    let memcpy_whole = median((0..reps).map(|_| anchor.memcpy(1, usize::MAX)).collect());
    let bulk_1 = bandwidth(one_lane, MIB16, bulk_keys, reps);
    bench("peer.fetch_bulk_shm", bulk_1, "GB/s", Some(memcpy_1));
    println!(
        "# peer.fetch_bulk_shm: anchor copies page by page (16 MiB per memcpy); \
         one 1 GiB memcpy: {memcpy_whole:.2} GB/s"
    );
    let memcpy_n = median((0..reps).map(|_| anchor.memcpy(lanes, MIB16)).collect());
    let pvr_n = (0..reps)
        .map(|_| anchor.process_vm_readv(lanes))
        .collect::<Option<Vec<f64>>>()
        .map(median);
    let bulk_n = bandwidth(many_lanes, MIB16, bulk_keys, reps);
    bench(
        "peer.fetch_lanes_shm",
        bulk_n,
        "GB/s",
        pvr_n.or(Some(memcpy_n)),
    );
    println!(
        "# peer.fetch_lanes_shm: {lanes} lanes; memcpy at {lanes} threads {memcpy_n:.2} GB/s, \
         process_vm_readv at {lanes} threads {} GB/s, 1 thread memcpy {memcpy_1:.2} GB/s",
        pvr_n.map_or("refused".to_owned(), |v| format!("{v:.2}"))
    );
    drop(anchor);
    let contended = {
        let _busy = BusyLoops::start(2);
        bandwidth(many_lanes, MIB16, bulk_keys / 4, reps)
    };
    let quiet = bandwidth(many_lanes, MIB16, bulk_keys / 4, reps);
    bench("peer.fetch_contended", contended, "GB/s", Some(quiet));

    let shm16 = bandwidth(many_lanes, MIB16, 8, reps);
    bench(
        "peer.fetch_16mib_shm",
        shm16,
        "GB/s",
        kvcr_ucx::perftest::put_bw_gbs("posix,cma", MIB16, if quick { 60 } else { 200 }, &[]),
    );
    let ucx16 = bandwidth(through_ucx, MIB16, 8, reps);
    bench("peer.fetch_16mib_shm_ucx", ucx16, "GB/s", Some(shm16));
    let shm256 = bandwidth(many_lanes, 256 << 10, 512, reps);
    let perftest256 =
        kvcr_ucx::perftest::put_bw_gbs("posix,cma", 256 << 10, if quick { 500 } else { 2000 }, &[]);
    bench("peer.fetch_256kib_shm", shm256, "GB/s", perftest256);
    if let Some(p) = perftest256 {
        bench("ucx.perftest_put_bw_256kib_shm", p, "GB/s", None);
    }
    let samples = one_block(many_lanes, 256 << 10, if quick { 100 } else { 500 });
    dist("peer.one_block_256kib_shm", &samples);
    bench(
        "peer.one_block_p50",
        at(&samples, 0.5),
        "us",
        kvcr_ucx::perftest::put_lat_us("posix,cma", 256 << 10, if quick { 100 } else { 500 }),
    );
    println!(
        "# peer.one_block p99={:.0}us (reference runner: 4,350 us one-block hinted fetch)",
        at(&samples, 0.99)
    );
    let tcp16 = bandwidth(tcp, MIB16, 4, reps.min(3));
    bench(
        "peer.fetch_16mib_tcp",
        tcp16,
        "GB/s",
        kvcr_ucx::perftest::put_bw_gbs("tcp", MIB16, if quick { 20 } else { 60 }, &["-O", "1"]),
    );

    // One 64 KiB request at a time over TCP beside two busy loops, against
    // the same quiet: on a crowded host an awake wait gives whole time
    // slices away (see the runner's `contention`; before it, 3.9–4.0 ms
    // per request on the 2-vCPU VM).
    // The quiet run first, after a pause: a wait that ran late in the
    // phases before (or beside the busy loops) keeps this process's runners
    // off spinning for a second, which would slow the anchor.
    let iters = if quick { 40 } else { 100 };
    std::thread::sleep(Duration::from_millis(1500));
    let quiet = one_block(tcp, 64 << 10, iters);
    let crowded = {
        let _busy = BusyLoops::start(2);
        one_block(tcp, 64 << 10, iters)
    };
    dist("peer.request_64kib_tcp_contended", &crowded);
    bench(
        "peer.request_64kib_tcp_contended_p50",
        at(&crowded, 0.5),
        "us",
        Some(at(&quiet, 0.5)),
    );

    // An idle source: CPU seconds per second while it holds pages and
    // nobody asks for them.
    let idle = {
        let source = Source::start(many_lanes, 256 << 10, 16);
        std::thread::sleep(Duration::from_secs(1));
        let before = cpu_seconds(source.child.id());
        let secs = if quick { 3.0 } else { 10.0 };
        std::thread::sleep(Duration::from_secs_f64(secs));
        (cpu_seconds(source.child.id()) - before) / secs
    };
    bench("peer.idle_cpu", idle, "cpu_s/s", None);

    // `cargo xtask bench --peers`: kvcr's side of the peers' workloads, over
    // TCP on loopback as they run here (the reference runner's NIXL moves
    // bytes over tcp/lo; Mooncake uses its TCP transport): 256 × 256 KiB
    // hinted fetches, and one key of 64 KiB / 1 MiB / 16 MiB per request.
    if std::env::var("KVCR_BENCH_PEERS").is_ok_and(|v| v == "1") {
        let tcp256 = bandwidth(tcp, 256 << 10, 256, reps);
        bench(
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
        let samples = one_block(tcp, 256 << 10, iters);
        dist("peer.one_block_256kib_tcp", &samples);
        bench(
            "peer.one_block_tcp_p50",
            at(&samples, 0.5),
            "us",
            kvcr_ucx::perftest::put_lat_us("tcp", 256 << 10, iters),
        );
        // One key per request (`peer.request_*_tcp`): measured by xtask in
        // blocks alternated with Mooncake's (`--request-blocks`).
    }
}
