//! Inventory events, capacity signals, draining, statistics and the invariant check.

use super::*;

impl Core {
    pub(in crate::machine) fn scope(&self, namespace: NamespaceId) -> InventoryScope {
        InventoryScope {
            owner: Owner::Kvcr,
            namespace,
            medium: self.medium,
        }
    }

    /// A namespace's adapter and salt, which go on the wire with its pages so
    /// a router never matches them against another namespace's query.
    pub(in crate::machine) fn namespace_tags(
        &self,
        namespace: NamespaceId,
    ) -> (Option<String>, Option<String>) {
        self.namespaces
            .get(&namespace)
            .map(|n| (n.lora_name.clone(), n.cache_salt.clone()))
            .unwrap_or_default()
    }

    /// The `Stored` event of one page in `scope`: its tokens (none without
    /// page info) and its namespace's adapter and salt.
    pub(in crate::machine) fn stored_event(
        &self,
        scope: InventoryScope,
        key: ScopedKey,
        page: Option<&PageInfo>,
    ) -> InventoryEvent {
        let (lora_name, cache_salt) = self.namespace_tags(key.namespace);
        let (parent, token_ids) =
            page.map_or((None, Vec::new()), |p| (p.parent, p.token_ids.clone()));
        InventoryEvent::Stored {
            scope,
            keys: vec![key.key],
            parent,
            block_size: u32::try_from(token_ids.len()).unwrap_or(u32::MAX),
            token_ids,
            lora_name,
            lora_id: None,
            cache_salt,
        }
    }

    pub(in crate::machine) fn publish_stored(&mut self, stored: &[(u32, Option<PageInfo>)]) {
        for (idx, page) in stored {
            let Some(r) = self.record(*idx) else { continue };
            let key = r.key;
            if let (Some(_), Some(p)) = (&self.g3, page) {
                // A spill to G3 publishes the page again (medium DISK).
                self.page_info.insert(*idx, p.clone());
            }
            let event = self.stored_event(self.scope(key.namespace), key, page.as_ref());
            let merge = self
                .events
                .last()
                .is_some_and(|last| last.can_merge(&event));
            match (merge, self.events.last_mut(), event) {
                (
                    true,
                    Some(InventoryEvent::Stored {
                        keys, token_ids, ..
                    }),
                    InventoryEvent::Stored {
                        keys: more_keys,
                        token_ids: more_tokens,
                        ..
                    },
                ) => {
                    keys.extend(more_keys);
                    token_ids.extend(more_tokens);
                }
                (_, _, event) => self.events.push(event),
            }
        }
    }

    pub(in crate::machine) fn publish_removed(&mut self, keys: &[ScopedKey]) {
        let mut by_namespace: BTreeMap<NamespaceId, Vec<kvcr_contracts::key::BlockKey>> =
            BTreeMap::new();
        for key in keys {
            by_namespace.entry(key.namespace).or_default().push(key.key);
        }
        for (namespace, keys) in by_namespace {
            self.events.push(InventoryEvent::Removed {
                scope: self.scope(namespace),
                keys,
            });
        }
    }

    // ------------------------------------------------------------ pressure

    /// Edge-triggered capacity signal: a pool whose reclaimable slots (free +
    /// evictable) newly drop below its watermark is reported once, until it
    /// recovers.
    pub(in crate::machine) fn check_pressure(&mut self) {
        for (i, p) in self.pools.iter_mut().enumerate() {
            if p.watermark == 0 {
                continue;
            }
            let reclaimable = p.free.len() as u32 + p.evictable;
            if reclaimable < p.watermark {
                if !p.pressured {
                    p.pressured = true;
                    self.capacity_signals.push((PoolId(i as u16), p.watermark));
                }
            } else {
                p.pressured = false;
            }
        }
    }

    // ------------------------------------------------------------ draining

    /// The next action for the driver.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Completed operations, in completion order.
    pub fn drain_completed(&mut self, out: &mut Vec<OpResult>) {
        out.append(&mut self.completed);
    }

    /// Inventory events, in order.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, InventoryEvent> {
        self.events.drain(..)
    }

    /// Pools that newly crossed their watermark.
    pub fn drain_capacity_signals(&mut self) -> Vec<(PoolId, u32)> {
        std::mem::take(&mut self.capacity_signals)
    }

    // ------------------------------------------------------------ stats

    /// Copy jobs not yet terminal.
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Live public claims.
    pub fn public_claims(&self) -> usize {
        self.claims.len()
    }

    /// Operations not yet completed.
    pub fn ops_in_flight(&self) -> usize {
        self.ops.len()
    }

    /// Whether `op` was issued and has not completed yet.
    pub fn op_pending(&self, op: OpHandle) -> bool {
        self.ops.contains_key(&op)
    }

    /// The counters.
    pub fn counters(&self) -> CoreCounters {
        let mut c = self.counters;
        c.policy_faults = self.policy.faults;
        c
    }

    /// The eviction policy's name.
    pub fn policy_name(&self) -> String {
        self.policy.name()
    }

    /// Per pool occupancy.
    pub fn pool_stats(&self) -> Vec<PoolStats> {
        self.pools
            .iter()
            .map(|p| PoolStats {
                name: p.name.clone(),
                block_size: p.block_size,
                total_slots: p.total,
                free_slots: p.free.len() as u32,
                evictable_slots: p.evictable,
            })
            .collect()
    }

    /// READY, FILLING and DISCARDING residencies.
    pub fn state_counts(&self) -> (usize, usize, usize) {
        let mut counts = (0, 0, 0);
        for e in self.index.values() {
            match e.state {
                Residency::Ready => counts.0 += 1,
                Residency::Filling => counts.1 += 1,
                Residency::Discarding => counts.2 += 1,
                Residency::Vacant => {}
            }
        }
        counts
    }

    /// Checks the structural invariants (used by the property tests after
    /// every step). Returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut owned: HashMap<(u16, u32), ScopedKey> = HashMap::new();
        for (key, entry) in &self.index {
            let r = self
                .records
                .get(entry.record as usize)
                .ok_or("index points past records")?;
            if r.key != *key || r.state != entry.state {
                return Err(format!("index and record disagree for {key:?}"));
            }
            let queued = r.flags & FLAG_QUEUED != 0;
            if queued && (r.claims != 0 || r.state != Residency::Ready) {
                return Err(format!(
                    "{key:?} is queued for eviction while claimed or not READY"
                ));
            }
            let pools = self.layouts.get(r.layout as usize).ok_or("bad layout")?;
            for (i, pool) in pools.iter().enumerate() {
                let slot = self.slot(entry.record, i).ok_or("missing slot")?;
                if let Some(other) = owned.insert((pool.0, slot), *key) {
                    return Err(format!(
                        "slot {pool:?}/{slot} owned by {other:?} and {key:?}"
                    ));
                }
                if self
                    .pools
                    .get(pool.0 as usize)
                    .is_some_and(|p| p.free.contains(&slot))
                {
                    return Err(format!("slot {pool:?}/{slot} of {key:?} is also free"));
                }
            }
        }
        for (pool, slot) in &self.recovered_held {
            if owned.contains_key(&(*pool, *slot))
                || self
                    .pools
                    .get(*pool as usize)
                    .is_some_and(|p| p.free.contains(slot))
            {
                return Err(format!(
                    "slot {pool}/{slot}, held since the recovery, is in use or free"
                ));
            }
        }
        // Every pool's evictable count is its queued records' slots in it.
        let mut evictable = vec![0u32; self.pools.len()];
        for entry in self.index.values() {
            let queued = self
                .records
                .get(entry.record as usize)
                .filter(|r| r.flags & FLAG_QUEUED != 0);
            if let Some(r) = queued {
                for pool in self.layouts.get(r.layout as usize).into_iter().flatten() {
                    if let Some(n) = evictable.get_mut(pool.0 as usize) {
                        *n += 1;
                    }
                }
            }
        }
        for (i, (p, expected)) in self.pools.iter().zip(&evictable).enumerate() {
            if p.evictable != *expected {
                return Err(format!(
                    "pool {i}: {} evictable, but its queued records hold {expected} slots",
                    p.evictable
                ));
            }
        }
        for (i, p) in self.pools.iter().enumerate() {
            let used = owned.keys().filter(|(pool, _)| *pool as usize == i).count();
            let held = self
                .recovered_held
                .iter()
                .filter(|(pool, _)| *pool as usize == i)
                .count();
            if used + held + p.free.len() != p.total as usize {
                return Err(format!(
                    "pool {i}: {used} used + {held} held + {} free != {}",
                    p.free.len(),
                    p.total
                ));
            }
        }
        for (handle, record) in &self.claims {
            let r = self
                .record(*record)
                .ok_or_else(|| format!("claim {handle:?} on a vacant record"))?;
            if r.state != Residency::Ready || r.claims == 0 {
                return Err(format!(
                    "claim {handle:?} on {:?} in {:?} with {} claims",
                    r.key, r.state, r.claims
                ));
            }
        }
        self.check_g3()
    }
}
