//! Fixtures for the guard's tests on both sides of the socket: a scratch
//! directory for the socket, a two-pool layout and claims of it, and a look
//! at a descriptor's `O_CLOEXEC`. The runner's client tests declare this
//! module, and the `kvcr-guard` crate's tests include the same file
//! (`#[path]`), so it names only what both parents bring into scope.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use super::*;

/// A directory of its own under the temp dir (short: socket paths must fit
/// in 108 bytes), removed on drop.
pub(super) struct Scratch(pub(super) PathBuf);

impl Scratch {
    pub(super) fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvcr-guard-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub(super) fn socket(&self) -> PathBuf {
        self.0.join("guard.sock")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(super) fn layout() -> Layout {
    Layout {
        pools: vec![
            PoolSpec {
                name: "kv".into(),
                block_bytes: 4096,
                blocks: 4,
            },
            PoolSpec {
                name: "state".into(),
                block_bytes: 8192,
                blocks: 2,
            },
        ],
        journal_bytes: 3 * 4096,
    }
}

pub(super) fn claim_of(group: u32, incarnation: u128) -> GuardClaim {
    GuardClaim {
        group,
        compat_digest: 0xfeed_f00d,
        layout: layout(),
        control: "127.0.0.1:0".into(),
        incarnation,
    }
}

/// A claim of `group` as raw JSON, for tests that edit or cut it by hand.
pub(super) fn claim_json(group: u32) -> serde_json::Value {
    serde_json::to_value(Request::Claim(ClaimMsg {
        version: 1,
        group,
        compat_digest: 5,
        layout: layout(),
        control: "127.0.0.1:0".into(),
        incarnation: protocol::hex128(0x77),
    }))
    .unwrap()
}

/// The descriptor's flags in `/proc/self/fdinfo` include `O_CLOEXEC`.
pub(super) fn is_cloexec(fd: &impl AsRawFd) -> bool {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).unwrap();
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
        .unwrap();
    flags & 0o2000000 != 0
}
