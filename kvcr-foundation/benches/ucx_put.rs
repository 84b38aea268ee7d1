//! UCX put bandwidth through the safe layer, with `ucx_perftest` measured in
//! the same run as the anchor.
//!
//! `cargo bench -p kvcr-foundation --bench ucx_put` prints `BENCH` lines:
//! * `ucx.put_16mib_shm`: one 16 MiB put + endpoint flush per operation,
//!   median over the runs, between two contexts (source and passive
//!   destination) over `UCX_TLS=sm,self`.
//! * `ucx.put_256kib_x64_shm`: 64 puts of 256 KiB + one flush per operation.
//! * `ucx.perftest_put_bw_16mib_shm`: `ucx_perftest -t ucp_put_bw -s 16777216
//!   -n 200` between two processes on loopback, same transports (skipped with
//!   a note when `ucx_perftest` is not installed).
//!
//! `KVCR_BENCH_ITERS` overrides the number of operations (default 200).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(clippy::disallowed_methods)] // a benchmark reads the clock

mod common;
use common::median;

use std::time::{Duration, Instant};

use kvcr_foundation::ucx::{AnonOptions, Context, ContextConfig, RkeyBuffer, WorkerAddress};

const TLS: &str = "sm,self";
const MIB: usize = 1 << 20;

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: build
    // check only, no timing in tests.
    if !std::env::args().any(|a| a == "--bench") {
        println!("ucx_put bench: run with `cargo bench` or `cargo xtask bench`");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let iters: usize = std::env::var("KVCR_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 60 } else { 200 });
    let config = ContextConfig::new().loopback_tls(TLS);
    let dst_ctx = Context::with_config(&config).unwrap();
    let dst_worker = dst_ctx.create_worker().unwrap();
    let src_ctx = Context::with_config(&config).unwrap();
    let src_worker = src_ctx.create_worker().unwrap();

    let len = 16 * MIB;
    let opts = AnonOptions::new().prefault(true);
    let dst = dst_ctx.register_anon(len, opts).unwrap();
    let src = src_ctx.register_anon(len, opts).unwrap();
    src.fill(0, len, 0x5a).unwrap();
    let addr = WorkerAddress::from_bytes(dst_worker.address().unwrap().as_bytes()).unwrap();
    let ep = src_worker.connect(&addr).unwrap();
    let key = ep
        .unpack_rkey(&RkeyBuffer::from_bytes(dst.pack_rkey().unwrap().as_bytes()).unwrap())
        .unwrap();
    let wait = Duration::from_secs(30);
    // The destination must progress too: UCX wires endpoints up lazily
    // through the peer, and on shared memory 1.13 moves large puts through
    // active messages the target handles (a purely passive destination stalls
    // them). One thread drives both workers here; `ucx_perftest` runs two
    // busy-polling processes.
    let wait_both = |ops: &[kvcr_foundation::ucx::Completion]| {
        src_worker
            .progress_until(wait, || {
                dst_worker.progress();
                ops.iter().all(|c| c.is_done())
            })
            .unwrap();
        for op in ops {
            op.result().unwrap().unwrap();
        }
    };
    wait_both(&[ep.flush().unwrap()]);

    let run = |block: usize| -> f64 {
        let n = len / block;
        let mut rates = Vec::with_capacity(iters);
        for i in 0..iters + iters / 10 {
            let t = Instant::now();
            let mut ops = Vec::with_capacity(n + 1);
            for b in 0..n {
                ops.push(
                    ep.put(&src, b * block, block, &key, (b * block) as u64)
                        .unwrap(),
                );
            }
            ops.push(ep.flush().unwrap());
            wait_both(&ops);
            let secs = t.elapsed().as_secs_f64();
            if i >= iters / 10 {
                rates.push(len as f64 / secs / 1e9);
            }
        }
        median(rates)
    };
    let big = run(16 * MIB);
    println!("BENCH ucx.put_16mib_shm value={big:.3} unit=GB/s");
    let small = run(256 * 1024);
    println!("BENCH ucx.put_256kib_x64_shm value={small:.3} unit=GB/s");
    let mut probe = vec![0u8; 4096];
    dst.read(len - 4096, &mut probe).unwrap();
    assert!(probe.iter().all(|&b| b == 0x5a), "bytes did not land");
    drop((key, ep));

    match kvcr_ucx::perftest::put_bw_gbs(TLS, 16 * MIB, iters, &[]) {
        Some(gbs) => {
            println!("BENCH ucx.perftest_put_bw_16mib_shm value={gbs:.3} unit=GB/s");
            println!("ratio ucx.put_16mib_shm / perftest = {:.2}", big / gbs);
        }
        None => println!("note: ucx_perftest not available; no anchor measured"),
    }
}
