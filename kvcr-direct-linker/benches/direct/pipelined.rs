//! A pipelined destination's restore (`--tp2-dest` in `pipe` modes): one
//! `restore_hinted` of a rank's pages, polled as an engine would, timed to
//! its first layer and its end.

use std::time::{Duration, Instant};

use kvcr_direct_linker::DirectLinker;
use kvcr_foundation::runner::timeline;
use kvcr_foundation::{AttemptLedger, BlockKey, RequestId};
use kvcr_linker_contracts::{DeviceSlot, Linker, LinkerEvent, PrefixQuery, RequestContext};

use super::peer::progress;
use super::{NAMESPACE, SETTLE};

/// One pipelined `restore_hinted` of a rank's pages, timed as the engine
/// sees it; see [`tp2_dest`].
pub(crate) struct PipelinedRestore {
    /// Seconds to `RestoreDone`.
    pub(crate) total: f64,
    /// Seconds to `FirstLayerLanded` (0: none came, as on the two-hop route).
    pub(crate) first_layer: f64,
    /// Milliseconds until the checked one-hop pages passed one, half and all.
    marks: [Option<f64>; 3],
    /// Minor page faults this process took meanwhile.
    faults: u64,
}

impl PipelinedRestore {
    pub(crate) fn say(&self, rank: u32, mode: &str) {
        let ms = |m: Option<f64>| m.map_or("-".to_owned(), |m| format!("{m:.0}"));
        println!(
            "# rank {rank} {mode}: pages checked in one hop: the first by {} ms, half by {} ms, all by {} ms; first layer {:.2} ms; done {:.0} ms; {} minor page faults",
            ms(self.marks[0]),
            ms(self.marks[1]),
            ms(self.marks[2]),
            self.first_layer * 1e3,
            self.total * 1e3,
            self.faults
        );
    }
}

pub(crate) fn pipelined_restore(
    linker: &mut DirectLinker,
    ledger: &mut AttemptLedger,
    rank: u32,
    pages: u32,
    hint: &kvcr_foundation::FetchHint,
    keys: &[BlockKey],
    mode: &str,
) -> PipelinedRestore {
    let began = Instant::now();
    let query = PrefixQuery {
        namespace: NAMESPACE,
        device_prefix_pages: 0,
        tail: keys.to_vec(),
    };
    let landed_before = linker.runner().peers().stats().counters.one_hop_pages;
    let faults_before = super::one_hop::minor_faults();
    let t = Instant::now();
    let (context, _) = RequestContext::begin(
        ledger,
        RequestId(format!("tp{rank}-{mode}")),
        vec![hint.clone()],
        query,
    );
    let slots: Vec<DeviceSlot> = (0..pages).map(DeviceSlot).collect();
    timeline::mark("restore_hinted", u64::from(pages));
    let ticket = linker.restore_hinted(&context, &slots).unwrap();
    // Polled, not settled: the first layer's event is timed as the
    // engine would see it (0: none came, as on the two-hop route).
    let mut first_layer = 0.0;
    let mut events = Vec::new();
    let mut next_report = Duration::from_secs(10);
    // When the checked one-hop pages first passed none, half and all
    // (sampled every 5 ms: the counters take the runner's lock).
    let mut marks = [None; 3];
    let mut next_sample = Duration::ZERO;
    let landed = loop {
        if t.elapsed() >= next_sample {
            next_sample = t.elapsed() + Duration::from_millis(5);
            let checked = linker.runner().peers().stats().counters.one_hop_pages - landed_before;
            for (mark, at) in
                marks
                    .iter_mut()
                    .zip([1, u64::from(pages).div_ceil(2), u64::from(pages)])
            {
                if mark.is_none() && checked >= at {
                    *mark = Some(t.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        let fresh = linker.poll();
        for e in &fresh {
            if matches!(e, LinkerEvent::FirstLayerLanded { ticket: t, .. } if *t == ticket)
                && first_layer == 0.0
            {
                first_layer = t.elapsed().as_secs_f64();
                timeline::mark("first_layer_event", 0);
            }
        }
        events.extend(fresh);
        if let Some(restored) = events.iter().find_map(|e| match e {
            LinkerEvent::RestoreDone {
                ticket: t,
                restored,
                ..
            } if *t == ticket => Some(*restored),
            _ => None,
        }) {
            break restored;
        }
        if t.elapsed() >= next_report {
            next_report += Duration::from_secs(10);
            let counters = linker.runner().peers().stats().counters;
            progress(
                &format!(
                    "dest {rank} {mode}: restoring; {} events, {} one-hop writes, {} pages, metadata resent {} times",
                    events.len(),
                    counters.one_hop_writes,
                    counters.one_hop_pages,
                    counters.metadata_resent
                ),
                began,
            );
        }
        assert!(
            t.elapsed() < SETTLE,
            "rank {rank}: pipelined restore unfinished: {events:?}"
        );
        // A tenth of a millisecond: a finer first-layer reading than
        // `settle`'s 10 ms rounds, without a hot loop contending for the
        // runner's lock with the threads doing the restore.
        std::thread::sleep(Duration::from_micros(100));
    };
    assert_eq!(
        landed, pages,
        "rank {rank}: pipelined restore incomplete: {events:?}"
    );
    let total = t.elapsed().as_secs_f64();
    let faults = super::one_hop::minor_faults() - faults_before;
    timeline::mark("restore_done", 0);
    timeline::write().unwrap();
    PipelinedRestore {
        total,
        first_layer,
        marks,
        faults,
    }
}
