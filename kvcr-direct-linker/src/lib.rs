//! kvcr-direct-linker (slice 5/5): the linker contract with the engine's KV
//! pool on the GPU and the store in the runner's KVCR DRAM (mode B, no engine
//! host tier).
//!
//! * [`layout`]: the engine's layer-first GPU KV pool ([`KvLayout`]): per layer
//!   a K and a V buffer of page slots; a page is `2 × layers` spans.
//! * [`cuda`]: every CUDA driver call (with [`copier`], which issues them for
//!   the runner's jobs, and `DirectLinker::new`'s region registrations, the
//!   crate's unsafe code), behind
//!   RAII handles. The driver is loaded at run time; a machine without one
//!   gets [`Error::NoDriver`], never a panic.
//! * [`copier`]: [`CudaCopier`], the runner's device copier. It pins and maps
//!   the runner's pools once and moves a whole job of scattered spans with one
//!   gather/scatter kernel launch per span index (layer 0 first), near the
//!   PCIe limit; [`CopyMode::PerSpan`] keeps the one-copy-per-span path as
//!   the anchor it is measured against. `rows` finds the runs of
//!   consecutive slots it moves as single 2D copies.
//! * [`one_hop`]: the one-hop route's CUDA side: [`CudaCopier::export`]
//!   names device memory for a same-host peer (legacy CUDA IPC), whose
//!   copier opens it ([`CudaImport`]) and copies its pinned pool's pages
//!   straight into it.
//! * [`linker`]: [`DirectLinker`], offload / prepare / lookup / load / poll
//!   over a runner, with peer restore through the runner's hinted fetch (peer
//!   KVCR DRAM → local DRAM over UCX → GPU).
//!
//! Its Python face, `kvcr_direct` (`python/`, its own cargo workspace), wraps
//! [`DirectLinker`] over an engine's torch tensors; before registering them it
//! asks the driver whether each is device memory of the linker's device,
//! mapped throughout ([`cuda::Device::check_allocation`]).
//!
//! GPU tests run with `KVCR_TEST_GPU=1` (and fail when no GPU is found then);
//! `cargo xtask gpu-build` builds the test and bench binaries to carry to a GPU
//! machine.

#![deny(unsafe_code)]

pub mod copier;
pub mod cuda;
pub mod error;
pub mod layout;
pub mod linker;
pub mod one_hop;
mod rows;

pub use copier::{CopyMode, CopyProfile, CudaCopier};
pub use error::{Error, Result};
pub use layout::KvLayout;
pub use linker::{DirectLinker, DirectLinkerConfig, KvMemory};
pub use one_hop::{CudaImport, ExportName};
