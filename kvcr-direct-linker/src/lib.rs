//! kvcr-direct-linker (slice 5/5): engine GPU pools ↔ KVCR DRAM through CUDA,
//! local and peer restore (mode B). The only crate allowed to depend on cudarc.
//!
//! Not written yet; the crate exports nothing today.
