//! A guard's backup of an orphaned group: when the primary holding a group
//! dies and the guard is configured to serve ([`BackupServing`]), a runner
//! over duplicates of the group's pool files and listener serves the pages
//! its journal recovered, on the dead primary's control address, until the
//! next claim of the group stops it (see the registry). The runner's side
//! of it is [`Runner::start_backup`]; what is decided here is when, with
//! which options, and what is logged.

use std::fs::File;
use std::io;
use std::net::TcpListener;

use kvcr_contracts::endpoint::{AdvertisePolicy, BindAddress, Host};
use kvcr_runner::guard::OrphanedGroup;
use kvcr_runner::{PoolConfig, Runner, RunnerConfig};

use crate::registry::Group;
use crate::{BackupServing, GuardLog};

/// Starts the backup runner of orphaned `group` (see [`BackupServing`]);
/// `None`, logged, when its journal cannot be served from or it fails to
/// start (the memory stays held either way).
pub(crate) fn start_backup(
    id: u32,
    group: &Group,
    serving: &BackupServing,
    log: &GuardLog,
) -> Option<Runner> {
    let failed = |why: String| {
        log.line(format!(
            "group {id}: not serving the dead primary's pages: {why}"
        ));
    };
    type PoolFiles = Vec<(File, [u8; 16])>;
    let dups = || -> io::Result<(PoolFiles, TcpListener)> {
        let pools = group
            .pools
            .iter()
            .map(|(file, token)| Ok((file.try_clone()?, *token)))
            .collect::<io::Result<Vec<_>>>()?;
        Ok((pools, group.listener.try_clone()?))
    };
    let (pools, listener) = match dups() {
        Ok(d) => d,
        Err(e) => {
            failed(format!("dup: {e}"));
            return None;
        }
    };
    let dead: Vec<u128> = group.dead.iter().copied().collect();
    let orphan = OrphanedGroup {
        group: id,
        pools,
        listener,
        member_key: group.member_key.clone(),
        journal: &group.journal,
        dead_incarnations: &dead,
    };
    let config = RunnerConfig {
        pools: group
            .layout
            .pools
            .iter()
            .map(|p| PoolConfig {
                name: p.name.clone(),
                block_size: p.block_bytes,
                blocks: p.blocks,
            })
            .collect(),
        operation_timeout: serving.operation_timeout,
        // The pages are in the guard's memory already; nothing is written.
        prefault: false,
        ..RunnerConfig::default()
    };
    let mut peer = serving.peer.clone();
    peer.guard = None;
    // The backup proves the group's key (`orphan`), as its primaries did.
    peer.static_key = None;
    let ip = group.control.ip();
    peer.bind = BindAddress {
        host: Some(ip),
        port: group.control.port(),
    };
    if !ip.is_unspecified() {
        peer.advertise_host = Host::Ip(ip);
        peer.advertise_policy = if ip.is_loopback() {
            AdvertisePolicy::SingleHost
        } else {
            AdvertisePolicy::CrossHost
        };
    }
    // A journal that cannot be served from is refused here too (logged).
    match Runner::start_backup(config, &peer, orphan) {
        Ok(runner) => {
            let seated = runner
                .recovery()
                .warm_start()
                .and_then(|w| w.recovery.as_ref())
                .map_or(0, |r| r.seated);
            log.line(format!(
                "group {id}: backup {} serves {seated} recovered pages at {}",
                runner.incarnation(),
                runner
                    .peers()
                    .endpoint()
                    .map_or_else(String::new, ToString::to_string)
            ));
            Some(runner)
        }
        Err(e) => {
            failed(e.to_string());
            None
        }
    }
}
