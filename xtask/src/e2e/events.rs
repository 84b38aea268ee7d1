//! A KV-event consumer for the scenarios: it subscribes to a node's PUB
//! socket as a router does, keeps every batch by sequence number, repairs
//! gaps from the node's replay ROUTER (vLLM 0.33 framing), and tallies
//! stored and removed blocks in sequence order.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvcr_publisher::decode::{EventKind, decode_batch};

/// The replay end marker's sequence frame (`-1`, 8 bytes big-endian).
const END_SEQ: [u8; 8] = [0xff; 8];
/// How long the tap waits for the stream to catch up with the publisher's
/// count before it fails (the publisher never blocks; this only bounds a hang).
const SETTLE_BOUND: Duration = Duration::from_secs(120);

type Batches = Arc<Mutex<BTreeMap<u64, Vec<u8>>>>;

/// What a consumer saw, in sequence order.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tally {
    /// Batches seen (live or replayed).
    pub(crate) batches: u64,
    /// Batches that came only from replay (the live stream missed them).
    pub(crate) repaired: u64,
    /// Block hashes in `BlockStored` events.
    pub(crate) stored: u64,
    /// Block hashes in `BlockRemoved` events.
    pub(crate) removed: u64,
    /// `AllBlocksCleared` barriers.
    pub(crate) clears: u64,
    /// Blocks stored minus removed since the last barrier: what a router
    /// following this stream believes the node holds.
    pub(crate) live: i64,
}

/// A live subscriber with replay repair.
pub(crate) struct EventTap {
    context: zmq::Context,
    replay: Option<String>,
    live: Batches,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn seq_of(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

impl EventTap {
    /// Subscribes to `events` (everything, every topic); `replay` is the
    /// node's replay ROUTER, used to fill gaps.
    pub(crate) fn connect(events: &str, replay: Option<&str>) -> Result<Self> {
        let context = zmq::Context::new();
        let subscriber = context.socket(zmq::SUB)?;
        subscriber.set_subscribe(b"")?;
        subscriber.set_rcvtimeo(100)?;
        subscriber.connect(events)?;
        let live: Batches = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let live = Arc::clone(&live);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let Ok(frames) = subscriber.recv_multipart(0) else {
                        continue; // quiet for the receive timeout
                    };
                    if let [_topic, seq, payload] = frames.as_slice()
                        && let Some(seq) = seq_of(seq)
                    {
                        live.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(seq, payload.clone());
                    }
                }
            })
        };
        Ok(Self {
            context,
            replay: replay.map(str::to_owned),
            live,
            stop,
            thread: Some(thread),
        })
    }

    /// Batches `from..` as the replay ROUTER serves them.
    fn replay_from(&self, from: u64) -> Result<BTreeMap<u64, Vec<u8>>> {
        let endpoint = self
            .replay
            .as_deref()
            .context("the stream has a gap and the node serves no replay")?;
        let dealer = self.context.socket(zmq::DEALER)?;
        dealer.set_rcvtimeo(10_000)?;
        dealer.set_linger(0)?;
        dealer.connect(endpoint)?;
        dealer.send_multipart([&b""[..], &from.to_be_bytes()[..]], 0)?;
        let mut out = BTreeMap::new();
        loop {
            let frames = dealer
                .recv_multipart(0)
                .context("the replay ROUTER went quiet before its end marker")?;
            match frames.as_slice() {
                [_empty, _topic, seq, _payload] if seq.as_slice() == END_SEQ => break,
                [_empty, _topic, seq, payload] => {
                    if let Some(seq) = seq_of(seq) {
                        out.insert(seq, payload.clone());
                    }
                }
                other => bail!("unexpected replay reply of {} frames", other.len()),
            }
        }
        Ok(out)
    }

    /// Waits until every batch `0..batches` is here, repairing gaps from
    /// replay once the live stream has had a moment, and tallies them.
    pub(crate) fn settle(&self, batches: u64) -> Result<Tally> {
        let start = Instant::now();
        let mut replayed: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        loop {
            let missing = {
                let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
                (0..batches).find(|s| !live.contains_key(s) && !replayed.contains_key(s))
            };
            let Some(first_missing) = missing else { break };
            if start.elapsed() > SETTLE_BOUND {
                bail!(
                    "the KV-event stream stopped at batch {first_missing} of {batches} (live and replay)"
                );
            }
            if start.elapsed() > Duration::from_secs(1) {
                replayed.extend(self.replay_from(first_missing)?);
            }
            // The live stream runs on its own thread: give it a moment.
            std::thread::sleep(Duration::from_millis(50));
        }
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let mut tally = Tally::default();
        for seq in 0..batches {
            let (payload, repaired) = match live.get(&seq) {
                Some(p) => (p, false),
                None => (replayed.get(&seq).context("settled batch")?, true),
            };
            tally.batches += 1;
            tally.repaired += u64::from(repaired);
            count(payload, &mut tally)?;
        }
        Ok(tally)
    }
}

impl Drop for EventTap {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Adds one `KVEventBatch` (`[ts, [events..], dp_rank]`) to the tally.
fn count(payload: &[u8], tally: &mut Tally) -> Result<()> {
    for event in decode_batch(payload)? {
        let hashes = event.block_hashes.len() as u64;
        match event.kind {
            EventKind::Stored => {
                tally.stored += hashes;
                tally.live += hashes as i64;
            }
            EventKind::Removed => {
                tally.removed += hashes;
                tally.live -= hashes as i64;
            }
            EventKind::AllCleared => {
                tally.clears += 1;
                tally.live = 0;
            }
            EventKind::Unknown(what) => bail!("unknown event: {what}"),
        }
    }
    Ok(())
}

/// `cargo xtask e2e --subscriber-child <events>`: a subscriber process for
/// the `subscriber-gone` scenario, which SIGKILLs it. It prints `BATCH <seq>`
/// for the first batch it receives and then stops reading (with a receive
/// high-water mark of 1, so unread batches pile up in its socket): it dies
/// with data in flight, as a crashed router does.
pub(crate) fn subscriber_child(events: &str) -> Result<()> {
    let context = zmq::Context::new();
    let subscriber = context.socket(zmq::SUB)?;
    subscriber.set_subscribe(b"")?;
    subscriber.set_rcvhwm(1)?;
    subscriber.connect(events)?;
    let frames = subscriber.recv_multipart(0)?;
    let seq = frames.get(1).and_then(|s| seq_of(s)).unwrap_or(u64::MAX);
    println!("BATCH {seq}");
    loop {
        // Waiting to be killed, reading nothing.
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use rmpv::Value;

    use super::*;

    fn event(kind: &str, hashes: &[u64]) -> Value {
        let mut fields = vec![(Value::from("type"), Value::from(kind))];
        if !hashes.is_empty() {
            fields.push((
                Value::from("block_hashes"),
                Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
            ));
        }
        Value::Map(fields)
    }

    fn batch(events: Vec<Value>) -> Vec<u8> {
        let value = Value::Array(vec![Value::from(1.5), Value::Array(events), Value::Nil]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &value).unwrap();
        out
    }

    #[test]
    fn a_barrier_resets_the_live_view_but_not_the_totals() {
        let mut tally = Tally::default();
        count(
            &batch(vec![
                event("BlockStored", &[1, 2]),
                event("BlockRemoved", &[1]),
                event("AllBlocksCleared", &[]),
                event("BlockStored", &[3, 4, 5]),
                event("BlockRemoved", &[4]),
            ]),
            &mut tally,
        )
        .unwrap();
        assert_eq!(
            (tally.stored, tally.removed, tally.clears, tally.live),
            (5, 2, 1, 2)
        );
    }

    #[test]
    fn an_unknown_event_or_a_non_batch_is_an_error() {
        let mut tally = Tally::default();
        assert!(count(&batch(vec![event("BlockMoved", &[1])]), &mut tally).is_err());
        assert!(count(&[0xc1], &mut tally).is_err());
    }
}
