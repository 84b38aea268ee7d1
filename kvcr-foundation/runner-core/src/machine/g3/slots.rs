//! Where G3 pages go: which pages G3 can hold, its slots (taken free, or
//! from the least recently used READY pages), and claims on a G3 copy.

use super::*;

/// G3 slots and residencies: fitting a page, taking slots, releasing claims.
impl Core {
    /// The scope G3 pages are published under (medium `DISK`).
    pub(super) fn g3_scope(namespace: NamespaceId) -> InventoryScope {
        InventoryScope {
            owner: Owner::Kvcr,
            namespace,
            medium: Medium::Disk,
        }
    }

    /// Whether G3 can hold pages of `layout`: every span in a pool whose
    /// block is a G3 slot, and no more spans than G3 has slots.
    pub(in crate::machine) fn g3_fits(&self, layout: u16) -> bool {
        let Some(g3) = &self.g3 else { return false };
        let Some(pools) = self.layouts.get(layout as usize) else {
            return false;
        };
        pools.len() <= g3.config.slots as usize
            && pools.iter().all(|pool| {
                self.pools
                    .get(pool.0 as usize)
                    .is_some_and(|p| p.block_size == g3.config.slot_bytes)
            })
    }

    /// What moving DRAM record `idx` to G3 takes.
    pub(in crate::machine) fn g3_move_kind(&self, idx: u32) -> Move {
        let Some(r) = self.record(idx) else {
            return Move::Drop;
        };
        if !self.g3_fits(r.layout) || r.flags & FLAG_SPILL_FAILED != 0 {
            return Move::Drop;
        }
        match self.g3.as_ref().and_then(|g| g.entries.get(&r.key)) {
            Some(e) if e.state == G3State::Ready && !e.poisoned => Move::AlreadyStored,
            // A spill ahead is reading it: it stays until that lands.
            Some(e) if e.state == G3State::Storing => Move::Busy,
            Some(_) => Move::Drop,
            None => Move::Spill,
        }
    }

    /// Whether G3 could find `more` slots beyond `promised` ones already
    /// counted (free ones, or those of READY unclaimed pages to evict).
    pub(in crate::machine) fn g3_has_room(&self, promised: usize, more: usize) -> bool {
        self.g3.as_ref().is_some_and(|g| {
            let evictable: usize = g
                .queue
                .values()
                .filter_map(|k| g.entries.get(k))
                .map(|e| e.slots.len())
                .sum();
            g.free.len() + evictable >= promised + more
        })
    }

    /// `n` G3 slots: free ones, else those of the least recently used READY
    /// unclaimed pages (each published `Removed`). Takes nothing unless all
    /// `n` can be had.
    pub(super) fn g3_take_slots(&mut self, n: usize) -> Option<Vec<u32>> {
        if !self.g3_has_room(0, n) {
            return None;
        }
        let mut evicted = Vec::new();
        let g3 = self.g3.as_mut()?;
        while g3.free.len() < n {
            let (_, victim) = g3.queue.pop_first()?;
            if let Some(e) = g3.entries.get_mut(&victim) {
                e.queued = false;
            }
            g3.remove(victim)?;
            g3.counters.evictions += 1;
            evicted.push(victim);
        }
        let slots = g3.free.drain(..n).collect();
        for victim in evicted {
            self.events.push(InventoryEvent::Removed {
                scope: Self::g3_scope(victim.namespace),
                keys: vec![victim.key],
            });
            self.keep_in_dram(victim);
        }
        Some(slots)
    }

    /// G3 no longer holds `key`: a DRAM copy waiting to retire after its
    /// spill (a reader still held it) stays instead, so the page is not lost
    /// from both tiers.
    fn keep_in_dram(&mut self, key: ScopedKey) {
        if let Some(record) = self.index.get(&key).map(|e| e.record)
            && let Some(r) = self.record_mut(record)
        {
            r.flags &= !FLAG_RETIRE;
        }
    }

    /// Drops a claim on `key`'s G3 copy after `read`: a failed read drops
    /// the copy (bytes G3 could not read are never served again).
    pub(in crate::machine) fn g3_release(&mut self, key: ScopedKey, read: G3Read) {
        let Some(g3) = self.g3.as_mut() else { return };
        let Some(e) = g3.entries.get_mut(&key) else {
            return;
        };
        e.claims = e.claims.saturating_sub(1);
        // The first failed read withdraws the copy at once (routers stop
        // hinting it, and no new reader starts); its slots go back when its
        // last reader is done.
        let withdrawn = read == G3Read::Failed && !e.poisoned;
        if read == G3Read::Failed {
            e.poisoned = true;
            g3.counters.fills_failed += 1;
        } else if read == G3Read::Read && !e.poisoned {
            g3.counters.bytes_filled += e.slots.len() as u64 * g3.config.slot_bytes;
        }
        if !e.poisoned {
            g3.enqueue(key);
        } else if e.claims == 0 {
            g3.remove(key);
        }
        if withdrawn {
            self.events.push(InventoryEvent::Removed {
                scope: Self::g3_scope(key.namespace),
                keys: vec![key.key],
            });
            self.keep_in_dram(key);
        }
    }
}
