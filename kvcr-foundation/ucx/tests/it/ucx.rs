//! Real UCX RMA on loopback: destination-initiated puts between two workers
//! (one process: two contexts; two processes: this binary re-executed as the
//! source), over shared memory and over tcp, with byte verification; and the
//! refusals the safe layer makes before UCX sees bad input.
//!
//! Transports are chosen per context with `ucp_config_modify`
//! (`ContextConfig::loopback_tls`), never through the process environment,
//! so these tests run in parallel; tcp is pinned to `lo`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kvcr_ucx::{
    AnonOptions, CloseMode, Context, ContextConfig, Endpoint, ErrorMode, Registration, RemoteKey,
    RkeyBuffer, UcsStatus, UcxReason, Worker, WorkerAddress,
};

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;
const SHM: &str = "sm,self";
const CMA: &str = "posix,cma,self";
const TCP: &str = "tcp,self";
const WAIT: Duration = Duration::from_secs(60);

/// A deterministic byte pattern that differs per offset and per seed.
fn pattern(seed: u64, offset: usize, len: usize) -> Vec<u8> {
    (offset..offset + len)
        .map(|i| {
            let x = (i as u64 ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            (x >> 29) as u8
        })
        .collect()
}

struct Side {
    ctx: Context,
    worker: Worker,
}

fn side(tls: &str) -> Side {
    let ctx = Context::with_config(&ContextConfig::new().loopback_tls(tls)).unwrap();
    let worker = ctx.create_worker().unwrap();
    Side { ctx, worker }
}

/// Progresses both workers (one thread drives both sides) until `done`.
fn drive(a: &Worker, b: &Worker, mut done: impl FnMut() -> bool) {
    a.progress_until(WAIT, || {
        b.progress();
        done()
    })
    .unwrap();
}

fn assert_no_drop_errors(ctx: &Context) {
    let (errors, dropped) = ctx.take_drop_errors();
    assert!(errors.is_empty() && dropped == 0, "{errors:?} (+{dropped})");
}

/// The plan every RMA test runs: one 16 MiB put, then eight 256 KiB puts to
/// scattered offsets (the second region), one flush, then verification.
const BIG: usize = 16 * MIB;
const BLOCK: usize = 256 * KIB;
const BLOCKS: usize = 8;
const BLOCK_REGION: usize = 4 * MIB;

fn block_offsets() -> impl Iterator<Item = (usize, usize)> {
    // (source offset, destination offset): reversed, 4 KiB gaps between.
    (0..BLOCKS).map(|i| (i * BLOCK, (BLOCKS - 1 - i) * (BLOCK + 4 * KIB)))
}

/// Source side: puts the plan from `big`/`blocks` through `ep` into the
/// destination's regions, then flushes. Returns the completions to wait on.
fn issue_plan(
    ep: &Endpoint,
    big: &Registration<'_>,
    blocks: &Registration<'_>,
    big_key: &RemoteKey,
    block_key: &RemoteKey,
) -> Vec<kvcr_ucx::Completion> {
    let mut ops = vec![ep.put(big, 0, BIG, big_key, 0).unwrap()];
    for (src, dst) in block_offsets() {
        ops.push(ep.put(blocks, src, BLOCK, block_key, dst as u64).unwrap());
    }
    ops.push(ep.flush().unwrap());
    ops
}

fn fill_source(big: &Registration<'_>, blocks: &Registration<'_>) {
    big.write(0, &pattern(1, 0, BIG)).unwrap();
    blocks.write(0, &pattern(2, 0, BLOCK * BLOCKS)).unwrap();
}

fn verify_destination(big: &Registration<'_>, blocks: &Registration<'_>) {
    let mut got = vec![0u8; BIG];
    big.read(0, &mut got).unwrap();
    assert!(got == pattern(1, 0, BIG), "16 MiB put: bytes differ");
    let mut got = vec![0u8; BLOCK];
    for (src, dst) in block_offsets() {
        blocks.read(dst, &mut got).unwrap();
        assert!(
            got == pattern(2, src, BLOCK),
            "256 KiB block at {dst}: bytes differ"
        );
    }
}

fn rma_in_one_process(tls: &str) {
    let dst = side(tls);
    let src = side(tls);
    // Destination: registers and grants (packs rkeys), sends its address.
    let dst_big = dst
        .ctx
        .register_anon(BIG, AnonOptions::new().prefault(true))
        .unwrap();
    let dst_blocks = dst
        .ctx
        .register_anon(BLOCK_REGION, AnonOptions::new())
        .unwrap();
    let wire_addr = dst.worker.address().unwrap().as_bytes().to_vec();
    let wire_big = dst_big.pack_rkey().unwrap().as_bytes().to_vec();
    let wire_blocks = dst_blocks.pack_rkey().unwrap().as_bytes().to_vec();

    // Source: connects, unpacks, puts from its own registered DRAM, flushes.
    let src_big = src.ctx.register_anon(BIG, AnonOptions::new()).unwrap();
    let src_blocks = src.ctx.register_vec(vec![0; BLOCK * BLOCKS]).unwrap();
    fill_source(&src_big, &src_blocks);
    let ep = src
        .worker
        .connect(&WorkerAddress::from_bytes(&wire_addr).unwrap())
        .unwrap();
    let big_key = ep
        .unpack_rkey(&RkeyBuffer::from_bytes(&wire_big).unwrap())
        .unwrap();
    let block_key = ep
        .unpack_rkey(&RkeyBuffer::from_bytes(&wire_blocks).unwrap())
        .unwrap();
    let ops = issue_plan(&ep, &src_big, &src_blocks, &big_key, &block_key);
    drive(&src.worker, &dst.worker, || ops.iter().all(|c| c.is_done()));
    for op in &ops {
        op.result().unwrap().unwrap();
    }
    assert_eq!(src_big.in_flight(), 0);
    verify_destination(&dst_big, &dst_blocks);

    // Teardown in a deliberately awkward order: the worker handle and the
    // endpoint go before the rkeys and the memory; the Rc graph keeps UCX's
    // order (rkey → endpoint → worker; unmap → cleanup) anyway.
    drop(src.worker);
    drop(ep);
    drop(big_key);
    drop(block_key);
    drop(src_big);
    drop(src_blocks);
    assert_no_drop_errors(&src.ctx);
    assert_no_drop_errors(&dst.ctx);
}

#[test]
fn put_16mib_and_256kib_blocks_between_two_contexts_over_shm() {
    rma_in_one_process(SHM);
}

#[test]
fn put_16mib_and_256kib_blocks_between_two_contexts_over_posix_cma() {
    rma_in_one_process(CMA);
}

#[test]
fn put_16mib_and_256kib_blocks_between_two_contexts_over_tcp() {
    rma_in_one_process(TCP);
}

// ---------------------------------------------------------------------------
// Two processes: this test binary re-executed as the source.

const CHILD_ENV: &str = "KVCR_UCX_TEST_SOURCE_TLS";
const CHILD_TEST: &str = "ucx::source_process_entry";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The source half of the two-process tests. Run by the parent as
/// `it ucx::source_process_entry --exact` with `KVCR_UCX_TEST_SOURCE_TLS`
/// set; reads the destination's worker address and two rkeys (hex lines) on
/// stdin, runs the put plan, flushes, and prints `KVCR-DONE`. Run without
/// the variable (the normal test run), it has no peer and returns at once.
#[test]
fn source_process_entry() {
    let Ok(tls) = std::env::var(CHILD_ENV) else {
        return;
    };
    let src = side(&tls);
    let mut lines = std::io::stdin().lock().lines();
    let mut next = || unhex(lines.next().unwrap().unwrap().trim());
    let (addr, big, blocks) = (next(), next(), next());
    let src_big = src.ctx.register_anon(BIG, AnonOptions::new()).unwrap();
    let src_blocks = src
        .ctx
        .register_anon(BLOCK * BLOCKS, AnonOptions::new())
        .unwrap();
    fill_source(&src_big, &src_blocks);
    let ep = src
        .worker
        .connect(&WorkerAddress::from_bytes(&addr).unwrap())
        .unwrap();
    let big_key = ep
        .unpack_rkey(&RkeyBuffer::from_bytes(&big).unwrap())
        .unwrap();
    let block_key = ep
        .unpack_rkey(&RkeyBuffer::from_bytes(&blocks).unwrap())
        .unwrap();
    let ops = issue_plan(&ep, &src_big, &src_blocks, &big_key, &block_key);
    src.worker.wait_all(&ops, WAIT).unwrap();
    println!("KVCR-DONE");
    std::io::stdout().flush().unwrap();
    // Wait for the destination's verdict before tearing down, so a graceful
    // close finds the peer alive.
    assert_eq!(lines.next().unwrap().unwrap().trim(), "bye");
    drop((big_key, block_key, ep));
    assert_no_drop_errors(&src.ctx);
}

/// Ends the source process (by its own handle) if the test fails early.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn rma_across_processes(tls: &str) {
    let dst = side(tls);
    let dst_big = dst
        .ctx
        .register_anon(BIG, AnonOptions::new().prefault(true))
        .unwrap();
    let dst_blocks = dst
        .ctx
        .register_anon(BLOCK_REGION, AnonOptions::new())
        .unwrap();
    let mut child = KillOnDrop(
        Command::new(std::env::current_exe().unwrap())
            .args([CHILD_TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, tls)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let child = &mut child.0;
    let mut stdin = child.stdin.take().unwrap();
    for blob in [
        dst.worker.address().unwrap().as_bytes().to_vec(),
        dst_big.pack_rkey().unwrap().as_bytes().to_vec(),
        dst_blocks.pack_rkey().unwrap().as_bytes().to_vec(),
    ] {
        writeln!(stdin, "{}", hex(&blob)).unwrap();
    }
    stdin.flush().unwrap();
    // A reader thread watches the child's stdout; this thread keeps the
    // destination worker progressing (tcp needs the target side to progress)
    // and sleeps on its event fd in between.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            // libtest prints "test <name> ... " before the test's own output.
            if line.ends_with("KVCR-DONE") {
                tx.send(()).unwrap();
            }
        }
    });
    let mut done = false;
    dst.worker
        .progress_until(WAIT, || {
            done = done || rx.try_recv().is_ok();
            done
        })
        .unwrap();
    verify_destination(&dst_big, &dst_blocks);
    // Let the source close while this side still progresses.
    writeln!(stdin, "bye").unwrap();
    drop(stdin);
    let mut exited = None;
    dst.worker
        .progress_until(WAIT, || {
            exited = exited.or_else(|| child.try_wait().unwrap());
            exited.is_some()
        })
        .unwrap();
    assert!(exited.unwrap().success(), "source process failed");
    reader.join().unwrap();
    drop((dst_big, dst_blocks));
    assert_no_drop_errors(&dst.ctx);
}

#[test]
fn put_from_a_second_process_over_shm() {
    rma_across_processes(SHM);
}

#[test]
fn put_from_a_second_process_over_tcp() {
    rma_across_processes(TCP);
}

// ---------------------------------------------------------------------------
// Borrowed registrations and refusals.

#[test]
fn borrowed_registration_lends_caller_memory_for_the_scope() {
    let dst = side(SHM);
    let src = side(SHM);
    let mut landing = vec![0u8; 64 * KIB];
    let mut outgoing = pattern(9, 0, 64 * KIB);
    let addr = dst.worker.address().unwrap();
    let ep = src.worker.connect(&addr).unwrap();
    dst.ctx.scope(|d| {
        let landing_reg = d.register(&mut landing).unwrap();
        let key = ep.unpack_rkey(&landing_reg.pack_rkey().unwrap()).unwrap();
        src.ctx.scope(|s| {
            let out_reg = s.register(&mut outgoing).unwrap();
            let put = ep.put(&out_reg, 0, 64 * KIB, &key, 0).unwrap();
            let flush = ep.flush().unwrap();
            // Leaking the handle does not end UCX's use of the memory
            // unchecked: the scope still tears the registration down.
            std::mem::forget(out_reg);
            drive(&src.worker, &dst.worker, || {
                put.is_done() && flush.is_done()
            });
            flush.result().unwrap().unwrap();
        });
        drop(key);
    });
    // The scopes are over: the memory is the caller's again.
    assert!(landing == pattern(9, 0, 64 * KIB));
    outgoing[0] ^= 1; // writable again
    drop(ep);
    assert_no_drop_errors(&src.ctx);
    assert_no_drop_errors(&dst.ctx);
}

#[test]
fn puts_outside_either_registration_are_refused_before_ucx() {
    let dst = side(SHM);
    let src = side(SHM);
    let remote = dst.ctx.register_anon(MIB, AnonOptions::new()).unwrap();
    let local = src.ctx.register_anon(MIB, AnonOptions::new()).unwrap();
    let ep = src.worker.connect(&dst.worker.address().unwrap()).unwrap();
    let key = ep.unpack_rkey(&remote.pack_rkey().unwrap()).unwrap();
    assert_eq!(key.remote_len(), MIB as u64);

    let reason = |r: Result<_, kvcr_ucx::Error>| r.unwrap_err().reason().cloned();
    assert!(matches!(
        reason(ep.put(&local, MIB - 10, 11, &key, 0)),
        Some(UcxReason::LocalRange { .. })
    ));
    assert!(matches!(
        reason(ep.put(&local, usize::MAX, 2, &key, 0)),
        Some(UcxReason::LocalRange { .. })
    ));
    assert!(matches!(
        reason(ep.put(&local, 0, 16, &key, MIB as u64 - 8)),
        Some(UcxReason::RemoteRange { .. })
    ));
    assert!(matches!(
        reason(ep.put(&local, 0, 16, &key, u64::MAX - 1)),
        Some(UcxReason::RemoteRange { .. })
    ));
    // Memory registered on another context (here: the destination's).
    assert_eq!(
        reason(ep.put(&remote, 0, 16, &key, 0)),
        Some(UcxReason::ContextMismatch)
    );
    // An rkey unpacked on another endpoint.
    let ep2 = src.worker.connect(&dst.worker.address().unwrap()).unwrap();
    assert_eq!(
        reason(ep2.put(&local, 0, 16, &key, 0)),
        Some(UcxReason::RkeyEndpoint)
    );
    // Nothing was counted in flight by the refused puts; an edge put works.
    assert_eq!(local.in_flight(), 0);
    let ok = ep.put(&local, MIB - 16, 16, &key, MIB as u64 - 16).unwrap();
    let flush = ep.flush().unwrap();
    drive(&src.worker, &dst.worker, || ok.is_done() && flush.is_done());
    ok.result().unwrap().unwrap();
    // A zero-length put completes at once.
    assert!(ep.put(&local, 0, 0, &key, 0).unwrap().is_done());
    drop((key, ep, ep2, local));
    assert_no_drop_errors(&src.ctx);
}

#[test]
fn foreign_truncated_and_garbage_blobs_are_typed_errors() {
    let a = side(SHM);
    let b = side(SHM);
    let c = side(SHM);
    let reg_c = c.ctx.register_anon(64 * KIB, AnonOptions::new()).unwrap();
    let rkey_c = reg_c.pack_rkey().unwrap();
    // A → B endpoint, handed C's rkey: refused by context id, before UCX.
    let ep_ab = a.worker.connect(&b.worker.address().unwrap()).unwrap();
    let e = ep_ab.unpack_rkey(&rkey_c).unwrap_err();
    assert!(
        matches!(e.reason(), Some(UcxReason::ForeignRkey { .. })),
        "{e}"
    );

    // Truncated worker address / rkey, random garbage: typed errors.
    let addr = b.worker.address().unwrap();
    for cut in [
        0,
        1,
        8,
        addr.as_bytes().len() / 2,
        addr.as_bytes().len() - 1,
    ] {
        assert!(WorkerAddress::from_bytes(&addr.as_bytes()[..cut]).is_err());
    }
    for cut in [0, 3, rkey_c.as_bytes().len() - 1] {
        assert!(RkeyBuffer::from_bytes(&rkey_c.as_bytes()[..cut]).is_err());
    }
    assert!(RkeyBuffer::from_bytes(&[0xAB; 200]).is_err());
    assert!(WorkerAddress::from_bytes(&[0xAB; 200]).is_err());

    // A real rkey still works on the right endpoint afterwards.
    let ep_ac = a.worker.connect(&c.worker.address().unwrap()).unwrap();
    let key = ep_ac.unpack_rkey(&rkey_c).unwrap();
    // Wire both endpoints up (UCX connects lazily; a graceful close of a
    // half-connected endpoint needs the peer to progress, and here one thread
    // drives all three sides).
    let (f1, f2) = (ep_ab.flush().unwrap(), ep_ac.flush().unwrap());
    drive(&a.worker, &b.worker, || {
        c.worker.progress();
        f1.is_done() && f2.is_done()
    });
    drop((key, ep_ac, ep_ab));
    assert_no_drop_errors(&a.ctx);
}

#[test]
fn wait_sleeps_on_the_event_fd_and_returns_the_outcome() {
    let dst = side(TCP);
    let src = side(TCP);
    assert!(src.worker.event_fd().is_some());
    let remote = dst.ctx.register_anon(MIB, AnonOptions::new()).unwrap();
    let local = src.ctx.register_anon(MIB, AnonOptions::new()).unwrap();
    local.write(0, &pattern(5, 0, MIB)).unwrap();
    let ep = src.worker.connect(&dst.worker.address().unwrap()).unwrap();
    let key = ep.unpack_rkey(&remote.pack_rkey().unwrap()).unwrap();
    let put = ep.put(&local, 0, MIB, &key, 0).unwrap();
    let flush = ep.flush().unwrap();
    // Another worker's completion is refused.
    let e = dst.worker.wait(&put, WAIT).unwrap_err();
    assert_eq!(e.reason(), Some(&UcxReason::WorkerMismatch));
    // The destination runs on its own thread-equivalent: here, interleaved
    // waits with short timeouts, each sleeping on its worker's fd.
    let short = Duration::from_millis(5);
    for _ in 0..20_000 {
        if flush.is_done() {
            break;
        }
        let _ = src.worker.wait(&flush, short);
        let _ = dst.worker.progress_until(short, || false);
    }
    src.worker.wait(&put, WAIT).unwrap();
    src.worker.wait(&flush, WAIT).unwrap();
    let mut got = vec![0u8; MIB];
    remote.read(0, &mut got).unwrap();
    assert!(got == pattern(5, 0, MIB));
    drop((key, ep));
    assert_no_drop_errors(&src.ctx);
}

#[test]
fn a_dead_peer_fails_operations_instead_of_hanging() {
    let peer_mode = || {
        let ctx = Context::with_config(
            &ContextConfig::new()
                .loopback_tls(TCP)
                .error_mode(ErrorMode::Peer),
        )
        .unwrap();
        let worker = ctx.create_worker().unwrap();
        Side { ctx, worker }
    };
    let src = peer_mode();
    let (addr, rkey) = {
        let dst = peer_mode();
        let remote = dst.ctx.register_anon(MIB, AnonOptions::new()).unwrap();
        (dst.worker.address().unwrap(), remote.pack_rkey().unwrap())
        // `dst` (worker and context) is destroyed here: its sockets close.
    };
    let local = src.ctx.register_anon(MIB, AnonOptions::new()).unwrap();
    // Depending on timing, connect, unpack, put or flush fails with a peer
    // failure, or the endpoint is marked failed; none of it hangs or panics.
    let ep = match src.worker.connect(&addr) {
        Ok(ep) => ep,
        Err(e) => {
            assert_eq!(e.status(), Some(UcsStatus::Unreachable), "{e}");
            return;
        }
    };
    let outcome = ep.unpack_rkey(&rkey).and_then(|key| {
        let put = ep.put(&local, 0, MIB, &key, 0)?;
        let flush = ep.flush()?;
        src.worker.wait_all(&[put, flush], WAIT)
    });
    let err = outcome.unwrap_err();
    let status = err
        .status()
        .or_else(|| match err.reason() {
            Some(UcxReason::EndpointFailed(s)) => Some(*s),
            _ => None,
        })
        .unwrap_or(UcsStatus::Unknown(0));
    assert!(status.is_peer_failure(), "{err}");
    ep.set_close_mode(CloseMode::Force);
    drop(ep);
    drop(local);
    let (errors, _) = src.ctx.take_drop_errors();
    assert!(
        errors
            .iter()
            .all(|e| e.status().is_some_and(UcsStatus::is_peer_failure)),
        "{errors:?}"
    );
}
