//! Processes and their clocks, for the benchmarks and tests above: another
//! process's memory read by the kernel (`process_vm_readv`, the same-host
//! copy the one-copy route is measured against), the tick rate of the CPU
//! times `/proc` reports, and the raw monotonic clock (the one scheduler
//! traces are stamped with).

use std::time::Duration;

use crate::error::{Result, SysError};

/// Copies up to `dst.len()` bytes from `addr` in process `pid` into `dst`
/// with one `process_vm_readv`; the bytes copied (fewer at the end of a
/// remote mapping). Safe: the kernel checks the remote range (a bad one is
/// refused with `EFAULT`) and writes only into `dst`. Reading a range that
/// another thread writes meanwhile gives torn bytes, never undefined
/// behaviour here, as a read of a file would.
pub fn read_remote(pid: u32, addr: u64, dst: &mut [u8]) -> Result<usize> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| SysError::os_errno("process_vm_readv", libc::ESRCH))?;
    let local = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: dst.len(),
    };
    // SAFETY: `local` names exactly `dst`, borrowed exclusively for the
    // call; `remote` is only read, by the kernel, which checks it.
    let copied = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    usize::try_from(copied).map_err(|_| SysError::os("process_vm_readv"))
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`): the unit of the CPU
/// times in `/proc/<pid>/stat`.
pub fn clock_ticks_per_second() -> Result<u64> {
    // SAFETY: sysconf takes and returns plain integers.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks)
        .ok()
        .filter(|t| *t > 0)
        .ok_or_else(|| SysError::os("sysconf(_SC_CLK_TCK)"))
}

/// The raw `CLOCK_MONOTONIC` reading (since an unspecified start, usually
/// boot), as `perf sched record -k mono` stamps its events; `std::time::
/// Instant` does not show its value.
pub fn monotonic_clock() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    // CLOCK_MONOTONIC is always there on Linux; a refusal reads as zero.
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PoolMemoryReason;

    /// Whether the kernel (or a sandbox's filter) refuses the call itself.
    fn refused(err: &SysError) -> bool {
        matches!(
            err,
            SysError::PoolMemory(PoolMemoryReason::Os { errno, .. })
                if *errno == libc::EPERM || *errno == libc::ENOSYS
        )
    }

    #[test]
    fn read_remote_copies_this_process() {
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        match read_remote(std::process::id(), src.as_ptr() as u64, &mut dst) {
            Ok(copied) => {
                assert_eq!(copied, src.len());
                assert_eq!(dst, src);
            }
            Err(err) => assert!(refused(&err), "{err}"),
        }
    }

    #[test]
    fn read_remote_refuses_a_bad_range() {
        let mut dst = [0u8; 16];
        let err = read_remote(std::process::id(), 8, &mut dst).unwrap_err();
        assert!(
            refused(&err)
                || matches!(
                    err,
                    SysError::PoolMemory(PoolMemoryReason::Os {
                        errno: libc::EFAULT,
                        ..
                    })
                ),
            "{err}"
        );
        assert_eq!(dst, [0u8; 16], "nothing written");
    }

    #[test]
    fn read_remote_of_nothing_copies_nothing() {
        let src = [1u8; 4];
        match read_remote(std::process::id(), src.as_ptr() as u64, &mut []) {
            Ok(copied) => assert_eq!(copied, 0),
            Err(err) => assert!(refused(&err), "{err}"),
        }
    }

    #[test]
    fn clock_ticks_are_positive() {
        assert!(clock_ticks_per_second().unwrap() > 0);
    }

    #[test]
    fn monotonic_clock_moves_forward() {
        let first = monotonic_clock();
        let second = monotonic_clock();
        assert!(first > Duration::ZERO);
        assert!(second >= first);
    }
}
