//! `kvcr-guard --socket PATH`: the guard process. It owns the pool memory
//! and control listeners of the groups claimed from it, so they outlive the
//! engines that use them (see `kvcr_runner::guard`).
//!
//! It serves until it is killed; a socket file left behind then is stale
//! and the next guard on the same path removes it. It refuses to start when
//! a guard already answers at the path. Log lines go to standard error.

use std::path::PathBuf;
use std::process::ExitCode;

use kvcr_runner::guard::GuardService;

const USAGE: &str = "usage: kvcr-guard --socket PATH";

fn main() -> ExitCode {
    let mut socket: Option<PathBuf> = None;
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--socket") => socket = args.next().map(PathBuf::from),
            Some("-h" | "--help") => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            Some(other) if other.starts_with("--socket=") => {
                socket = other.strip_prefix("--socket=").map(PathBuf::from);
            }
            _ => {
                eprintln!("kvcr-guard: unexpected argument {arg:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let Some(socket) = socket.filter(|s| !s.as_os_str().is_empty()) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let handle = match GuardService::start(&socket) {
        Ok(handle) => handle,
        Err(e) => {
            eprintln!("kvcr-guard: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!(
        "kvcr-guard: serving on {} (pid {})",
        socket.display(),
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
