//! The engine-facing contracts over a [`DirectLinker`]: the request hooks
//! ([`RequestHooks`]) and the linker itself ([`Linker`]: offload, restore,
//! settle, the events).

use super::*;

impl RequestHooks for DirectLinker {
    fn prepares_requests(&self) -> bool {
        true
    }

    fn request_started(&mut self, context: &RequestContext) -> kvcr_linker_contracts::Result<()> {
        let attempt = context.attempt().clone();
        let (transfer, superseded) = self.prepared.start(&attempt)?;
        self.release_claims(superseded);
        let query = context.query();
        let fetch = Pending::Fetch {
            transfer,
            attempt: attempt.clone(),
            namespace: query.namespace,
            tail: query.tail.clone(),
            device_prefix_pages: query.device_prefix_pages,
        };
        if query.tail.is_empty() {
            self.immediate.push_back(fetch);
            return Ok(());
        }
        let keys: Vec<ScopedKey> = query
            .tail
            .iter()
            .map(|k| self.scoped(query.namespace, *k))
            .collect();
        let op = if self.submit_hints(context) {
            self.runner
                .hints()
                .fetch(&attempt.request, &keys, &self.pool_layout)
        } else {
            self.runner.fetch(&keys, &self.pool_layout)
        };
        match op {
            Ok(op) => {
                self.pending.insert(op, fetch);
            }
            // The runner refused the fetch: the attempt prepares nothing.
            Err(_) => self.immediate.push_back(fetch),
        }
        Ok(())
    }

    fn request_finished(&mut self, attempt: &AttemptId) -> kvcr_linker_contracts::Result<()> {
        let released = self.prepared.end(attempt)?;
        self.release_claims(released);
        if self.config.peer.is_some() {
            self.runner.hints().discard(&attempt.request);
        }
        Ok(())
    }

    fn request_aborted(&mut self, attempt: &AttemptId) -> kvcr_linker_contracts::Result<()> {
        self.request_finished(attempt)
    }

    fn reset(&mut self, next: Incarnation) -> kvcr_linker_contracts::Result<()> {
        let in_flight = self.accounting().transfers_in_flight;
        if in_flight > 0 {
            return Err(LinkError::TransfersInFlight { in_flight });
        }
        let released = self.prepared.reset()?;
        self.release_claims(released);
        let leftover: Vec<ClaimId> = self.claims.keys().copied().collect();
        self.release_claims(leftover);
        // A fresh runner: empty store, fresh pools, the same registrations.
        let (runner, regions, removals) =
            start_runner(&self.config, &self.memory).map_err(backend)?;
        self.runner = runner;
        self.regions = regions;
        self.removals = removals;
        self.namespaces.clear();
        self.engine_namespaces.clear();
        self.immediate.clear();
        self.incarnation = next;
        Ok(())
    }
}

impl Linker for DirectLinker {
    fn offload(&mut self, batch: OffloadBatch) -> kvcr_linker_contracts::Result<OffloadOutcome> {
        if batch.pages.len() > self.config.store_pages as usize {
            return Ok(OffloadOutcome::Declined(DeclineReason::OverCapacity));
        }
        for (_, slot) in &batch.pages {
            self.check_slot(*slot)?;
        }
        let entries = batch
            .pages
            .iter()
            .map(|(key, slot)| DepositEntry {
                key: self.scoped(batch.namespace, *key),
                spans: self.elements(*slot),
                page: None,
            })
            .collect();
        let op = self.runner.deposit(entries, false).map_err(backend)?;
        self.next_ticket += 1;
        let ticket = OffloadTicket(self.next_ticket);
        self.pending.insert(op, Pending::Offload(ticket));
        self.offloads.push_back((ticket, None));
        Ok(OffloadOutcome::Queued(ticket))
    }

    fn preparation(&self, attempt: &AttemptId) -> kvcr_linker_contracts::Result<PreparationState> {
        self.prepared.state(attempt)
    }

    fn lookup(
        &mut self,
        attempt: &AttemptId,
        device_prefix_pages: u32,
        tail: &[BlockKey],
    ) -> kvcr_linker_contracts::Result<RestorableLengths> {
        let (lengths, released) = self.prepared.lookup(attempt, device_prefix_pages, tail)?;
        self.release_claims(released);
        Ok(lengths)
    }

    fn load(
        &mut self,
        attempt: &AttemptId,
        slots: &[DeviceSlot],
    ) -> kvcr_linker_contracts::Result<LoadTicket> {
        self.prepared.check_can_load(attempt)?;
        for slot in slots {
            self.check_slot(*slot)?;
        }
        let missing = |page| LinkError::LoadWithoutClaim {
            attempt: attempt.clone(),
            page,
        };
        let claims = self.prepared.load_claims(attempt, slots.len())?;
        let mut entries = Vec::with_capacity(slots.len());
        for (claim, slot) in claims.iter().zip(slots) {
            let key = self
                .claims
                .get(claim)
                .copied()
                .ok_or_else(|| missing(entries.len()))?;
            entries.push(DeliverEntry {
                key,
                destinations: self.elements(*slot),
            });
        }
        let (transfer, unused) = self.prepared.accept_load(attempt, &claims)?;
        self.release_claims(unused);
        let op = match self.runner.deliver(entries) {
            Ok(op) => op,
            Err(e) => {
                // Nothing was queued: land the transfer at once, which hands
                // its claims back for release (the preparation is spent).
                let release = self.prepared.land_load(transfer);
                self.release_claims(release);
                return Err(backend(e));
            }
        };
        self.next_ticket += 1;
        let ticket = LoadTicket(self.next_ticket);
        self.pending.insert(
            op,
            Pending::Load {
                transfer,
                ticket,
                attempt: attempt.clone(),
            },
        );
        Ok(ticket)
    }

    fn poll(&mut self) -> Vec<LinkerEvent> {
        let mut events = Vec::new();
        while let Some(fetch) = self.immediate.pop_front() {
            self.land_fetch(fetch, None);
        }
        let results = self.runner.poll_completed();
        self.first_layers(&mut events);
        self.absorb(results, &mut events);
        self.emit(&mut events);
        events
    }

    fn accounting(&self) -> Accounting {
        Accounting {
            claims_held: self.claims.len(),
            transfers_in_flight: self.prepared.attempts().in_flight()
                + self.offloads.len()
                + self.restores.len(),
            live_attempts: self.prepared.attempts().live(),
        }
    }
}
