//! The many-seeds run: 600 fresh seeds of random requests and faults, every
//! invariant checked after every step, and a coverage count that fails the
//! test when something never happened.

use super::*;

fn run_seed(seed: u64) -> Result<Coverage, String> {
    let mut sim = Sim::build(seed, 50);
    for step in 0..STEPS {
        sim.step()
            .map_err(|e| format!("seed {seed}, step {step}: {e}"))?;
    }
    sim.settle()
        .map_err(|e| format!("seed {seed}, settling: {e}"))?;
    Ok(sim.coverage())
}

/// Steps per seed before settling.
const STEPS: usize = 400;

#[test]
fn peer_protocol_survives_faults_over_many_seeds() {
    if let Some(seed) = std::env::var("KVCR_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        let seen = run_seed(seed).unwrap();
        eprintln!("sim: seed {seed}: {seen:?}");
        return;
    }
    let seeds: u64 = std::env::var("KVCR_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    // Fresh seeds each run (the first is printed, and a failure names its
    // own), so CI explores new schedules instead of replaying the same ones.
    let first: u64 = std::env::var("KVCR_SIM_FIRST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(0u8) >> 16
        });
    eprintln!(
        "sim: seeds {first}..{} (KVCR_SIM_FIRST_SEED={first})",
        first + seeds
    );
    let mut seen = Coverage::default();
    for seed in first..first + seeds {
        match run_seed(seed) {
            Ok(run) => seen.add(&run),
            Err(e) => panic!(
                "{e}\nreproduce: KVCR_SIM_SEED={seed} cargo test -p kvcr-runner-core --lib sim::"
            ),
        }
    }
    eprintln!("sim: {seen:#?}");
    // The coverage the simulator exists for happened, at least once per ten
    // seeds (each is many times that; a handful of seeds may see less).
    if seeds >= 100 {
        let missing: Vec<&str> = [
            ("ops split into several writes", seen.split_requests),
            ("source 0 wrote", seen.writes[0]),
            ("source 1 wrote", seen.writes[1]),
            ("writes cut over several lanes", seen.multi_lane_writes),
            ("writes concurrent on one source", seen.concurrent_writes),
            (
                "one source writing for both targets",
                seen.shared_source_writes,
            ),
            ("put reports out of order", seen.out_of_order_reports),
            ("target 0 committed", seen.committed[0]),
            ("target 1 committed", seen.committed[1]),
            ("keys committed on both targets", seen.overlapping_keys),
            ("delivers", seen.delivered),
            ("write ends after a probe", seen.late_ends),
            ("failed pieces", seen.failed_pieces),
            ("late pieces", seen.late_pieces),
            ("source crashes", seen.crashes),
            ("source stalls", seen.stalls),
            ("sources serving again after a stall", seen.stall_recoveries),
            ("quarantines", seen.quarantined),
            ("timeouts", seen.timeouts),
            ("runs with G3", seen.g3_runs),
            ("spills to G3", seen.spills),
            ("failed spills", seen.failed_spills),
            ("fills on a source (SourcePrepare)", seen.source_fills),
            ("pages put from a G3 fill", seen.served_from_g3),
            ("fills on a target", seen.target_fills),
            ("delivers straight from G3", seen.g3_delivers),
            ("failed fills", seen.failed_fills),
            ("source crashes mid-spill", seen.crashes_mid_spill),
            ("G3 evictions", seen.g3_evictions),
            ("guard-confirmed crashes", seen.guarded_crashes),
            ("puts resolved at a guarded crash", seen.guard_resolved_puts),
            ("death reports sent", seen.dead_reported),
            ("ops ended by a death report", seen.dead_freed),
            (
                "quarantined ops freed by a death report",
                seen.dead_freed_quarantined,
            ),
            (
                "death reports ending several ops",
                seen.dead_reports_ending_several,
            ),
            ("death reports ignored", seen.dead_ignored),
            ("quarantined ops probed again", seen.reprobes),
            ("route changes refused", seen.routes_refused),
            ("writes sent as messages", seen.message_writes),
            ("write messages taken", seen.messages_taken),
            ("write messages dropped", seen.messages_dropped),
        ]
        .into_iter()
        .filter(|(_, n)| n * 10 < seeds)
        .map(|(what, _)| what)
        .collect();
        assert!(missing.is_empty(), "too rare: {missing:?}");
    }
}
