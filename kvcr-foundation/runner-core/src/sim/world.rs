//! The simulated cluster: two targets, two sources and a hostile member,
//! built from a seed, and one step of a run (a request, a deposit, a fault
//! or time moving on).

use super::*;

/// Building a run and stepping it.
impl Sim {
    /// A run without G3 (the scripted tests).
    pub(super) fn new(seed: u64) -> Self {
        Self::build(seed, 0)
    }

    /// A run whose nodes get G3 in `g3_percent` of the seeds: then both
    /// sources hold more keys than their pool has slots (the rest lives in
    /// G3 only, and a `start_write` naming them fills them back first), and
    /// each target has G3 under its pool half the time (its evictions spill,
    /// and it fills and delivers from its own G3).
    pub(super) fn build(seed: u64, g3_percent: u64) -> Self {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let g3 = rng.chance(g3_percent);
        let mut targets = Vec::new();
        let mut ns = None;
        for t in 0..2 {
            let shared = rng.chance(50);
            // One write per operation, or writes of 1 page, of 2½ pages (2
            // keys) or of 3 pages.
            let batch = [0, BLOCK, 5 * BLOCK / 2, 3 * BLOCK][rng.below(4) as usize];
            let tiers = if g3 && rng.chance(50) {
                Tiers::with_g3(SLOTS, 4 + rng.below(5) as u32, rng.chance(50))
            } else {
                Tiers::DRAM_ONLY
            };
            let (target, target_ns) = Target::new(t, seed, shared, batch, tiers);
            assert!(ns.is_none_or(|n| n == target_ns));
            ns = Some(target_ns);
            targets.push(target);
        }
        let ns = ns.unwrap();
        let sources = (0..2)
            .map(|s| {
                let lanes = 1 + rng.below(4) as usize;
                // A pool of 4 or 5 slots (a write names at most 4 keys) over
                // 5 to 8 G3 slots, for 8 keys: some live only in G3, and G3
                // evicts now and then.
                let tiers = if g3 {
                    Tiers::with_g3(
                        4 + rng.below(2) as u32,
                        5 + rng.below(4) as u32,
                        rng.chance(50),
                    )
                } else {
                    Tiers::DRAM_ONLY
                };
                Source::new(s, seed, 0, lanes, 0, ns, tiers, HashMap::new())
            })
            .collect();
        Self {
            rng,
            seed,
            now: 0,
            ns,
            targets,
            sources,
            network: BTreeMap::new(),
            link_clock: HashMap::new(),
            seq: 0,
            puts: Vec::new(),
            messages: Vec::new(),
            message_percent: 30,
            writes: HashMap::new(),
            reports: Vec::new(),
            violations: Vec::new(),
            drop_percent: 5,
            put_fail_percent: 4,
            late_percent: 6,
            connect_fail_percent: 2,
            max_delay: TIMEOUT / 20,
            slow_percent: 10,
            max_put_time: TIMEOUT / 10,
            g3_jobs: Vec::new(),
            g3_write_fail_percent: 5,
            g3_read_fail_percent: 5,
            max_g3_time: TIMEOUT / 5,
            g3_slow_percent: 5,
            dead: [Vec::new(), Vec::new()],
            seen: Coverage {
                g3_runs: u64::from(g3),
                ..Coverage::default()
            },
        }
    }

    /// No faults, and quick messages and puts (for the scripted tests).
    pub(super) fn quiet(&mut self) {
        // Scripted tests follow puts in flight; messages get their own.
        self.message_percent = 0;
        self.drop_percent = 0;
        self.put_fail_percent = 0;
        self.late_percent = 0;
        self.connect_fail_percent = 0;
        self.max_delay = TIMEOUT / 20;
        self.slow_percent = 0;
        self.max_put_time = TIMEOUT / 50;
        self.g3_write_fail_percent = 0;
        self.g3_read_fail_percent = 0;
        self.max_g3_time = TIMEOUT / 50;
        self.g3_slow_percent = 0;
    }

    pub(super) fn key(&self, k: u64) -> ScopedKey {
        scoped(self.ns, k)
    }

    pub(super) fn peer_of(&self, to: &ControlEndpoint) -> Option<Peer> {
        if let Some(t) = self.targets.iter().position(|t| t.endpoint == *to) {
            return Some(Peer::Target(t));
        }
        self.sources
            .iter()
            .position(|s| s.endpoint == *to)
            .map(Peer::Source)
    }

    pub(super) fn core(&mut self, peer: Peer) -> &mut Core {
        match peer {
            Peer::Target(t) => &mut self.targets[t].core,
            Peer::Source(s) => &mut self.sources[s].core,
        }
    }

    /// A fetch or a deliver of some keys on a random target, under a fresh
    /// request whose hint names a random source.
    fn request(&mut self) -> Result<(), String> {
        let t = self.rng.below(2) as usize;
        let s = self.rng.below(2) as usize;
        let n = 1 + self.rng.below(4);
        let first = self.rng.below(KEYS - n + 1);
        let keys: Vec<ScopedKey> = (first..first + n).map(|k| self.key(k)).collect();
        let request = RequestId(format!("r{}", self.seq));
        self.seq += 1;
        let hint = FetchHint {
            source: self.sources[s].endpoint.clone(),
            block_hashes: keys.iter().map(|k| k.key).collect(),
            mode: FetchMode::Copy,
            action_id: None,
        };
        let deliver = self.rng.chance(30);
        let now = self.now;
        let target = &mut self.targets[t];
        let before = target.core.peer_counters().writes_requested;
        target.core.submit_hint(now, request.clone(), &hint);
        if deliver {
            let mut elements = Vec::new();
            let entries = keys
                .iter()
                .map(|key| {
                    let element = target.next_element % FRAMEWORK_ELEMENTS;
                    target.next_element += 1;
                    target.deliveries.insert(element, (key.key.as_u64(), false));
                    elements.push((key.key.as_u64(), element));
                    DeliverEntry {
                        key: *key,
                        destinations: vec![ElementRef {
                            region: target.framework,
                            index: element,
                        }],
                    }
                })
                .collect();
            let op = target
                .core
                .deliver(now, entries, Some(&request))
                .map_err(|e| e.to_string())?;
            for (key, element) in elements {
                target.deliver_elements.insert((op, key), element);
            }
        } else {
            target
                .core
                .fetch(now, &keys, &[PoolId(0)], Some(&request))
                .map_err(|e| e.to_string())?;
        }
        let requested = target.core.peer_counters().writes_requested - before;
        self.seen.requests += 1;
        if requested > 1 {
            self.seen.split_requests += 1;
        }
        Ok(())
    }

    /// The engine beside a source with G3 deposits some of the source's
    /// keys again: those it no longer holds in its pool come back, and
    /// making room for them moves others to G3.
    fn source_deposit(&mut self) -> Result<(), String> {
        let s = self.rng.below(2) as usize;
        let n = 1 + self.rng.below(3);
        let first = self.rng.below(SOURCE_KEYS - n + 1);
        let (now, ns) = (self.now, self.ns);
        let source = &mut self.sources[s];
        if source.tiers.g3.is_none() || source.asleep_until > now {
            return Ok(());
        }
        let entries = (first..first + n)
            .map(|i| DepositEntry {
                key: scoped(ns, SOURCE_FIRST_KEY[s] + i),
                spans: vec![ElementRef {
                    region: source.host,
                    index: i,
                }],
                page: None,
            })
            .collect();
        source
            .core
            .deposit(now, entries, false)
            .map_err(|e| format!("source {s}: {e}"))?;
        Ok(())
    }

    pub(super) fn step(&mut self) -> Result<(), String> {
        match self.rng.below(11) {
            0 | 1 => self.request()?,
            10 => self.source_deposit()?,
            2..=5 => {
                // On to the next message.
                if let Some(&(at, _)) = self.network.keys().next() {
                    self.advance_to(at);
                }
            }
            6 | 7 => self.advance(TIMEOUT / 3),
            8 => self.advance(TIMEOUT),
            _ if self.rng.chance(40) => self.hostile(),
            _ if self.rng.chance(15) => {
                // A source's process stops a while: past an operation timeout
                // it finds itself stalled when it wakes, refuses the writes
                // that waited meanwhile, and serves again once they are
                // drained.
                let s = self.rng.below(2) as usize;
                let stop = self.rng.below(2 * TIMEOUT);
                self.sources[s].asleep_until = self.now + stop;
                if stop >= TIMEOUT {
                    self.seen.stalls += 1;
                }
            }
            _ => {
                if self.rng.chance(25) {
                    // A source crashes and restarts at the same address; its
                    // targets may or may not see the connection drop. Half
                    // the time it is one writing into G3, if any is.
                    let spilling: Vec<usize> = (0..self.sources.len())
                        .filter(|s| {
                            self.g3_jobs.iter().any(|j| {
                                j.peer == Peer::Source(*s)
                                    && j.keys.iter().flatten().any(|span| span.store)
                            })
                        })
                        .collect();
                    let s = if !spilling.is_empty() && self.rng.chance(50) {
                        spilling[self.rng.below(spilling.len() as u64) as usize]
                    } else {
                        self.rng.below(2) as usize
                    };
                    if self.rng.chance(50) {
                        self.restart_source_guarded(s);
                    } else {
                        self.restart_source(s);
                    }
                    self.seen.crashes += 1;
                    if self.rng.chance(50) {
                        let lost = self.sources[s].endpoint.clone();
                        for t in &mut self.targets {
                            t.core.peer_connection_lost(&lost);
                        }
                    }
                }
            }
        }
        self.flush();
        self.check()
    }

    /// Lets everything settle without message loss; every op must then
    /// complete.
    pub(super) fn settle(&mut self) -> Result<(), String> {
        self.drop_percent = 0;
        for _ in 0..10_000 {
            let idle = self.targets.iter().all(|t| t.core.ops_in_flight() == 0);
            let quiet = self.network.is_empty()
                && self.puts.is_empty()
                && self.reports.is_empty()
                && self.g3_jobs.is_empty();
            if quiet && idle {
                break;
            }
            self.advance_to(self.now + TIMEOUT / 10);
            self.check()?;
        }
        for (t, target) in self.targets.iter().enumerate() {
            if target.core.ops_in_flight() != 0 {
                return Err(format!(
                    "target {t}: {} operations never completed",
                    target.core.ops_in_flight()
                ));
            }
        }
        Ok(())
    }
}
