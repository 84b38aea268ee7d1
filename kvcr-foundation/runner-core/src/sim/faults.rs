//! Faults: the seeded randomness they draw from, crashes and restarts of a
//! source (guard-confirmed or not), reconfigured sources, and the hostile
//! member's forged messages and route churn.

use super::*;

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(super) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Crashes, restarts and the hostile member.
impl Sim {
    /// Source `s` crashes and restarts at the same address with a new
    /// incarnation (and fresh lanes and routes). Its in-flight puts may still
    /// land (we cannot know), so they stay in `puts`, never reported. Its G3
    /// jobs end with the process (the new one locks the files only once the
    /// old one is gone): each write landed, or did not, or did in part; the
    /// new incarnation opens the same files with G3 empty.
    pub(super) fn restart_source(&mut self, s: usize) {
        if self.end_g3_jobs(s) {
            self.seen.crashes_mid_spill += 1;
        }
        let old = &mut self.sources[s];
        let (restarts, lanes, tiers) = (old.restarts + 1, old.lane_free_at.len(), old.tiers);
        let files = std::mem::take(&mut old.memory.files);
        self.sources[s] = Source::new(
            s, self.seed, restarts, lanes, self.now, self.ns, tiers, files,
        );
        // What the guard knows dead at this address (nothing without a
        // guard-confirmed crash): the new process reports it.
        let dead = self.dead[s]
            .iter()
            .map(|i| Incarnation::from_raw(*i).unwrap())
            .collect();
        self.sources[s].core.set_dead_incarnations(dead);
    }

    /// Source `s` crashes, the guard confirms the death by its pidfd, and it
    /// restarts at the same address: the process is gone, so each put it had
    /// in flight landed (its bytes, or garbage if it failed) or did not,
    /// now, and none lands later; the new incarnation is told the old one
    /// dead.
    pub(super) fn restart_source_guarded(&mut self, s: usize) {
        let old = self.sources[s].incarnation;
        let (ended, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.puts)
            .into_iter()
            .partition(|p| p.source == s && p.incarnation == old);
        self.puts = kept;
        for put in ended {
            self.seen.guard_resolved_puts += 1;
            if !self.rng.chance(50) {
                continue; // never landed
            }
            let target = &mut self.targets[put.target];
            if target.core.slot_is_free(PoolId(0), put.slot as u32) {
                self.violations.push(format!(
                    "a put landed in target {}'s free slot {} ({put:?})",
                    put.target, put.slot
                ));
            }
            let bytes = if put.ok { put.key } else { GARBAGE };
            target.memory.dram.insert(put.slot, bytes);
        }
        self.writes
            .retain(|(ws, wi, _), _| !(*ws == s && *wi == old));
        self.reports
            .retain(|((ws, wi, _), _)| !(*ws == s && *wi == old));
        self.dead[s].push(old);
        self.seen.guarded_crashes += 1;
        self.restart_source(s);
    }

    /// Source `s`'s process ends: its G3 jobs stop where they are (a write
    /// leaves its G3 slot as it was, written, or half written). Returns
    /// whether one was writing.
    fn end_g3_jobs(&mut self, s: usize) -> bool {
        let (ended, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.g3_jobs)
            .into_iter()
            .partition(|j| j.peer == Peer::Source(s));
        self.g3_jobs = kept;
        let mut writing = false;
        for span in ended.iter().flat_map(|j| j.keys.iter().flatten()) {
            if let Place::File(slot) = span.to {
                writing = true;
                match self.rng.below(3) {
                    0 => {}
                    1 => {
                        self.sources[s].memory.files.insert(slot, span.bytes);
                    }
                    _ => {
                        self.sources[s].memory.files.insert(slot, GARBAGE);
                    }
                }
            }
        }
        writing
    }

    /// Replaces source `s`'s core by one whose configuration `adjust` changes.
    pub(super) fn reconfigure_source(&mut self, s: usize, adjust: impl FnOnce(&mut PeerConfig)) {
        self.end_g3_jobs(s);
        let source = &mut self.sources[s];
        let (core, _) = new_core_with(
            source.pool,
            SOURCE_PORTS[s],
            source.incarnation,
            source.tiers,
            adjust,
        );
        source.core = core;
        source.memory.dram.clear();
        source.filled_from_g3.clear();
        source.host = stock(
            &mut source.core,
            self.now,
            self.ns,
            SOURCE_FIRST_KEY[s],
            source.tiers,
            source.pool,
            &mut source.memory,
        );
    }

    /// A cluster member that misbehaves (it authenticated, so the channel
    /// stamps its own identity on what it sends): replies nobody asked it
    /// for, to a target; requests naming elements it was never granted, to
    /// a source (which has no route for it); probes for ops it never ran;
    /// metadata that changes every time (route churn), to a source.
    pub(super) fn hostile(&mut self) {
        let header = Header {
            sender: Incarnation::from_raw(0xbad).unwrap(),
            route_generation: RouteGeneration(0),
            sender_endpoint: endpoint(HOSTILE),
        };
        let op = OpHandle(self.rng.below(64));
        let to_target = [
            Body::WriteDone {
                op_handle: op,
                outcome: WriteOutcome::Completed(CompletedIndices::new(vec![0, 1, 2, 3])),
            },
            Body::WriteProbeAck {
                op_handle: op,
                terminal: true,
                dead_incarnation: None,
            },
            Body::TargetMetadataAck {
                op_handle: Some(op),
                one_copy: self.rng.chance(50),
                device: self.rng.chance(50),
            },
            Body::WriteRefused { op_handle: op },
        ];
        let t = self.rng.below(2) as usize;
        let body = match self.rng.below(5) as usize {
            4 => {
                // A death report naming a real incarnation of a source
                // (this one or an earlier one), mostly for one of the ops
                // the target probed last (one it may still hold): never
                // believed from this endpoint.
                let mut probed: Vec<OpHandle> = self.targets[t].probed.iter().copied().collect();
                probed.sort_unstable();
                let op = match probed.len() as u64 {
                    0 => op,
                    n if self.rng.chance(75) => probed[(n - 1 - self.rng.below(n.min(8))) as usize],
                    _ => op,
                };
                let s = self.rng.below(2) as usize;
                let restarts = self.rng.below(self.sources[s].restarts as u64 + 1);
                let dead = source_incarnation(self.seed, s, restarts.into());
                Body::WriteProbeAck {
                    op_handle: op,
                    terminal: true,
                    dead_incarnation: Some(Incarnation::from_raw(dead).unwrap()),
                }
            }
            i => to_target[i].clone(),
        };
        let target = self.targets[t].endpoint.clone();
        let message = Message {
            header: header.clone(),
            body,
        };
        self.handle(&target, self.now, message);
        let s = self.rng.below(2) as usize;
        let keys = vec![BlockKey::from_u64(self.rng.below(KEYS))];
        let to_source = [
            Body::StartWrite {
                op_handle: op,
                remaining_timeout_ms: 1,
                source_incarnation: Some(
                    Incarnation::from_raw(self.sources[s].incarnation).unwrap(),
                ),
                namespace: self.ns,
                keys,
                destinations: vec![
                    vec![ElementRef {
                        region: RegionId(0),
                        index: self.rng.below(1 << 20),
                    }]
                    .into(),
                ],
                lead_elements: 0,
            },
            Body::WriteProbe {
                op_handle: op,
                source_incarnation: None,
            },
        ];
        let source = self.sources[s].endpoint.clone();
        if self.rng.chance(66) {
            let body = to_source[self.rng.below(2) as usize].clone();
            self.handle(&source, self.now, Message { header, body });
            return;
        }
        // Route churn: a few adverts at once, each unlike the last.
        for _ in 0..=self.rng.below(4) {
            let body = Body::TargetMetadata {
                worker_address: vec![0xba, 0xd0],
                regions: vec![RegionAdvert {
                    id: RegionId(0),
                    label: format!("churn-{}", self.rng.below(1 << 30)),
                    base: 0x5000_0000,
                    element_size: BLOCK,
                    stride: BLOCK,
                    count: 4,
                    rkey: vec![9],
                }],
                shared_memory: None,
                doorbell: None,
                device_regions: Vec::new(),
            };
            let message = Message {
                header: header.clone(),
                body,
            };
            self.handle(&source, self.now, message);
        }
    }
}
