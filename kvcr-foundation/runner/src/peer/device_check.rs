//! The destination's check of one-hop landings: bytes a same-host source
//! wrote straight into the engine's device memory are hashed there (the
//! device copier's digest kernel) and compared with the digests its
//! `write_done` carries before the core hears of them.
//!
//! The hashing runs on its own thread ([`DeviceChecker`]), not the peer
//! thread: a launch over a batch of 16 MiB pages takes ~8 ms on an H200,
//! and while the peer thread waited on it, nothing else it carries moved.
//! A restore's first-layer reports (`write_lead_landed`) queued behind
//! every check, and the next writes' completions behind the last. Now the
//! peer thread hands each turn's completions over and goes on; the thread
//! hashes whatever has queued in one launch and hands the results back,
//! in order, to be given to the core under its lock.
//!
//! A completion handed over may reach the core after messages that came
//! behind it. No other message of its operation can: its source sends a
//! one-hop operation's lead report before its one terminal `write_done`.
//! A message about its source (a death report, a lost session) that
//! overtakes it can only fail keys a check would have passed, never pass
//! one: the core takes a completion only from the operation's own source
//! and incarnation while the operation is awaited.

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use kvcr_contracts::protocol::{Body, CompletedIndices, Message, WriteOutcome};
use kvcr_runner_core::CopySpan;
use tokio::sync::mpsc::UnboundedSender;

use super::landing::Checked;
use crate::copy::device::DeviceCopier;
use crate::shared::Shared;

/// How long the check thread waits for another completion of the same
/// burst before it launches. A launch takes ~8 ms whatever it holds; on an
/// H100 a pass's 54 completions, taken as they came, went as a launch of
/// one and then one of 53 (17 ms before the last was checked, not 9).
const BURST_GAP: std::time::Duration = std::time::Duration::from_micros(200);

/// The longest a launch waits for its burst: a quarter of the launch.
const BURST_MAX: std::time::Duration = std::time::Duration::from_millis(2);

/// One-hop completions checked together, in the order they were handed
/// over, and how many digest launches they took.
pub(crate) struct CheckedLandings {
    pub(crate) checked: Vec<Checked>,
    pub(crate) launches: u64,
}

/// The thread that hashes one-hop landings. Started with the first
/// completion; joined on drop, after the launch it is running (its kernels
/// read the engine's device memory, which the engine keeps until the
/// runner is gone).
pub(crate) struct DeviceChecker {
    worker: Option<(mpsc::Sender<Vec<DeviceLanding>>, JoinHandle<()>)>,
    /// Where results go: the peer thread's receiver.
    results: UnboundedSender<CheckedLandings>,
}

impl DeviceChecker {
    /// A checker that sends its results to `results`.
    pub(crate) fn new(results: UnboundedSender<CheckedLandings>) -> Self {
        Self {
            worker: None,
            results,
        }
    }

    /// Hands `landings` to the thread. Where the thread cannot be started
    /// (or is gone), they are checked here, at once: a completion is never
    /// dropped unchecked.
    pub(crate) fn submit(&mut self, landings: Vec<DeviceLanding>) {
        if landings.is_empty() {
            return;
        }
        if self.worker.is_none() {
            let (tx, rx) = mpsc::channel::<Vec<DeviceLanding>>();
            let results = self.results.clone();
            let spawned = std::thread::Builder::new()
                .name("kvcr-device-check".into())
                .spawn(move || {
                    while let Ok(mut landings) = rx.recv() {
                        // Whatever queued during the last launch goes in
                        // this one: a batch costs about what one page does.
                        // So do the completions still coming in the same
                        // burst (a source's pass ends its writes together,
                        // and they cross the socket over ~0.2 ms): taken
                        // until none has come for a moment, at most
                        // `BURST_MAX` (a steady trickle never holds a
                        // launch back longer).
                        #[allow(clippy::disallowed_methods)] // a bound on a wait, not a core's time
                        let until = std::time::Instant::now() + BURST_MAX;
                        loop {
                            #[allow(clippy::disallowed_methods)]
                            let left = until.saturating_duration_since(std::time::Instant::now());
                            let Ok(more) = rx.recv_timeout(BURST_GAP.min(left)) else {
                                break;
                            };
                            landings.extend(more);
                            if left.is_zero() {
                                break;
                            }
                        }
                        crate::timeline::mark("check_launch", landings.len() as u64);
                        let checked = check_device_landings(landings);
                        crate::timeline::mark("check_done", checked.checked.len() as u64);
                        if results.send(checked).is_err() {
                            break;
                        }
                    }
                });
            if let Ok(thread) = spawned {
                self.worker = Some((tx, thread));
            }
        }
        let landings = match &self.worker {
            Some((tx, _)) => match tx.send(landings) {
                Ok(()) => return,
                Err(mpsc::SendError(landings)) => landings,
            },
            None => landings,
        };
        let _ = self.results.send(check_device_landings(landings));
    }
}

impl Drop for DeviceChecker {
    /// Closes the queue and waits for the launch under way: nothing reads
    /// device memory after the runner is gone.
    fn drop(&mut self) {
        if let Some((tx, thread)) = self.worker.take() {
            drop(tx);
            if thread.join().is_err() {
                eprintln!("kvcr: device check thread panicked");
            }
        }
    }
}

/// A completion's keys as the copier that hashes them sees them: per
/// completed key, its device spans.
type DeviceKeys<'a> = (&'a Arc<dyn DeviceCopier>, Vec<Vec<CopySpan>>);

/// A one-hop completion (bytes a same-host source wrote straight into our
/// device regions) taken from the control channel, its keys' device spans
/// looked up, waiting to be hashed with others ([`check_device_landings`]).
pub(crate) struct DeviceLanding {
    message: Message,
    /// Per key of the operation (request order), its device spans.
    landing: Vec<Vec<(u64, u64)>>,
    copier: Option<Arc<dyn DeviceCopier>>,
}

/// `Ok` if `message` completes a one-hop operation (one still awaited),
/// with where its keys landed; otherwise the message back.
pub(crate) fn device_landing(
    shared: &Shared,
    message: Message,
) -> Result<DeviceLanding, Box<Message>> {
    let Body::WriteDone {
        op_handle,
        outcome: WriteOutcome::Completed(_),
    } = &message.body
    else {
        return Err(Box::new(message));
    };
    let (landing, copier) = {
        let inner = shared.lock();
        match inner.core.target_device_landing(*op_handle) {
            Some(landing) => (landing, inner.device.clone()),
            None => return Err(Box::new(message)),
        }
    };
    Ok(DeviceLanding {
        message,
        landing,
        copier,
    })
}

impl DeviceLanding {
    /// The completed keys' device spans, as the copier hashes them; `None`:
    /// nothing can be hashed (no digests sent, or no device copier).
    fn keys(&self) -> Option<DeviceKeys<'_>> {
        let (
            Body::WriteDone {
                outcome: WriteOutcome::Completed(completed),
                ..
            },
            Some(copier),
        ) = (&self.message.body, &self.copier)
        else {
            return None;
        };
        completed.digests()?;
        let spans = completed
            .as_slice()
            .iter()
            .map(|index| {
                self.landing
                    .get(*index as usize)
                    .into_iter()
                    .flatten()
                    .map(|(addr, len)| CopySpan {
                        src: *addr,
                        dst: 0,
                        len: *len,
                    })
                    .collect()
            })
            .collect();
        Some((copier, spans))
    }

    /// Compares the digests found on the device (`found`, per completed
    /// key; `None`: none could be taken) with those sent. A reply whose
    /// keys were not hashed is handed on unchecked, and the core fails
    /// them (nothing is read back through DRAM).
    fn checked(self, found: Option<&[u64]>) -> Checked {
        let (op_handle, completed) = match &self.message.body {
            Body::WriteDone {
                op_handle,
                outcome: WriteOutcome::Completed(completed),
            } => (*op_handle, completed),
            _ => return Checked::unchecked(self.message),
        };
        let (Some(sent), Some(found)) = (completed.digests(), found) else {
            return Checked::unchecked(self.message);
        };
        let mut passed = Vec::new();
        let mut mismatched = Vec::new();
        for ((index, sent), found) in completed.as_slice().iter().zip(sent).zip(found) {
            if found == sent {
                passed.push((*index, *sent));
            } else {
                mismatched.push(*index);
            }
        }
        // A copier that answered for fewer keys leaves the rest unmatched.
        mismatched.extend(completed.as_slice().iter().skip(found.len()));
        Checked::one_hop(
            Message {
                header: self.message.header,
                body: Body::WriteDone {
                    op_handle,
                    outcome: WriteOutcome::Completed(CompletedIndices::with_digests(passed)),
                },
            },
            mismatched,
        )
    }
}

/// Hashes the device spans of every completion in `landings` with one
/// launch and compares them, in order; with how many launches it took. The
/// digest kernel walks each page on one warp, so a batch of pages takes
/// about as long as one: checked one write at a time, the seed bench's
/// 4-page writes of 16 MiB pages took ~8.7 ms each on an H200, 3.9 s for
/// 30.4 GB the copy engines moved in 0.56 s. A completion the batch cannot
/// take (another copier) or a batch the copier refuses (a span the kernel
/// cannot walk, a driver error) is hashed completion by completion, so one
/// bad reply never fails another's keys.
pub(crate) fn check_device_landings(landings: Vec<DeviceLanding>) -> CheckedLandings {
    let keyed: Vec<Option<DeviceKeys<'_>>> = landings.iter().map(DeviceLanding::keys).collect();
    // Per completion, its keys' digests once hashed (a batch that ran
    // fills every member's).
    let mut found: Vec<Option<Vec<u64>>> = vec![None; keyed.len()];
    let mut launches = 0;
    if let Some(copier) = keyed.iter().flatten().map(|(c, _)| *c).next() {
        let batch: Vec<usize> = keyed
            .iter()
            .enumerate()
            .filter(|(_, k)| k.as_ref().is_some_and(|(c, _)| Arc::ptr_eq(c, copier)))
            .map(|(i, _)| i)
            .collect();
        let spans = |i: usize| keyed.get(i).and_then(Option::as_ref).map(|(_, s)| s);
        let keys: Vec<&[CopySpan]> = batch
            .iter()
            .filter_map(|&i| spans(i))
            .flat_map(|s| s.iter().map(Vec::as_slice))
            .collect();
        launches += 1;
        if let Ok(Some(all)) = copier.digest_device(&keys)
            && all.len() == keys.len()
        {
            let mut at = 0;
            for &i in &batch {
                let count = spans(i).map_or(0, Vec::len);
                if let (Some(slot), Some(mine)) = (found.get_mut(i), all.get(at..at + count)) {
                    *slot = Some(mine.to_vec());
                }
                at += count;
            }
        }
    }
    for (keys, found) in keyed.iter().zip(&mut found) {
        if found.is_none() && keys.is_some() {
            launches += 1;
            *found = hash_alone(keys);
        }
    }
    drop(keyed);
    let checked = landings
        .into_iter()
        .zip(found)
        .map(|(landing, found)| landing.checked(found.as_deref()))
        .collect();
    CheckedLandings { checked, launches }
}

/// One completion's keys hashed by its copier alone.
fn hash_alone(keyed: &Option<DeviceKeys<'_>>) -> Option<Vec<u64>> {
    let (copier, spans) = keyed.as_ref()?;
    let keys: Vec<&[CopySpan]> = spans.iter().map(Vec::as_slice).collect();
    copier.digest_device(&keys).ok().flatten()
}

/// A one-hop completion checked alone (see [`check_device_landings`]).
pub(crate) fn check_device(shared: &Shared, message: Message) -> Result<Checked, Box<Message>> {
    let landing = device_landing(shared, message)?;
    let found = hash_alone(&landing.keys());
    Ok(landing.checked(found.as_deref()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::peer::landing::tests::write_done;

    /// A device copier whose "device" is `memory`, at address `BASE`: it
    /// counts its digest launches and refuses any launch that names
    /// `poisoned`. A launch says so on `entered`, then waits for `gate`.
    struct HashingCopier {
        memory: Vec<u8>,
        launches: std::sync::atomic::AtomicUsize,
        poisoned: u64,
        gate: std::sync::Mutex<()>,
        entered: Option<std::sync::mpsc::Sender<()>>,
    }

    const BASE: u64 = 0x7000_0000;

    impl DeviceCopier for HashingCopier {
        fn attach(&self, _: &[crate::PoolRange]) -> crate::Result<()> {
            Ok(())
        }

        fn copy(&self, _: &[&[CopySpan]]) -> crate::Result<()> {
            Ok(())
        }

        fn detach(&self, _: &[crate::PoolRange]) {}

        fn digest_device(&self, keys: &[&[CopySpan]]) -> crate::Result<Option<Vec<u64>>> {
            self.launches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Some(entered) = &self.entered {
                let _ = entered.send(());
            }
            let _gate = self.gate.lock();
            if keys
                .iter()
                .flat_map(|k| k.iter())
                .any(|s| s.src == self.poisoned)
            {
                return Err(crate::Error::runner(
                    crate::error::RunnerReason::DeviceCopy(kvcr_contracts::error::Echo::new(
                        "launch refused",
                    )),
                ));
            }
            Ok(Some(
                keys.iter()
                    .map(|k| {
                        let bytes: Vec<u8> = k
                            .iter()
                            .flat_map(|s| {
                                let at = (s.src - BASE) as usize;
                                self.memory[at..at + s.len as usize].iter().copied()
                            })
                            .collect();
                        kvcr_sys::digest::digest_bytes(&bytes)
                    })
                    .collect(),
            ))
        }
    }

    /// One-hop completions that came together are hashed with one launch
    /// and each compared with its own digests (a wrong page fails only its
    /// key); a batch the copier refuses is hashed completion by completion,
    /// so only the completion it cannot hash goes on unchecked (`None`: the
    /// core then fails its keys).
    #[rstest::rstest]
    #[case::together(None, 1, vec![Some(vec![]), Some(vec![1]), Some(vec![])])]
    #[case::one_refused(Some(2), 4, vec![Some(vec![]), Some(vec![1]), None])]
    fn completions_that_came_together_are_hashed_together(
        #[case] poisoned_write: Option<usize>,
        #[case] launches: usize,
        #[case] failed: Vec<Option<Vec<u32>>>,
    ) {
        let pages: Vec<u8> = (0..6 * 4096u32).map(|i| (i * 13 % 251) as u8).collect();
        let base = BASE;
        let page = |n: usize| &pages[n * 4096..(n + 1) * 4096];
        let copier = Arc::new(HashingCopier {
            memory: pages.clone(),
            launches: std::sync::atomic::AtomicUsize::new(0),
            poisoned: poisoned_write.map_or(0, |w| base + 2 * w as u64 * 4096),
            gate: std::sync::Mutex::new(()),
            entered: None,
        });
        let shared: Arc<dyn DeviceCopier> = copier.clone();
        let landings: Vec<DeviceLanding> = (0..3)
            .map(|w| {
                let mut digests = [
                    kvcr_sys::digest::digest_bytes(page(2 * w)),
                    kvcr_sys::digest::digest_bytes(page(2 * w + 1)),
                ];
                // The second write's second page is not what landed.
                if w == 1 {
                    digests[1] ^= 1;
                }
                let at = base + 2 * w as u64 * 4096;
                DeviceLanding {
                    message: write_done(digests, false),
                    landing: vec![vec![(at, 4096)], vec![(at + 4096, 4096)]],
                    copier: Some(Arc::clone(&shared)),
                }
            })
            .collect();
        let CheckedLandings {
            checked,
            launches: counted,
        } = check_device_landings(landings);
        assert_eq!(counted as usize, launches, "launches counted");
        assert_eq!(
            copier.launches.load(std::sync::atomic::Ordering::Relaxed),
            launches
        );
        let mismatched: Vec<Option<Vec<u32>>> = checked
            .into_iter()
            .map(|c| c.one_hop_mismatched().map(<[u32]>::to_vec))
            .collect();
        assert_eq!(mismatched, failed);
    }

    /// `count` one-key completions of `copier`'s pages `first..`, each with
    /// its page's digest (`wrong`: every digest off by one).
    fn landings(
        copier: &Arc<HashingCopier>,
        first: usize,
        count: usize,
        wrong: bool,
    ) -> Vec<DeviceLanding> {
        let shared: Arc<dyn DeviceCopier> = copier.clone();
        (first..first + count)
            .map(|page| {
                let at = page * 4096;
                let digest = kvcr_sys::digest::digest_bytes(&copier.memory[at..at + 4096])
                    ^ u64::from(wrong);
                let landing = vec![(BASE + at as u64, 4096)];
                DeviceLanding {
                    message: write_done([digest, digest], false),
                    landing: vec![landing.clone(), landing],
                    copier: Some(Arc::clone(&shared)),
                }
            })
            .collect()
    }

    /// Completions handed to the checker come back checked, from its own
    /// thread, in the order they were handed over; those handed over while
    /// a launch runs share the next one; dropping the checker joins the
    /// thread after the launch under way.
    #[test]
    fn the_checker_hands_back_every_completion_in_order() {
        let (entered, launched) = std::sync::mpsc::channel();
        let copier = Arc::new(HashingCopier {
            memory: (0..4 * 4096u32).map(|i| (i * 31 % 251) as u8).collect(),
            launches: std::sync::atomic::AtomicUsize::new(0),
            poisoned: 0,
            gate: std::sync::Mutex::new(()),
            entered: Some(entered),
        });
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut checker = DeviceChecker::new(tx);
        let gate = copier.gate.lock().unwrap();
        checker.submit(landings(&copier, 0, 1, false));
        // The first launch has begun (and waits at the gate).
        launched
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the thread never launched");
        checker.submit(landings(&copier, 1, 2, true));
        checker.submit(landings(&copier, 3, 1, false));
        drop(gate);
        let first = rx.blocking_recv().unwrap();
        let second = rx.blocking_recv().unwrap();
        let mismatched = |batch: CheckedLandings| -> Vec<Option<Vec<u32>>> {
            batch
                .checked
                .iter()
                .map(|c| c.one_hop_mismatched().map(<[u32]>::to_vec))
                .collect()
        };
        assert_eq!((first.launches, second.launches), (1, 1));
        assert_eq!(mismatched(first), [Some(vec![])]);
        assert_eq!(
            mismatched(second),
            [Some(vec![0, 1]), Some(vec![0, 1]), Some(vec![])],
            "the two wrong completions fail, the next passes, in order"
        );
        drop(checker);
        assert!(rx.blocking_recv().is_none(), "the thread is gone");
        assert_eq!(copier.launches.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
