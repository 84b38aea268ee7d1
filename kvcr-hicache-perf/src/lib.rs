//! kvcr-hicache-perf (slice 3/5): opt-in delivery and placement controls on top
//! of `kvcr-hicache-storage` (delivery windows, coalescing, split sizing,
//! anonymous DRAM, huge pages, NUMA). Every control is off by default.
//!
//! Not written yet; the crate exports nothing today.
