//! The guard's system calls, on both sides of its socket (unsafe, named).
//!
//! * [`send_with_fds`] / [`recv_with_fds`]: `sendmsg` / `recvmsg` with
//!   descriptors in one `SCM_RIGHTS` control message. Sends never raise
//!   `SIGPIPE` (`MSG_NOSIGNAL`); received descriptors are close-on-exec
//!   from the moment they exist (`MSG_CMSG_CLOEXEC`) and owned at once.
//! * [`peer_process`]: who is at the other end of an accepted connection,
//!   as a pid, a uid and a pidfd. The pidfd comes from `SO_PEERPIDFD`
//!   (Linux 6.5+), which names the very process that connected; before
//!   6.5 from `SO_PEERCRED`'s pid and `pidfd_open`, where a peer that died
//!   and whose pid was reused in between would be mistaken for the new
//!   process (its lease would then end only when that process exits).
//! * [`peer_credentials`]: the pid and uid alone (`SO_PEERCRED`), for a
//!   client that checks who serves the socket it connected to.
//! * [`has_exited`]: a pidfd polled without waiting; [`watch_exit`]: a
//!   pidfd registered with the tokio reactor (epoll), readable on exit.
//!
//! Nothing here keeps a raw descriptor: every one is wrapped in an
//! [`OwnedFd`] the moment the kernel hands it over.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Most descriptors one message carries, either way.
pub const MAX_FDS: usize = 32;

/// `SO_PEERPIDFD` where its value is the generic one.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const SO_PEERPIDFD: Option<libc::c_int> = Some(77);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const SO_PEERPIDFD: Option<libc::c_int> = None;

/// Control-message space for `fds` descriptors, in bytes.
fn control_space(fds: usize) -> usize {
    let data = (fds * size_of::<libc::c_int>()) as libc::c_uint;
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    unsafe { libc::CMSG_SPACE(data) as usize }
}

/// Sends `bytes` (as many as the socket takes; the count is returned) with
/// `fds` attached to the first byte, in one `sendmsg`. Never raises
/// `SIGPIPE`; on a non-blocking socket a full buffer is `WouldBlock` and
/// nothing was sent.
pub fn send_with_fds(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors for one message",
        ));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let data_len = size_of_val(raw.as_slice());
    let space = control_space(raw.len());
    // u64 words: the buffer is aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty one (null pointers,
    // zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg_control` points at `space` zeroed bytes, aligned for
        // `cmsghdr`, which is room for one header and `data_len` bytes
        // (CMSG_SPACE of it); CMSG_FIRSTHDR returns its start (checked for
        // null), and the copy writes `data_len` bytes at CMSG_DATA, inside
        // that room, from `raw`, which holds exactly `data_len` bytes.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            if cmsg.is_null() {
                return Err(io::Error::other("no room for the control message"));
            }
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(data_len as libc::c_uint) as _;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                data_len,
            );
        }
    }
    // SAFETY: `msg` points at `iov` (which points at `bytes`) and, when
    // set, at `control`, all alive for the call; sendmsg only reads them.
    // The descriptors are borrowed for the call; the kernel takes its own
    // references.
    let sent = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    usize::try_from(sent).map_err(|_| io::Error::last_os_error())
}

/// What one [`recv_with_fds`] got.
#[derive(Debug)]
pub struct Received {
    /// Bytes written into the buffer (0: the peer closed).
    pub bytes: usize,
    /// The descriptors that came with them, owned, close-on-exec.
    pub fds: Vec<OwnedFd>,
    /// The kernel had more control data than room (`MSG_CTRUNC`): some
    /// descriptors were closed on the way in.
    pub truncated: bool,
}

/// Receives into `buf` with room for [`MAX_FDS`] descriptors.
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    let space = control_space(MAX_FDS);
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = (control.len() * 8) as _;
    // SAFETY: `msg` points at `iov` (which points at `buf`, writable for
    // its length) and at `control` (writable for `msg_controllen` bytes,
    // aligned for `cmsghdr`), all alive for the call.
    let got = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    let bytes = usize::try_from(got).map_err(|_| io::Error::last_os_error())?;
    let mut fds = Vec::new();
    // SAFETY: the kernel wrote `msg_controllen` bytes of control messages
    // into `control`; CMSG_FIRSTHDR / CMSG_NXTHDR walk them and return
    // null past the last one.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: `cmsg` is a header inside `control` (above).
        let (level, kind, len) = unsafe {
            (
                (*cmsg).cmsg_level,
                (*cmsg).cmsg_type,
                (*cmsg).cmsg_len as usize,
            )
        };
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: arithmetic on a constant.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = len.saturating_sub(header) / size_of::<libc::c_int>();
            // SAFETY: `cmsg` is a header inside `control`.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<libc::c_int>();
            for i in 0..count {
                // SAFETY: `i < count`, so the read stays inside this
                // message's data, which the kernel wrote (`cmsg_len` covers
                // it); it may be unaligned for `c_int`, hence
                // `read_unaligned`.
                let fd = unsafe { data.add(i).read_unaligned() };
                // SAFETY: the kernel installed `fd` in this process for
                // this call alone; nothing else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        // SAFETY: `cmsg` is a header inside the control data of `msg`.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok(Received {
        bytes,
        fds,
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

/// The process at the other end of a connected Unix socket.
#[derive(Debug)]
pub struct PeerProcess {
    /// Its pid, in this process's pid namespace.
    pub pid: u32,
    /// Its effective uid when it connected.
    pub uid: u32,
    /// A pidfd naming it: readable once it has exited.
    pub pidfd: OwnedFd,
}

/// The pid and effective uid of the process at the other end of a connected
/// Unix socket, as `SO_PEERCRED` recorded them when the socket was
/// connected (or, for a listener's peer, when it called `listen`).
pub fn peer_credentials(sock: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is writable for `len` bytes, which is its size;
    // getsockopt writes at most `len` bytes and updates `len`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let pid = u32::try_from(cred.pid)
        .ok()
        .filter(|pid| *pid > 0 && len as usize == size_of::<libc::ucred>())
        .ok_or_else(|| io::Error::other("the peer's pid is not visible here"))?;
    Ok((pid, cred.uid))
}

/// Who connected: `SO_PEERCRED` for the pid and uid, and a pidfd from
/// `SO_PEERPIDFD`, or from `pidfd_open` where the kernel lacks it.
pub fn peer_process(sock: BorrowedFd<'_>) -> io::Result<PeerProcess> {
    let (pid, uid) = peer_credentials(sock)?;
    let pidfd = match peer_pidfd(sock)? {
        Some(pidfd) => pidfd,
        None => pidfd_open(pid)?,
    };
    Ok(PeerProcess { pid, uid, pidfd })
}

/// `SO_PEERPIDFD`, `None` where the kernel does not know it.
fn peer_pidfd(sock: BorrowedFd<'_>) -> io::Result<Option<OwnedFd>> {
    let Some(option) = SO_PEERPIDFD else {
        return Ok(None);
    };
    let mut fd: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is writable for `len` bytes, its size.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&raw mut fd).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        let error = io::Error::last_os_error();
        return match error.raw_os_error() {
            Some(libc::ENOPROTOOPT | libc::EINVAL) => Ok(None),
            _ => Err(error),
        };
    }
    if fd < 0 {
        return Err(io::Error::other("SO_PEERPIDFD gave no descriptor"));
    }
    // SAFETY: the kernel installed `fd` (close-on-exec) for this call
    // alone; nothing else owns it.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// A pidfd for `pid` (`pidfd_open`, Linux 5.3+; close-on-exec).
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags by value; no memory is
    // passed.
    let rc = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0 as libc::c_uint) };
    let fd = RawFd::try_from(rc)
        .ok()
        .filter(|fd| *fd >= 0)
        .ok_or_else(io::Error::last_os_error)?;
    // SAFETY: the kernel just installed `fd` for us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process a pidfd names has exited (polled, no wait).
pub fn has_exited(pidfd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut poll = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd, alive for the call; timeout 0.
        let rc = unsafe { libc::poll(&mut poll, 1, 0) };
        if rc >= 0 {
            return Ok(rc > 0 && poll.revents & (libc::POLLIN | libc::POLLHUP) != 0);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// `pidfd` registered with the current tokio runtime's reactor for
/// readability: it turns readable when the process exits.
pub fn watch_exit(pidfd: Arc<OwnedFd>) -> io::Result<AsyncFd<Arc<OwnedFd>>> {
    // SAFETY: an `OwnedFd` is open until it is dropped and is always the
    // same descriptor; the `Arc` the `AsyncFd` owns keeps it alive, and
    // unchanged, for the `AsyncFd`'s whole life.
    unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }.map_err(io::Error::from)
}

/// This process's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() }
}
