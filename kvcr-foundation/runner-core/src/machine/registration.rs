//! Registration and queries: regions, namespaces, pools, residency of a key.

use super::*;

impl Core {
    /// Registers a host region of framework memory (validated; overlaps refused).
    pub fn register_region(&mut self, desc: RegionDesc) -> Result<RegionId> {
        self.register_region_in(desc, RegionMemory::Host)
    }

    /// Registers a region in the given memory (host or device).
    pub fn register_region_in(
        &mut self,
        desc: RegionDesc,
        memory: RegionMemory,
    ) -> Result<RegionId> {
        self.regions
            .register(desc, Owner::Framework, memory, &self.pool_specs, None)
    }

    /// Every runner pool's memory, in pool order.
    pub fn pool_ranges(&self) -> Vec<PoolRange> {
        self.pools
            .iter()
            .filter_map(|p| self.regions.get(p.region).ok())
            .map(|r| PoolRange {
                base: r.desc.base,
                len: r.desc.size.saturating_mul(r.desc.count),
            })
            .collect()
    }

    /// The id of a registered region.
    pub fn region_by_label(&self, label: &str) -> Option<RegionId> {
        self.regions.by_label(label)
    }

    /// Registers a namespace and returns its id (idempotent).
    pub fn register_namespace(&mut self, namespace: Namespace) -> NamespaceId {
        let id = namespace.id();
        if self.namespaces.insert(id, namespace).is_none() {
            self.journal_namespace(id);
        }
        id
    }

    /// The id of the pool of that name.
    pub fn pool_id(&self, name: &str) -> Option<PoolId> {
        self.pools
            .iter()
            .position(|p| p.name == name)
            .and_then(|i| u16::try_from(i).ok())
            .map(PoolId)
    }

    // ------------------------------------------------------------ queries

    /// Residency of one key: READY or FILLING in KVCR DRAM, else fetchable
    /// from G3 when G3 holds it READY. No allocation, no I/O.
    pub fn query(&self, key: &ScopedKey) -> QueryStatus {
        match self.index.get(key).map(|e| e.state) {
            Some(Residency::Ready) => QueryStatus::Hit,
            Some(Residency::Filling) => QueryStatus::Fetching,
            None if self.g3_ready(key) => QueryStatus::Fetchable(kvcr_contracts::tier::Tier::Disk),
            _ => QueryStatus::Miss,
        }
    }

    /// Keys in the index, whatever their residency.
    pub fn resident_blocks(&self) -> usize {
        self.index.len()
    }
}
