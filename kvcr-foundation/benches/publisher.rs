//! Publisher throughput: block events (stored + removed blocks) encoded and
//! sent per second.
//!
//! `cargo bench -p kvcr-foundation --bench publisher` prints
//! `BENCH publisher.events value=<median> unit=Mevents/s`: the whole path, the
//! runner's sink → bounded queue → one driver thread (batching, ledger,
//! msgpack encoding, replay buffer) → ZMQ PUB with a live subscriber on
//! loopback draining it. `publisher.events_core` is the sans-I/O core alone
//! (batching + encoding on one thread). `KVCR_BENCH_QUICK=1` runs fewer,
//! shorter rounds.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;
use common::median;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kvcr_foundation::publisher::{
    BatchLimits, PubSocket, Publisher, PublisherConfig, PublisherCore, TopicParts,
};
use kvcr_foundation::{
    BindAddress, BlockKey, Incarnation, InventoryEvent, InventoryScope, Medium, NamespaceId, Owner,
};

const BLOCK_SIZE: u32 = 16;
const CHAIN: u64 = 8;

#[allow(clippy::disallowed_methods)]
fn now() -> std::time::Instant {
    std::time::Instant::now()
}

/// The runner's stream: chains of `CHAIN` blocks, one Stored event per block
/// (as commits arrive), then one Removed per block. `n_blocks` stored blocks
/// give `2 * n_blocks` block events.
fn workload(n_blocks: u64) -> Vec<InventoryEvent> {
    let scope = InventoryScope {
        owner: Owner::Kvcr,
        namespace: NamespaceId(1),
        medium: Medium::CpuPinned,
    };
    let mut events = Vec::with_capacity(2 * n_blocks as usize);
    for k in 1..=n_blocks {
        events.push(InventoryEvent::Stored {
            scope,
            keys: vec![BlockKey::from_u64(k)],
            parent: (k % CHAIN != 1).then(|| BlockKey::from_u64(k - 1)),
            token_ids: (0..BLOCK_SIZE)
                .map(|t| (k as u32).wrapping_mul(31) ^ t)
                .collect(),
            block_size: BLOCK_SIZE,
            lora_name: None,
            lora_id: None,
            cache_salt: None,
        });
        if k > 1024 {
            events.push(InventoryEvent::Removed {
                scope,
                keys: vec![BlockKey::from_u64(k - 1024)],
            });
        }
    }
    for k in n_blocks.saturating_sub(1023).max(1)..=n_blocks {
        events.push(InventoryEvent::Removed {
            scope,
            keys: vec![BlockKey::from_u64(k)],
        });
    }
    events
}

fn parts() -> TopicParts {
    TopicParts {
        worker_id: 1,
        dp_rank: 0,
    }
}

fn inc() -> Incarnation {
    Incarnation::from_raw(0x5eed).unwrap()
}

/// Core only: handle + encode, one thread. Returns M block events/s.
fn core_round(events: &[InventoryEvent], block_events: u64) -> f64 {
    let mut core = PublisherCore::new(parts(), inc(), BatchLimits::default(), 1 << 22);
    let mut bytes = 0usize;
    let t0 = now();
    for chunk in events.chunks(4096) {
        for e in chunk {
            core.handle(e);
        }
        while let Some(t) = core.poll_transmit(1.0) {
            bytes += t.payload.len();
        }
    }
    let dt = t0.elapsed().as_secs_f64();
    assert!(bytes > 0);
    let s = core.stats();
    assert_eq!(s.stored_blocks + s.removed_blocks, block_events);
    block_events as f64 / dt / 1e6
}

/// Sink → queue → driver → PUB → a live SUB. Returns M block events/s.
fn e2e_round(events: &[InventoryEvent], block_events: u64) -> f64 {
    let addr = BindAddress::parse("tcp://127.0.0.1:0").unwrap();
    let mut cfg =
        PublisherConfig::new(parts(), inc(), PubSocket::Bind(addr.clone())).with_replay(addr);
    cfg.queue_capacity = 1 << 16;
    let publisher = Publisher::start(cfg).unwrap();
    let ep = publisher.bound().pub_bound.clone().unwrap().to_string();

    // A subscriber draining on its own thread; wait until it is joined.
    let received = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(b"").unwrap();
    sub.set_rcvtimeo(10).unwrap();
    sub.connect(&ep).unwrap();
    let reader = {
        let (received, stop) = (Arc::clone(&received), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if sub.recv_multipart(0).is_ok() {
                    received.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    let sink = publisher.sink();
    let scope = InventoryScope {
        owner: Owner::Kvcr,
        namespace: NamespaceId(2),
        medium: Medium::CpuPinned,
    };
    let mut probe = 0u64;
    while received.load(Ordering::Relaxed) == 0 {
        probe += 1;
        sink.try_publish(InventoryEvent::Stored {
            scope,
            keys: vec![BlockKey::from_u64(probe)],
            parent: None,
            token_ids: vec![0; BLOCK_SIZE as usize],
            block_size: BLOCK_SIZE,
            lora_name: None,
            lora_id: None,
            cache_salt: None,
        });
        std::thread::yield_now();
    }
    while publisher.stats().core.events_in < probe {
        std::thread::yield_now();
    }
    let base = publisher.stats().core;
    let target = base.events_in + events.len() as u64;

    let t0 = now();
    let capacity = 1u64 << 16;
    for (i, chunk) in events.chunks(1024).enumerate() {
        // The runner drops on a full queue (and the publisher then resyncs
        // consumers); the benchmark measures the driver, so it keeps the
        // queue from filling instead.
        let published = base.events_in + (i * 1024) as u64;
        while published.saturating_sub(publisher.stats().core.events_in) > capacity - 2048 {
            std::thread::yield_now();
        }
        for e in chunk {
            assert!(sink.try_publish(e.clone()));
        }
    }
    while publisher.stats().core.events_in < target {
        std::thread::yield_now();
    }
    let dt = t0.elapsed().as_secs_f64();
    let stats = publisher.close().unwrap();
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    let sent = stats.core.stored_blocks + stats.core.removed_blocks - base.stored_blocks;
    assert!(sent >= block_events, "{sent} < {block_events}");
    assert_eq!(stats.pub_send_errors + stats.queue_dropped, 0);
    block_events as f64 / dt / 1e6
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: build
    // check only, no timing in tests.
    if !std::env::args().any(|a| a == "--bench") {
        println!("publisher bench: run with `cargo bench` or `cargo xtask bench`");
        return;
    }
    let quick = std::env::var("KVCR_BENCH_QUICK").is_ok_and(|v| v == "1")
        || std::env::args().any(|a| a == "--quick");
    let (rounds, n_blocks) = if quick { (3, 200_000) } else { (5, 1_000_000) };
    let events = workload(n_blocks);
    let block_events = 2 * n_blocks;
    let core: Vec<f64> = (0..rounds)
        .map(|_| core_round(&events, block_events))
        .collect();
    let e2e: Vec<f64> = (0..rounds)
        .map(|_| e2e_round(&events, block_events))
        .collect();
    eprintln!("core rounds {core:.2?} Mevents/s; end-to-end rounds {e2e:.2?} Mevents/s");
    println!(
        "BENCH publisher.events_core value={:.3} unit=Mevents/s",
        median(core)
    );
    println!(
        "BENCH publisher.events value={:.3} unit=Mevents/s",
        median(e2e)
    );
}
