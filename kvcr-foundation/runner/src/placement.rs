//! Compat shim: removed once the split lands. Pool placement (options,
//! the host's answers, the placed anonymous mappings) lives in
//! [`kvcr_sys::placement`] and [`kvcr_sys::mapping`]; the public types are
//! re-exported from the crate root as before.

pub(crate) use kvcr_sys::mapping::AnonMapping;
pub use kvcr_sys::placement::{
    AnonymousMemory, HugePages, MAX_NUMA_NODE, NumaBinding, NumaMode, PlacementDowngrade,
    PlacementOutcome, PoolMemory, PoolMemoryInfo, online_nodes, shared_memory_huge_pages,
    transparent_huge_page_mode,
};
pub(crate) use kvcr_sys::placement::{huge_page_bytes, mapping_count, max_map_count};
