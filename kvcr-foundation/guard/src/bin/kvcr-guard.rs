//! `kvcr-guard --socket PATH`: the guard process. It owns the pool memory
//! and control listeners of the groups claimed from it, so they outlive the
//! engines that use them (see the `kvcr_guard` library).
//!
//! When a group's engine dies, the guard serves that group's recovered
//! pages to peers on the engine's control address until a new engine claims
//! the group (a backup runner, authenticated with the same cluster secret:
//! `KVCR_CLUSTER_SECRET` or `--secret-file`; UCX transports `--ucx-tls`;
//! `--advertise-host` for groups bound to a wildcard address;
//! `--operation-timeout-ms`). `--no-serve` only holds the memory.
//!
//! It serves until it is killed; a socket file left behind then is stale
//! and the next guard on the same path removes it. It refuses to start when
//! a guard already answers at the path. Log lines go to standard error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use kvcr_guard::{BackupServing, GuardConfig, GuardService};

const USAGE: &str = "usage: kvcr-guard --socket PATH [--no-serve] [--ucx-tls TLS] \
                     [--secret-file PATH] [--advertise-host IP] [--operation-timeout-ms MS]";

/// What the command line asked for.
struct Args {
    socket: PathBuf,
    serve: bool,
    ucx_tls: Option<String>,
    secret_file: Option<PathBuf>,
    advertise_host: Option<std::net::IpAddr>,
    operation_timeout: Duration,
}

fn parse() -> Result<Args, String> {
    let mut socket: Option<PathBuf> = None;
    let mut parsed = Args {
        socket: PathBuf::new(),
        serve: true,
        ucx_tls: None,
        secret_file: None,
        advertise_host: None,
        operation_timeout: Duration::from_secs(20),
    };
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        let Some(flag) = arg.to_str() else {
            return Err(format!("unexpected argument {arg:?}"));
        };
        if flag == "--no-serve" {
            parsed.serve = false;
            continue;
        }
        if matches!(flag, "-h" | "--help") {
            return Err(String::new());
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let text = value
            .to_str()
            .ok_or_else(|| format!("{flag}: not UTF-8"))?
            .to_owned();
        match flag {
            "--socket" => socket = Some(PathBuf::from(value)),
            "--ucx-tls" => parsed.ucx_tls = Some(text),
            "--secret-file" => parsed.secret_file = Some(PathBuf::from(value)),
            "--advertise-host" => {
                parsed.advertise_host = Some(
                    text.parse()
                        .map_err(|_| format!("--advertise-host {text:?} is not an IP"))?,
                );
            }
            "--operation-timeout-ms" => {
                let ms: u64 = text
                    .parse()
                    .ok()
                    .filter(|ms| (1..=3_600_000).contains(ms))
                    .ok_or_else(|| {
                        format!("--operation-timeout-ms {text:?} is not in 1..=3600000")
                    })?;
                parsed.operation_timeout = Duration::from_millis(ms);
            }
            other => return Err(format!("unexpected argument {other:?}")),
        }
    }
    parsed.socket = socket
        .filter(|s| !s.as_os_str().is_empty())
        .ok_or_else(|| "--socket is required".to_owned())?;
    Ok(parsed)
}

/// The backup runners' options: loopback defaults, the cluster secret,
/// transports and advertise host as asked.
fn serving(args: &Args) -> Result<Option<BackupServing>, String> {
    if !args.serve {
        return Ok(None);
    }
    let mut peer = kvcr_runner::PeerOptions::loopback();
    peer.ucx_tls = args.ucx_tls.clone().or(peer.ucx_tls);
    peer.secret = match &args.secret_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| format!("--secret-file {}: {e}", path.display()))?
                .trim()
                .as_bytes()
                .to_vec(),
        ),
        None => std::env::var("KVCR_CLUSTER_SECRET")
            .ok()
            .filter(|s| !s.is_empty())
            .map(String::into_bytes),
    };
    if let Some(ip) = args.advertise_host {
        peer.advertise_host = kvcr_contracts::endpoint::Host::Ip(ip);
        peer.advertise_policy = if ip.is_loopback() {
            kvcr_contracts::endpoint::AdvertisePolicy::SingleHost
        } else {
            kvcr_contracts::endpoint::AdvertisePolicy::CrossHost
        };
    }
    Ok(Some(BackupServing {
        peer,
        operation_timeout: args.operation_timeout,
    }))
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(why) if why.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(why) => {
            eprintln!("kvcr-guard: {why}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let serve = match serving(&args) {
        Ok(serve) => serve,
        Err(why) => {
            eprintln!("kvcr-guard: {why}");
            return ExitCode::from(2);
        }
    };
    let serving_note = if serve.is_some() {
        "serves orphaned groups' pages"
    } else {
        "holds memory only"
    };
    let config = GuardConfig {
        serve,
        ..GuardConfig::default()
    };
    let handle = match GuardService::start_with(&args.socket, config) {
        Ok(handle) => handle,
        Err(e) => {
            eprintln!("kvcr-guard: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!(
        "kvcr-guard: serving on {} (pid {}; {serving_note})",
        args.socket.display(),
        std::process::id()
    );
    match handle.wait() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvcr-guard: {e}");
            ExitCode::FAILURE
        }
    }
}
