//! The eviction queue: an intrusive LRU list or a scored set, and slot allocation under pressure.

use super::*;

impl Core {
    pub(in crate::machine) fn meta(&self, idx: u32) -> Option<BlockMeta> {
        let r = self.record(idx)?;
        Some(BlockMeta {
            key: r.key,
            size_bytes: self.record_bytes(idx),
            access_count: r.access_count,
            last_access_ns: r.last_access,
            inserted_seq: r.seq,
        })
    }

    pub(in crate::machine) fn make_evictable(&mut self, idx: u32) {
        let queued = self.record(idx).is_none_or(|r| {
            r.flags & FLAG_QUEUED != 0 || r.claims != 0 || r.state != Residency::Ready
        });
        if queued {
            return;
        }
        match self.policy.order() {
            EvictionOrder::LeastRecentlyUsed => self.list_push_back(idx),
            // Insertion order survives a claim and release: the set is keyed by
            // insertion sequence, so a re-queued page goes back to its place.
            EvictionOrder::Insertion => {
                let Some(seq) = self.record(idx).map(|r| r.seq) else {
                    return;
                };
                self.scores.insert(idx, 0);
                self.scored.insert((0, seq, idx));
            }
            EvictionOrder::Scored => {
                let Some(meta) = self.meta(idx) else { return };
                let previous = self.scores.get(&idx).copied();
                match self.policy.eviction_score(&meta) {
                    Ok(Some(score)) => {
                        let bits = ordered_bits(score);
                        self.scores.insert(idx, bits);
                        self.scored.insert((bits, meta.inserted_seq, idx));
                    }
                    Ok(None) => {
                        if let Some(r) = self.record_mut(idx) {
                            r.flags |= FLAG_UNSCORED;
                        }
                    }
                    Err(()) => {
                        let bits = previous.unwrap_or(ordered_bits(0.0));
                        self.scores.insert(idx, bits);
                        self.scored.insert((bits, meta.inserted_seq, idx));
                    }
                }
            }
        }
        if let Some(r) = self.record_mut(idx) {
            r.flags |= FLAG_QUEUED;
        }
        self.adjust_evictable(idx, true);
    }

    pub(in crate::machine) fn dequeue(&mut self, idx: u32) {
        let Some(r) = self.record(idx) else { return };
        if r.flags & FLAG_QUEUED == 0 {
            return;
        }
        match self.policy.order() {
            EvictionOrder::LeastRecentlyUsed => self.list_unlink(idx),
            EvictionOrder::Insertion | EvictionOrder::Scored => {
                let seq = r.seq;
                if let Some(bits) = self.scores.remove(&idx) {
                    self.scored.remove(&(bits, seq, idx));
                }
            }
        }
        if let Some(r) = self.record_mut(idx) {
            r.flags &= !(FLAG_QUEUED | FLAG_UNSCORED);
        }
        self.adjust_evictable(idx, false);
    }

    pub(in crate::machine) fn list_push_back(&mut self, idx: u32) {
        let tail = self.queue_tail;
        if let Some(r) = self.records.get_mut(idx as usize) {
            r.prev = tail;
            r.next = NIL;
        }
        match self.records.get_mut(tail as usize) {
            Some(t) => t.next = idx,
            None => self.queue_head = idx,
        }
        self.queue_tail = idx;
    }

    pub(in crate::machine) fn list_unlink(&mut self, idx: u32) {
        let Some(r) = self.records.get(idx as usize) else {
            return;
        };
        let (prev, next) = (r.prev, r.next);
        match self.records.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => self.queue_head = next,
        }
        match self.records.get_mut(next as usize) {
            Some(n) => n.prev = prev,
            None => self.queue_tail = prev,
        }
        if let Some(r) = self.records.get_mut(idx as usize) {
            r.prev = NIL;
            r.next = NIL;
        }
    }

    /// Scored policies: pages the policy left unscored get another chance
    /// when space is needed.
    pub(in crate::machine) fn rescore_unscored(&mut self) {
        if self.policy.order() != EvictionOrder::Scored {
            return;
        }
        let unscored: Vec<u32> = self
            .records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.state == Residency::Ready && r.flags & FLAG_UNSCORED != 0)
            .map(|(i, _)| i as u32)
            .collect();
        for idx in unscored {
            if let Some(r) = self.record_mut(idx) {
                r.flags &= !(FLAG_QUEUED | FLAG_UNSCORED);
            }
            self.adjust_evictable(idx, false);
            self.make_evictable(idx);
        }
    }

    /// Takes one slot per pool of `layout`, evicting READY unclaimed pages if
    /// needed (or moving them to G3, as the policy says). Evicts nothing
    /// unless the whole allocation can succeed; when it can only once spills
    /// to G3 are done, starts them and answers [`Allocation::Pending`].
    pub(in crate::machine) fn allocate(
        &mut self,
        now: u64,
        layout: u16,
        protected: &[ScopedKey],
    ) -> Allocation {
        let Some(mut short) = self.slots_short(layout) else {
            return Allocation::Full;
        };
        if short.iter().any(|m| *m > 0) {
            // Spills in flight free DRAM slots when they end; what the keys
            // already waiting do not need is this allocation's, so it waits
            // for that rather than spill (or evict) more.
            let spare = self.room_coming();
            let mut coming = false;
            for (m, s) in short.iter_mut().zip(spare) {
                coming |= *m > 0 && s > 0;
                *m = m.saturating_sub(s);
            }
            if coming && short.iter().all(|m| *m == 0) {
                return Allocation::Pending;
            }
        }
        let mut still_short = short.iter().filter(|m| **m > 0).count();
        if still_short > 0 {
            self.rescore_unscored();
            let mut victims = Vec::new();
            let mut spills = Vec::new();
            // G3 slots the spills chosen so far will take.
            let mut promised = 0;
            // A candidate is being copied ahead (the allocation waits for it).
            let mut busy = false;
            let mut cursor = self.first_candidate();
            while let (Some(idx), true) = (cursor, still_short > 0) {
                cursor = self.next_candidate(idx);
                let Some(r) = self.record(idx) else { continue };
                if protected.contains(&r.key) {
                    continue;
                }
                let victim_layout = r.layout as usize;
                let helps = self.layouts.get(victim_layout).is_some_and(|l| {
                    l.iter()
                        .any(|p| short.get(p.0 as usize).is_some_and(|m| *m > 0))
                });
                if !helps {
                    continue;
                }
                let Some(meta) = self.meta(idx) else { continue };
                let victim_spans = self.layouts.get(victim_layout).map_or(0, Vec::len);
                match self.policy.decide_eviction(&meta) {
                    EvictionDecision::Keep => continue,
                    EvictionDecision::Drop => victims.push(idx),
                    EvictionDecision::MoveToG3 => match self.g3_move_kind(idx) {
                        Move::Spill if self.g3_has_room(promised, victim_spans) => {
                            promised += victim_spans;
                            spills.push(idx);
                        }
                        Move::AlreadyStored => {
                            if let Some(g3) = self.g3.as_mut() {
                                g3.counters_mut().moves_already_stored += 1;
                            }
                            victims.push(idx);
                        }
                        Move::Spill | Move::Drop => victims.push(idx),
                        // Being copied ahead: it is next in line, and
                        // evicting it is free once the copy lands; wait for
                        // that rather than evict a fresher page.
                        Move::Busy => busy = true,
                    },
                }
                for p in self.layouts.get(victim_layout).into_iter().flatten() {
                    if let Some(m) = short.get_mut(p.0 as usize).filter(|m| **m > 0) {
                        *m -= 1;
                        if *m == 0 {
                            still_short -= 1;
                        }
                    }
                }
            }
            if still_short > 0 {
                return Allocation::Full;
            }
            if busy {
                // Nothing is evicted or spilled now: the copy ahead lands,
                // the allocation is retried, and that page goes for free.
                return Allocation::Pending;
            }
            // Spills first: a victim G3 finds no slot for is dropped instead.
            victims.extend(self.start_spills(now, &spills));
            let mut removed = Vec::with_capacity(victims.len());
            for idx in victims {
                removed.extend(self.free_record(idx, "evict"));
                self.counters.evictions += 1;
            }
            // One Removed event per namespace for the whole batch.
            self.publish_removed(&removed);
            if self
                .slots_short(layout)
                .is_none_or(|s| s.iter().any(|m| *m > 0))
            {
                return Allocation::Pending;
            }
        }
        let mut slots = Vec::with_capacity(short.len());
        let Some(pools) = self.layouts.get(layout as usize).cloned() else {
            return Allocation::Full;
        };
        for pool in pools {
            match self
                .pools
                .get_mut(pool.0 as usize)
                .and_then(|p| p.free.pop_front())
            {
                Some(slot) => slots.push(slot),
                None => {
                    self.return_slots(layout, slots);
                    return Allocation::Full;
                }
            }
        }
        Allocation::Slots(slots)
    }

    /// Per pool, how many slots `layout` still lacks beyond the free ones.
    fn slots_short(&self, layout: u16) -> Option<Vec<u32>> {
        let pools = self.layouts.get(layout as usize)?;
        let mut short = vec![0u32; self.pools.len()];
        for pool in pools {
            *short.get_mut(pool.0 as usize)? += 1;
        }
        for (pool, missing) in short.iter_mut().enumerate() {
            let free = self.pools.get(pool).map_or(0, |p| p.free.len() as u32);
            *missing = missing.saturating_sub(free);
        }
        Some(short)
    }

    /// The first eviction candidate in policy order.
    pub(in crate::machine) fn first_candidate(&self) -> Option<u32> {
        match self.policy.order() {
            EvictionOrder::LeastRecentlyUsed => (self.queue_head != NIL).then_some(self.queue_head),
            EvictionOrder::Insertion | EvictionOrder::Scored => {
                self.scored.first().map(|(_, _, idx)| *idx)
            }
        }
    }

    /// The candidate after `idx` (which must still be queued).
    pub(in crate::machine) fn next_candidate(&self, idx: u32) -> Option<u32> {
        match self.policy.order() {
            EvictionOrder::LeastRecentlyUsed => {
                let next = self.records.get(idx as usize)?.next;
                (next != NIL).then_some(next)
            }
            EvictionOrder::Insertion | EvictionOrder::Scored => {
                let seq = self.records.get(idx as usize)?.seq;
                let bits = *self.scores.get(&idx)?;
                self.scored
                    .range((
                        std::ops::Bound::Excluded((bits, seq, idx)),
                        std::ops::Bound::Unbounded,
                    ))
                    .next()
                    .map(|(_, _, i)| *i)
            }
        }
    }
}
