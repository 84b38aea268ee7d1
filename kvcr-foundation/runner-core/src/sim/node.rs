//! The simulated nodes: how a core is configured and stocked, the targets
//! (which pull) and the sources (which hold pages), and the addresses that
//! place them.

use super::*;

pub(super) fn endpoint(port: u16) -> ControlEndpoint {
    ControlEndpoint::parse(&format!("tcp://10.0.0.1:{port}")).unwrap()
}

impl Tiers {
    pub(super) const DRAM_ONLY: Self = Self {
        slots: SLOTS,
        g3: None,
    };

    /// A pool of `slots` over a G3 of `g3_slots`, spilling ahead or not.
    pub(super) fn with_g3(slots: u32, g3_slots: u32, spill_ahead: bool) -> Self {
        Self {
            slots,
            g3: Some(G3Config {
                slots: g3_slots,
                slot_bytes: BLOCK,
                alignment: BLOCK,
                spill_ahead,
            }),
        }
    }
}

/// The pool slot at `address` of a pool of `slots` at `pool`.
fn slot_at(pool: u64, slots: u32, address: u64) -> Option<u64> {
    let offset = address.checked_sub(pool)?;
    (offset % BLOCK == 0 && offset / BLOCK < u64::from(slots)).then_some(offset / BLOCK)
}

pub(super) fn new_core(pool_base: u64, port: u16, incarnation: u128) -> (Core, NamespaceId) {
    new_core_with(pool_base, port, incarnation, Tiers::DRAM_ONLY, |_| {})
}

/// A core of `tiers` whose peer configuration `adjust` may change
/// (allowlist, private namespaces, batching, shared memory).
pub(super) fn new_core_with(
    pool_base: u64,
    port: u16,
    incarnation: u128,
    tiers: Tiers,
    adjust: impl FnOnce(&mut PeerConfig),
) -> (Core, NamespaceId) {
    let config = CoreConfig {
        pools: vec![("kv".into(), BLOCK, tiers.slots)],
        pool_bases: vec![pool_base],
        operation_timeout_ns: TIMEOUT,
        watermark_percent: 0,
        medium: Medium::CpuPinned,
        g3: tiers.g3,
    };
    let policy: Box<dyn CachePolicy> = match tiers.g3 {
        Some(_) => Box::new(G3Lru),
        None => Box::new(Lru),
    };
    let mut core = Core::new(&config, policy).unwrap();
    let ns = core.register_namespace(Namespace::base(CompatDigest(1)));
    let pool_region = RegionId(0);
    let mut config = PeerConfig {
        endpoint: endpoint(port),
        incarnation: Incarnation::from_raw(incarnation).unwrap(),
        worker_address: vec![port as u8; 4],
        rkeys: vec![(pool_region, vec![1, 2, 3])],
        abandon_timeout_ns: 3 * TIMEOUT,
        metadata_retry_ns: TIMEOUT / 10,
        allowed_peers: Vec::new(),
        private_namespaces: Vec::new(),
        shared_memory: None,
        write_batch_bytes: 0,
        one_hop_write_batch_bytes: None,
        // Scaled to virtual time: reconnects and restarts now and then come
        // faster than this, and the refused target re-sends its metadata.
        route_budget: RouteBudget {
            burst: ROUTE_BURST,
            refill_ns: ROUTE_REFILL,
        },
        // Per target only: the scenarios count each target's changes.
        route_budget_total: RouteBudget {
            burst: u32::MAX,
            refill_ns: 1,
        },
        one_hop: true,
    };
    adjust(&mut config);
    core.enable_peer(config);
    // A layer-first page's K and V, as the direct linker asks.
    core.set_lead_elements(2);
    (core, ns)
}

pub(super) fn scoped(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

/// A source's host memory: the key whose bytes are at `address`.
pub(super) fn host_key(first: u64, address: u64) -> Option<u64> {
    let offset = address.checked_sub(SOURCE_HOST)?;
    (offset % BLOCK == 0 && offset / BLOCK < SOURCE_HOST_ELEMENTS).then(|| first + offset / BLOCK)
}

/// Runs a source's copies and G3 transfers at once, all succeeding, and
/// writes what they carry into `contents` (setup only: the fault-injecting
/// path is `Sim::start_g3`).
fn run_at_once(
    core: &mut Core,
    now: u64,
    pool: u64,
    slots: u32,
    first: u64,
    contents: &mut Contents,
) {
    while let Some(action) = core.poll_action() {
        match action {
            Action::Copy { job, keys, .. } => {
                for span in keys.iter().flatten() {
                    if let Some(slot) = slot_at(pool, slots, span.dst) {
                        let bytes = host_key(first, span.src).unwrap_or(GARBAGE);
                        contents.dram.insert(slot, bytes);
                    }
                }
                core.handle_copy_done(now, job, &vec![CopyOutcome::Copied; keys.len()]);
            }
            Action::G3 { job, transfers, .. } => {
                for t in transfers.iter().flatten() {
                    let Some(slot) = slot_at(pool, slots, t.addr) else {
                        continue;
                    };
                    match t.direction {
                        G3Direction::Store => {
                            let bytes = contents.dram.get(&slot).copied().unwrap_or(GARBAGE);
                            contents.files.insert(t.slot, bytes);
                        }
                        G3Direction::Load => {
                            let bytes = contents.files.get(&t.slot).copied().unwrap_or(GARBAGE);
                            contents.dram.insert(slot, bytes);
                        }
                    }
                }
                core.handle_copy_done(now, job, &vec![CopyOutcome::Copied; transfers.len()]);
            }
            _ => {}
        }
    }
}

/// Deposits source keys `first..first + SOURCE_KEYS` one at a time (copies
/// and spills landing at once), so a pool smaller than that moves its older
/// pages to G3. Returns the host region; `contents` gets what landed where.
pub(super) fn stock(
    core: &mut Core,
    now: u64,
    ns: NamespaceId,
    first: u64,
    tiers: Tiers,
    pool: u64,
    contents: &mut Contents,
) -> RegionId {
    let region = core
        .register_region(RegionDesc {
            label: "kv".into(),
            base: SOURCE_HOST,
            size: BLOCK,
            stride: 0,
            count: SOURCE_HOST_ELEMENTS,
        })
        .or_else(|_| core.region_by_label("kv").ok_or(()))
        .unwrap_or(RegionId(1));
    for i in 0..SOURCE_KEYS {
        let entry = DepositEntry {
            key: scoped(ns, first + i),
            spans: vec![ElementRef { region, index: i }],
            page: None,
        };
        core.deposit(now, vec![entry], false).unwrap();
        run_at_once(core, now, pool, tiers.slots, first, contents);
    }
    let mut done = Vec::new();
    core.drain_completed(&mut done);
    let held = (first..first + SOURCE_KEYS)
        .filter(|k| {
            let key = scoped(ns, *k);
            core.query(&key) == QueryStatus::Hit || core.g3_ready(&key)
        })
        .count();
    // Without G3 every key has a slot; with it, spills ahead may have taken
    // the G3 room a later move needed (the page then went).
    let least = match tiers.g3 {
        None => SOURCE_KEYS as usize,
        Some(_) => tiers.slots as usize,
    };
    assert!(held >= least, "{held} keys stocked");
    core.drain_events().for_each(drop);
    region
}

/// Source `s`'s incarnation after `restarts` restarts: unique per seed,
/// source and restart, and never a target's or the hostile member's.
pub(super) fn source_incarnation(seed: u64, s: usize, restarts: u128) -> u128 {
    (u128::from(seed) << 32) | ((s as u128 + 1) << 16) | restarts
}

impl Target {
    pub(super) fn new(
        t: usize,
        seed: u64,
        shared: bool,
        write_batch_bytes: u64,
        tiers: Tiers,
    ) -> (Self, NamespaceId) {
        let pool = TARGET_POOL + t as u64 * POOL_STEP;
        // With shared segments advertised, its sources ack with one copy now
        // and then (the driver decides).
        let (mut core, ns) = new_core_with(pool, TARGET_PORTS[t], t as u128 + 1, tiers, |c| {
            c.write_batch_bytes = write_batch_bytes;
            c.shared_memory = shared.then(|| SharedMemoryAdvert {
                boot_id: [1; 16],
                pid_namespace: 1,
                pid: 1 + t as u32,
                segments: vec![SegmentAdvert {
                    region: RegionId(0),
                    fd: 3,
                    token: [seed as u8 ^ t as u8; 16],
                }],
            });
        });
        core.handle_tick(0); // the driver's first turn
        let framework = core
            .register_region(RegionDesc {
                label: "kv".into(),
                base: FRAMEWORK,
                size: BLOCK,
                stride: 0,
                count: FRAMEWORK_ELEMENTS,
            })
            .unwrap();
        let target = Self {
            core,
            endpoint: endpoint(TARGET_PORTS[t]),
            pool,
            tiers,
            framework,
            memory: Contents::default(),
            grants: HashMap::new(),
            probed: HashSet::new(),
            deliveries: HashMap::new(),
            deliver_elements: HashMap::new(),
            next_element: 0,
            completed_ops: HashSet::new(),
            timed_out: HashSet::new(),
            committed: HashSet::new(),
        };
        (target, ns)
    }

    pub(super) fn slot_of(&self, address: u64) -> Option<u64> {
        slot_at(self.pool, self.tiers.slots, address)
    }

    /// The framework element at `address`.
    pub(super) fn element_of(address: u64) -> Option<u64> {
        let offset = address.checked_sub(FRAMEWORK)?;
        (offset % BLOCK == 0 && offset / BLOCK < FRAMEWORK_ELEMENTS).then_some(offset / BLOCK)
    }
}

impl Source {
    /// Incarnation `restarts` of source `s`, stocked with its keys. `files`:
    /// what its G3 files hold from earlier incarnations (a restart opens the
    /// same files, and its core starts with G3 empty).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        s: usize,
        seed: u64,
        restarts: u128,
        lanes: usize,
        now: u64,
        ns: NamespaceId,
        tiers: Tiers,
        files: HashMap<u32, u64>,
    ) -> Self {
        let pool = SOURCE_POOL + s as u64 * POOL_STEP;
        let incarnation = source_incarnation(seed, s, restarts);
        let (mut core, source_ns) =
            new_core_with(pool, SOURCE_PORTS[s], incarnation, tiers, |_| {});
        assert_eq!(source_ns, ns, "one namespace id on every core");
        let mut memory = Contents {
            dram: HashMap::new(),
            files,
        };
        let first = SOURCE_FIRST_KEY[s];
        let host = stock(&mut core, now, ns, first, tiers, pool, &mut memory);
        core.handle_tick(now); // the driver's first turn
        Self {
            core,
            endpoint: endpoint(SOURCE_PORTS[s]),
            pool,
            tiers,
            host,
            incarnation,
            restarts,
            memory,
            filled_from_g3: HashSet::new(),
            lane_free_at: vec![0; lanes.max(1)],
            next_lane: 0,
            routes: HashMap::new(),
            route_builds: HashMap::new(),
            max_reported: 0,
            asleep_until: 0,
        }
    }

    pub(super) fn slot_of(&self, address: u64) -> Option<u64> {
        slot_at(self.pool, self.tiers.slots, address)
    }
}
