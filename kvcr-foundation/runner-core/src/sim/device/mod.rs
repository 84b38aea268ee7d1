//! The one-hop route in the simulator: a target that exports a device
//! region and a same-host source that opens it (or, re-rolled per process,
//! cannot), on a seeded network, with the route's own completion shape.
//!
//! A device write's copy completes on a "stream event": the source's
//! driver learns it a seeded while after the write started (now and then
//! past the target's deadline), and only then reports it (`write_done`);
//! a copy fails (the source says so), or claims success over bytes that
//! are not the page (the target's landing check must catch it). The source
//! is killed mid-copy: its copies still land later, unreported, or (the
//! guard saw it exit) each landed or did not at the kill, and the next
//! process reports the old incarnation dead. Two-hop fallbacks (a source
//! that could not open the region, a deliver before the source acked) go
//! through the target's KVCR DRAM as today.
//!
//! Checked after every step, besides both cores' structural invariants:
//! * every device span a source writes lies in an element some live grant
//!   gave that very key (nothing written outside the grant);
//! * a deliver entry reported a success holds its key's page in its
//!   element;
//! * no deliver entry is reported at all, success or failure, while a copy
//!   into its element may still land (after a deadline, only proof of the
//!   named incarnation's end resolves it).

use super::*;

mod checks;

/// The target's device region: one element per page.
pub(super) const DEVICE: u64 = 0x5000_0000;
pub(super) const DEVICE_ELEMENTS: u64 = 1 << 14;
pub(super) const TARGET_PORT: u16 = 1;
pub(super) const SOURCE_PORT: u16 = 2;
const TARGET_INCARNATION: u128 = 0x7;
/// Keys the source holds (`0..HELD`); requests also name a few it lacks.
const HELD: u64 = 8;

/// A page's digest in the model: any function of the key will do.
pub(super) fn page_digest(key: u64) -> u64 {
    key.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1CE
}

/// A copy in flight from the source into the target (device elements or
/// pool slots), each piece carrying the key whose bytes it moves.
#[derive(Debug)]
struct Transfer {
    incarnation: u128,
    write: u64,
    device: bool,
    /// (element or slot, key carried).
    pieces: Vec<(u64, u64)>,
    done_at: u64,
    ok: bool,
    /// Claims success over bytes that are not the page.
    corrupt: bool,
    /// A one-hop write asked to report its lead: when its lead lands
    /// (`None`: not asked, or said already).
    lead_at: Option<u64>,
}

/// What the device runs saw; the many-seeds test wants each of it.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct DeviceCoverage {
    pub(super) one_hop_successes: u64,
    pub(super) two_hop_successes: u64,
    pub(super) fallbacks: u64,
    pub(super) refused_routes: u64,
    pub(super) caught_corruptions: u64,
    pub(super) held_past_deadline: u64,
    pub(super) dead_freed: u64,
    pub(super) kills_mid_copy: u64,
    /// Delivers reported ready to start on their first layer.
    pub(super) leads_reported: u64,
    /// Deliver copy jobs whose lead the driver reported landed.
    pub(super) copy_leads: u64,
}

impl DeviceCoverage {
    pub(super) fn add(&mut self, o: &Self) {
        self.one_hop_successes += o.one_hop_successes;
        self.two_hop_successes += o.two_hop_successes;
        self.fallbacks += o.fallbacks;
        self.refused_routes += o.refused_routes;
        self.caught_corruptions += o.caught_corruptions;
        self.held_past_deadline += o.held_past_deadline;
        self.dead_freed += o.dead_freed;
        self.kills_mid_copy += o.kills_mid_copy;
        self.leads_reported += o.leads_reported;
        self.copy_leads += o.copy_leads;
    }
}

/// One target, one source, the device and the wire between them.
pub(super) struct DeviceWorld {
    rng: Rng,
    seed: u64,
    pub(super) now: u64,
    pub(super) ns: NamespaceId,
    pub(super) target: Core,
    pub(super) device_region: RegionId,
    target_dram: HashMap<u64, u64>,
    /// Device element -> the key whose bytes are there (`GARBAGE`: none).
    device: HashMap<u64, u64>,
    pub(super) source: Core,
    source_incarnation: u128,
    restarts: u128,
    source_dram: Contents,
    dead: Vec<u128>,
    /// Whether this source process can open the target's export.
    import_ok: bool,
    network: BTreeMap<(u64, u64), (bool, Message)>,
    /// Latest arrival per direction (to target, to source): kept in order.
    link_clock: [u64; 2],
    seq: u64,
    transfers: Vec<Transfer>,
    /// Element -> (one-hop operation, key) it is granted for.
    granted: HashMap<u64, (OpHandle, u64)>,
    /// Deliver operation -> per entry, (key, element, sent at).
    delivers: HashMap<OpHandle, (Vec<(u64, u64)>, u64)>,
    /// Delivers reported ready on their first layer (each at most once).
    leads: std::collections::HashSet<OpHandle>,
    pending: Vec<(u64, RequestId, Vec<u64>)>,
    next_element: u64,
    next_request: u64,
    violations: Vec<String>,
    /// Faults on (off while settling, or for a scripted run).
    faults: bool,
    pub(super) seen: DeviceCoverage,
}

/// A router hint naming the device world's source for `keys`.
pub(super) fn source_hint(keys: &[u64]) -> FetchHint {
    FetchHint {
        source: endpoint(SOURCE_PORT),
        block_hashes: keys.iter().map(|k| BlockKey::from_u64(*k)).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    }
}

impl DeviceWorld {
    pub(super) fn new(seed: u64) -> Self {
        Self::new_with(seed, |_| {})
    }

    /// As [`Self::new`], the target's peer configuration then `adjust`ed.
    pub(super) fn new_with(seed: u64, adjust: impl FnOnce(&mut PeerConfig)) -> Self {
        let (mut target, ns) = new_core_with(
            TARGET_POOL,
            TARGET_PORT,
            TARGET_INCARNATION,
            Tiers::DRAM_ONLY,
            |c| {
                c.shared_memory = Some(SharedMemoryAdvert {
                    boot_id: [1; 16],
                    pid_namespace: 1,
                    pid: 1,
                    segments: Vec::new(),
                });
                adjust(c);
            },
        );
        let device_region = target
            .register_region_in(
                RegionDesc {
                    label: "kv:gpu".into(),
                    base: DEVICE,
                    size: BLOCK,
                    stride: 0,
                    count: DEVICE_ELEMENTS,
                },
                RegionMemory::Device,
            )
            .unwrap();
        target
            .set_device_export(device_region, vec![0xe5; 16])
            .unwrap();
        let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
        let import_ok = rng.chance(70);
        let incarnation = source_incarnation(seed, 0, 0);
        let (source, source_dram) = stocked_device_source(incarnation);
        Self {
            rng,
            seed,
            now: 0,
            ns,
            target,
            device_region,
            target_dram: HashMap::new(),
            device: HashMap::new(),
            source,
            source_incarnation: incarnation,
            restarts: 0,
            source_dram,
            dead: Vec::new(),
            import_ok,
            network: BTreeMap::new(),
            link_clock: [0; 2],
            seq: 0,
            transfers: Vec::new(),
            granted: HashMap::new(),
            delivers: HashMap::new(),
            leads: std::collections::HashSet::new(),
            pending: Vec::new(),
            next_element: 0,
            next_request: 0,
            violations: Vec::new(),
            faults: true,
            seen: DeviceCoverage::default(),
        }
    }

    /// Faults off from now on (a scripted run).
    pub(super) fn quiet(&mut self) {
        self.faults = false;
    }

    /// The live source process's incarnation.
    pub(super) fn source_incarnation(&self) -> u128 {
        self.source_incarnation
    }

    /// A hint for `keys` now, and their deliver now or a little later.
    pub(super) fn request(&mut self, keys: Vec<u64>) {
        let request = RequestId(format!("r{}", self.next_request));
        self.next_request += 1;
        self.target
            .submit_hint(self.now, request.clone(), &source_hint(&keys));
        let at = self.now + self.rng.below(TIMEOUT / 2);
        self.pending.push((at, request, keys));
    }

    fn deliver(&mut self, request: &RequestId, keys: &[u64]) {
        let mut entries = Vec::new();
        let mut placed = Vec::new();
        for key in keys {
            let element = self.next_element % DEVICE_ELEMENTS;
            self.next_element += 1;
            entries.push(DeliverEntry {
                key: scoped(self.ns, *key),
                destinations: vec![ElementRef {
                    region: self.device_region,
                    index: element,
                }],
            });
            placed.push((*key, element));
        }
        let op = self
            .target
            .deliver(self.now, entries, Some(request))
            .unwrap();
        self.delivers.insert(op, (placed, self.now));
    }

    fn send(&mut self, to_target: bool, message: Message) {
        if self.faults && self.rng.chance(2) {
            return;
        }
        let mut delay = 1 + self.rng.below(TIMEOUT / 20);
        if self.faults && self.rng.chance(3) {
            delay += self.rng.below(2 * TIMEOUT);
        }
        let link = &mut self.link_clock[usize::from(!to_target)];
        let at = (self.now + delay).max(*link);
        *link = at;
        self.seq += 1;
        self.network.insert((at, self.seq), (to_target, message));
    }

    fn element_of(address: u64) -> Option<u64> {
        let offset = address.checked_sub(DEVICE)?;
        (offset % BLOCK == 0 && offset / BLOCK < DEVICE_ELEMENTS).then_some(offset / BLOCK)
    }

    fn slot_of(pool: u64, address: u64) -> Option<u64> {
        let offset = address.checked_sub(pool)?;
        (offset % BLOCK == 0 && offset / BLOCK < u64::from(SLOTS)).then_some(offset / BLOCK)
    }

    fn run_target_actions(&mut self) {
        while let Some(action) = self.target.poll_action() {
            match action {
                Action::Send { message, .. } => {
                    if let Body::StartWrite {
                        op_handle,
                        keys,
                        destinations,
                        ..
                    } = &message.body
                    {
                        for (key, dests) in keys.iter().zip(destinations) {
                            for d in dests.iter().filter(|d| d.region == self.device_region) {
                                self.granted.insert(d.index, (*op_handle, key.as_u64()));
                            }
                        }
                    }
                    self.send(false, message);
                }
                Action::Copy {
                    job, keys, lead, ..
                } => {
                    for span in keys.iter().flatten() {
                        let (Some(slot), Some(element)) = (
                            Self::slot_of(TARGET_POOL, span.src),
                            Self::element_of(span.dst),
                        ) else {
                            self.violations.push(format!("a deliver copy {span:?}"));
                            continue;
                        };
                        let bytes = self.target_dram.get(&slot).copied().unwrap_or(GARBAGE);
                        self.device.insert(element, bytes);
                    }
                    // The copier says the lead landed (a page here is one
                    // element: all of it) before it reports the job, or
                    // does not get to say it.
                    if lead > 0 && self.rng.chance(70) {
                        self.seen.copy_leads += 1;
                        self.target.handle_copy_lead_landed(job);
                    }
                    let outcomes = vec![CopyOutcome::Copied; keys.len()];
                    self.target.handle_copy_done(self.now, job, &outcomes);
                }
                Action::Put { .. } | Action::Connect { .. } | Action::G3 { .. } => {
                    self.violations.push("the target wrote or connected".into());
                }
                Action::Cancel { .. } => {}
            }
        }
    }

    fn run_source_actions(&mut self) {
        while let Some(action) = self.source.poll_action() {
            match action {
                Action::Send { message, .. } => self.send(true, message),
                Action::Connect {
                    peer,
                    generation,
                    device_regions,
                    ..
                } => {
                    let offered = !device_regions.is_empty();
                    let device = offered && self.import_ok;
                    self.seen.refused_routes += u64::from(offered && !device);
                    self.source
                        .handle_connected_one_hop(&peer, generation, true, device);
                }
                Action::Put {
                    write,
                    spans,
                    page_spans,
                    device,
                    lead_elements,
                    ..
                } => {
                    if lead_elements > 0 && !device {
                        self.violations
                            .push(format!("write {write} asks a lead report through DRAM"));
                    }
                    // A device write says where each page's spans end; a
                    // write through DRAM says nothing.
                    let counted: usize = page_spans.iter().map(|&n| n as usize).sum();
                    if (device && counted != spans.len()) || (!device && !page_spans.is_empty()) {
                        self.violations.push(format!(
                            "write {write}'s pages {page_spans:?} do not cut its {} spans",
                            spans.len()
                        ));
                    }
                    self.start_transfer(write, &spans, device, lead_elements > 0);
                }
                Action::Copy { job, keys, .. } => {
                    let outcomes = vec![CopyOutcome::Copied; keys.len()];
                    self.source.handle_copy_done(self.now, job, &outcomes);
                }
                Action::G3 { .. } | Action::Cancel { .. } => {}
            }
        }
    }

    /// A source's write: each span checked against the grants, then copied
    /// on the model's "stream", completing a seeded while later.
    fn start_transfer(&mut self, write: u64, spans: &[PutSpan], device: bool, lead: bool) {
        let mut pieces = Vec::new();
        for span in spans {
            let carried = Self::slot_of(SOURCE_POOL, span.local)
                .and_then(|s| self.source_dram.dram.get(&s).copied())
                .unwrap_or(GARBAGE);
            if device {
                let element = Self::element_of(span.remote).filter(|_| span.len == BLOCK);
                match element.and_then(|e| Some((e, *self.granted.get(&e)?))) {
                    Some((element, (_, key))) if key == carried => {
                        pieces.push((element, carried));
                    }
                    _ => self.violations.push(format!(
                        "a device write outside its grant: {span:?} carrying key {carried}"
                    )),
                }
            } else {
                match Self::slot_of(TARGET_POOL, span.remote) {
                    Some(slot) => pieces.push((slot, carried)),
                    None => self
                        .violations
                        .push(format!("a put outside the pool {span:?}")),
                }
            }
        }
        let mut done_at = self.now + 1 + self.rng.below(TIMEOUT / 4);
        if self.faults && self.rng.chance(5) {
            done_at += TIMEOUT + self.rng.below(2 * TIMEOUT);
        }
        let ok = !(self.faults && self.rng.chance(5));
        let corrupt = ok && device && self.faults && self.rng.chance(4);
        // The lead lands part way through the copy (a page here is one
        // element, so all of it; a failing copy may never get there).
        let lead_at = (lead && ok).then(|| self.now + self.rng.below(done_at - self.now));
        self.transfers.push(Transfer {
            incarnation: self.source_incarnation,
            write,
            device,
            pieces,
            done_at,
            ok,
            corrupt,
            lead_at,
        });
    }

    fn land(&mut self, t: &Transfer, ok: bool) {
        for (place, key) in &t.pieces {
            let bytes = if ok && !t.corrupt { *key } else { GARBAGE };
            if t.device {
                self.device.insert(*place, bytes);
            } else {
                self.target_dram.insert(*place, bytes);
            }
        }
    }

    /// Copies whose stream event came: their bytes land, and the live
    /// process's driver reports them (a killed one's land unreported).
    fn complete_transfers(&mut self) {
        let now = self.now;
        let mut leads = Vec::new();
        for t in &mut self.transfers {
            if t.lead_at.is_some_and(|at| at <= now) {
                t.lead_at = None;
                leads.push((t.incarnation, t.write));
            }
        }
        for (incarnation, write) in leads {
            let same = |t: &&Transfer| t.write == write && t.incarnation == incarnation;
            if let Some(t) = self.transfers.iter().find(same) {
                let landed = Transfer {
                    pieces: t.pieces.clone(),
                    ..*t
                };
                self.land(&landed, true);
            }
            if incarnation == self.source_incarnation {
                self.source.handle_put_lead_landed(write);
            }
        }
        let (due, rest): (Vec<Transfer>, Vec<Transfer>) = std::mem::take(&mut self.transfers)
            .into_iter()
            .partition(|t| t.done_at <= now);
        self.transfers = rest;
        for t in due {
            self.land(&t, t.ok);
            if t.incarnation == self.source_incarnation {
                self.source.handle_put_done(now, t.write, t.ok);
            }
        }
    }

    /// The target's driver: a one-hop `write_done` is checked against the
    /// device bytes before the core hears of it.
    fn target_receives(&mut self, message: Message) {
        let landing = match &message.body {
            Body::WriteDone {
                op_handle,
                outcome: WriteOutcome::Completed(completed),
            } => self
                .target
                .target_device_landing(*op_handle)
                .map(|landing| (landing, completed.clone())),
            _ => None,
        };
        let Some((landing, completed)) = landing else {
            return self.target.handle_message(self.now, message);
        };
        let Some(digests) = completed.digests() else {
            // Nothing to check against: the core fails the keys closed.
            return self.target.handle_message(self.now, message);
        };
        let mut mismatched = Vec::new();
        for (index, digest) in completed.as_slice().iter().zip(digests) {
            let Some(spans) = landing.get(*index as usize) else {
                continue;
            };
            let found: Vec<u64> = spans
                .iter()
                .map(|(address, _)| {
                    Self::element_of(*address)
                        .and_then(|e| self.device.get(&e).copied())
                        .unwrap_or(GARBAGE)
                })
                .collect();
            let hashed = match found.as_slice() {
                [key] if *key != GARBAGE => page_digest(*key),
                _ => !page_digest(0),
            };
            if hashed != *digest {
                mismatched.push(*index);
                self.seen.caught_corruptions += 1;
            }
        }
        self.target
            .handle_one_hop_checked(self.now, message, &mismatched);
    }

    /// The source is killed mid-copy and restarts at the same address.
    fn kill_source(&mut self, guarded: bool) {
        let old = self.source_incarnation;
        if self.transfers.iter().any(|t| t.incarnation == old) {
            self.seen.kills_mid_copy += 1;
        }
        if guarded {
            // The guard saw it exit: each copy landed or did not, now.
            let (mine, rest): (Vec<Transfer>, Vec<Transfer>) = std::mem::take(&mut self.transfers)
                .into_iter()
                .partition(|t| t.incarnation == old);
            self.transfers = rest;
            for t in mine {
                let ok = t.ok && self.rng.chance(50);
                self.land(&t, ok);
            }
            self.dead.push(old);
        }
        self.restarts += 1;
        self.source_incarnation = source_incarnation(self.seed, 0, self.restarts);
        let (source, dram) = stocked_device_source(self.source_incarnation);
        self.source = source;
        self.source_dram = dram;
        let dead = self.dead.iter().filter_map(|d| Incarnation::from_raw(*d));
        self.source.set_dead_incarnations(dead.collect());
        self.import_ok = self.rng.chance(70);
        // Its sessions went with it.
        self.network.retain(|_, (to_target, _)| *to_target);
        if self.rng.chance(50) {
            self.target.peer_connection_lost(&endpoint(SOURCE_PORT));
        }
    }

    /// One event's worth of time, faults and requests, then the checks.
    pub(super) fn step(&mut self) -> Result<(), String> {
        self.now += 1 + self.rng.below(TIMEOUT / 10);
        let now = self.now;
        self.complete_transfers();
        let due: Vec<(u64, u64)> = self
            .network
            .range(..=(now, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in due {
            if let Some((to_target, message)) = self.network.remove(&k) {
                if to_target {
                    self.target_receives(message);
                } else {
                    self.source.handle_message(now, message);
                }
                self.run_actions();
            }
        }
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(at, ..)| *at <= now);
        self.pending = waiting;
        for (_, request, keys) in ready {
            self.deliver(&request, &keys);
        }
        self.target.handle_timeout(now);
        self.target.handle_tick(now);
        self.source.handle_tick(now);
        if self.faults {
            if self.rng.chance(25) {
                // Distinct keys: a deliver naming one key twice is not
                // what this model is about.
                let first = self.rng.below(HELD + 2);
                let n = 1 + self.rng.below(4);
                let keys = (first..first + n).map(|k| k % (HELD + 2)).collect();
                self.request(keys);
            }
            if self.rng.chance(2) {
                let guarded = self.rng.chance(50);
                self.kill_source(guarded);
            }
        }
        self.run_actions();
        self.check()
    }

    /// Both drivers' turns (they feed each other only through the wire).
    fn run_actions(&mut self) {
        self.run_target_actions();
        self.run_source_actions();
    }

    /// Faults off, then time enough for everything that can end to end.
    pub(super) fn settle(&mut self) -> Result<(), String> {
        self.faults = false;
        for _ in 0..400 {
            self.step()?;
        }
        Ok(())
    }
}

/// A source holding keys `0..HELD`, each page deposited with its digest.
fn stocked_device_source(incarnation: u128) -> (Core, Contents) {
    let (mut core, ns) = new_core(SOURCE_POOL, SOURCE_PORT, incarnation);
    let region = core
        .register_region(RegionDesc {
            label: "kv".into(),
            base: SOURCE_HOST,
            size: BLOCK,
            stride: 0,
            count: SOURCE_HOST_ELEMENTS,
        })
        .unwrap();
    let mut contents = Contents::default();
    for key in 0..HELD {
        let entry = DepositEntry {
            key: scoped(ns, key),
            spans: vec![ElementRef { region, index: key }],
            page: None,
        };
        core.deposit(0, vec![entry], false).unwrap();
        while let Some(action) = core.poll_action() {
            if let Action::Copy { job, keys, .. } = action {
                for span in keys.iter().flatten() {
                    if let Some(slot) = DeviceWorld::slot_of(SOURCE_POOL, span.dst) {
                        contents.dram.insert(slot, key);
                    }
                }
                let outcomes = vec![CopyOutcome::Copied; keys.len()];
                let digests = vec![Some(page_digest(key)); keys.len()];
                core.handle_copy_done_digested(0, job, &outcomes, &digests);
            }
        }
    }
    let mut done = Vec::new();
    core.drain_completed(&mut done);
    core.drain_events().for_each(drop);
    (core, contents)
}
