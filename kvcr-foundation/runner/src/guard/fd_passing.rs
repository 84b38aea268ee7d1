//! Compat shim: removed once the split lands. The guard's system calls
//! (`SCM_RIGHTS`, peer credentials, pidfds) live in
//! [`kvcr_sys::fd_passing`]; this module keeps the paths the guard uses.

#[cfg(test)]
pub(super) use kvcr_sys::fd_passing::{MAX_FDS, pidfd_open};
pub(super) use kvcr_sys::fd_passing::{
    PeerProcess, effective_uid, has_exited, peer_process, recv_with_fds, send_with_fds, watch_exit,
};
