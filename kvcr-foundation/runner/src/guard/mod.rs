//! The runner's side of the guard: the lease client and the wire.
//!
//! A guard (the `kvcr-guard` crate and binary) is a process that owns each
//! rank's pool memory and control listener, so they outlive the engine that
//! uses them. A rank's runner claims its *group* from the guard over a Unix
//! socket ([`claim`]) and gets the group's memory as descriptors: a journal
//! memfd, one memfd per pool (made like a runner's own shared pools, so
//! same-host peers accept them) and the bound TCP control listener. When the
//! engine dies, the guard still holds all of it: the pages stay in memory,
//! the listener keeps its port (connections queue in its backlog), and the
//! restarted engine claims the group back and finds its pages warm.
//!
//! ```text
//!  runner ── claim(socket, GuardClaim) ─────────► guard (kvcr_guard::GuardService)
//!         ◄── GuardGrant: [journal, pool 0..n-1, listener] (one SCM_RIGHTS) ──
//!         ── ... the lease lasts while the claimant process lives ...
//!         ── GuardLease::release ──► Released (the memory stays with the guard)
//! ```
//!
//! # The lease
//! * The first claim of a group fixes its layout, compatibility digest and
//!   control address; a later claim must match them exactly, or it is
//!   refused naming the field ([`Refusal::Mismatch`]).
//! * A grant is a lease fenced by the claimant's *process* (a pidfd taken
//!   when it connected), not by its socket: closing the connection does not
//!   end it, and a claim of a group whose holder lives is refused
//!   ([`Refusal::Held`]). The holder's exit ends it: the guard records that
//!   incarnation as dead, and the next grant says so (`warm`,
//!   `previous_incarnation`, `dead_incarnations`). [`GuardLease::release`]
//!   ends it without a death.
//! * The guard never reads or writes the pools.
//!
//! Here: the client ([`claim`], [`GuardLease`]), the checks every grant
//! passes before the runner touches it, the wire ([`protocol`]), the error
//! both sides report ([`GuardError`]), and the one entry the guard needs
//! into the runner's start-up: a backup runner over an orphaned group
//! ([`OrphanedGroup`], [`Runner::start_backup`](crate::Runner::start_backup)).
//! The guard's service, its limits and its binary are the `kvcr-guard`
//! crate's. The client's system calls are [`kvcr_sys::fd_passing`]'s.

mod backup;
pub mod protocol;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use self::backup::OrphanedGroup;
use self::protocol::{ClaimMsg, GrantedMsg, Reply, Request, VERSION};
pub use self::protocol::{Layout, PoolSpec, Refusal};
use crate::net::StaticKey;

/// How long [`GuardLease::release`] waits for the guard's answer.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Everything the guard and its clients can fail at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GuardError {
    /// The guard refused the request.
    #[error("guard refused: {0}")]
    Refused(Refusal),
    /// The guard's grant does not match the claim (group, layout, a
    /// descriptor's kind or size, the listener's address, ...); every
    /// descriptor received was closed.
    #[error("guard grant does not match the claim: {why}")]
    BadGrant {
        /// What differs.
        why: String,
    },
    /// The other side broke the protocol: a frame over the limit, a payload
    /// that is not a message, an unexpected message, descriptors lost, or
    /// the connection closed early.
    #[error("guard protocol: {why}")]
    Protocol {
        /// What happened.
        why: String,
    },
    /// No answer within the time allowed.
    #[error("the guard did not answer within {timeout:?}")]
    Timeout {
        /// The time allowed.
        timeout: Duration,
    },
    /// A system call failed.
    #[error("guard: {call} failed: {}", io::Error::from_raw_os_error(*errno))]
    Os {
        /// The call.
        call: &'static str,
        /// Its `errno` (0 when there was none).
        errno: i32,
    },
    /// The claim cannot be sent as it is (incarnation 0, over the frame
    /// limit).
    #[error("guard claim invalid: {why}")]
    InvalidClaim {
        /// Why.
        why: &'static str,
    },
    /// The directory that holds the guard's socket is not this user's
    /// alone: owned by another user, or writable by group or others (sticky
    /// or not), so another user could have bound the path first.
    #[error("guard socket directory {}: {why}", path.display())]
    SharedDirectory {
        /// The directory (resolved).
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The process serving the socket runs as another user (`SO_PEERCRED`):
    /// not this process's uid, not root. Nothing was sent to it.
    #[error("guard socket {} is served by pid {pid} of uid {uid}, not this user or root",
        path.display())]
    UntrustedGuard {
        /// The socket path.
        path: PathBuf,
        /// The serving process.
        pid: u32,
        /// Its effective uid.
        uid: u32,
    },
    /// A descriptor of a grant belongs to another user (`fstat`'s
    /// `st_uid`: not this process's uid, not root), so someone else could
    /// read or write that memory; every descriptor received was closed.
    #[error("guard grant: the {what} belongs to uid {owner}, not to this user or root")]
    ForeignDescriptor {
        /// Which descriptor.
        what: String,
        /// Its owner.
        owner: u32,
    },
    /// A guard already answers at the socket path.
    #[error("a guard already serves {}", path.display())]
    AlreadyRunning {
        /// The socket path.
        path: PathBuf,
    },
    /// The socket path cannot be served (it is not a socket, or binding it
    /// failed).
    #[error("guard socket {}: {why}{}", path.display(), errno.map(|e| format!(": {}", io::Error::from_raw_os_error(e))).unwrap_or_default())]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// What is wrong.
        why: &'static str,
        /// The OS error, when a call failed.
        errno: Option<i32>,
    },
}

impl GuardError {
    /// The guard's refusal, when it refused.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            Self::Refused(refusal) => Some(refusal),
            _ => None,
        }
    }

    fn os(call: &'static str) -> impl Fn(io::Error) -> Self {
        move |e| Self::Os {
            call,
            errno: e.raw_os_error().unwrap_or(0),
        }
    }

    fn protocol(why: impl Into<String>) -> Self {
        Self::Protocol { why: why.into() }
    }

    fn bad_grant(why: impl Into<String>) -> Self {
        Self::BadGrant { why: why.into() }
    }
}

/// What a runner asks the guard for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardClaim {
    /// The group (one per rank).
    pub group: u32,
    /// The engine's compatibility digest; must equal the group's.
    pub compat_digest: u64,
    /// The pools and the journal; must equal the group's.
    pub layout: Layout,
    /// `ip:port` the guard binds the control listener at (port 0 on the
    /// group's first claim asks the OS for one; a later claim may repeat
    /// the first claim's string or name the bound address).
    pub control: String,
    /// This runner's incarnation (not 0).
    pub incarnation: u128,
}

/// What the guard hands over.
#[derive(Debug)]
pub struct GuardGrant {
    /// The journal's memfd (`layout.journal_bytes`, zeroed on a fresh grant).
    pub journal: File,
    /// Each pool's memfd and its name token, in layout order: a sealed,
    /// fully allocated memfd named `kvcr-pool-<token>` of the pool's size.
    pub pools: Vec<(File, [u8; 16])>,
    /// The control listener, bound and listening. Its open file
    /// description is shared with the guard's copy, so its `O_NONBLOCK`
    /// flag is shared too: blocking on a group's first grant, then as the
    /// last holder left it (set it as needed). Connections made while no
    /// holder lived wait in its backlog.
    pub listener: TcpListener,
    /// The address the listener is bound at.
    pub control: SocketAddr,
    /// False on the group's first grant (the memory is fresh), true when a
    /// previous holder had it.
    pub warm: bool,
    /// The incarnation that held the group last (released or dead).
    pub previous_incarnation: Option<u128>,
    /// The group's incarnations that died holding it, oldest first
    /// (bounded: the latest the guard is configured to keep, 64 by default).
    pub dead_incarnations: Vec<u128>,
    /// The group's member key, kept by the guard: the runner proves it, so
    /// its endpoint names the same key across restarts.
    pub member_key: StaticKey,
}

/// A granted claim: the connection to the guard.
///
/// Dropping it closes the connection but does not end the lease; the
/// process's exit does, or [`release`](Self::release).
#[derive(Debug)]
pub struct GuardLease {
    stream: UnixStream,
    group: u32,
}

impl GuardLease {
    /// The group held.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// Ends the lease (a clean shutdown): the guard keeps the memory for
    /// the group's next claim. Nothing of this process may touch the
    /// group's memory or listener afterwards: the next claimant gets them.
    pub fn release(self) -> Result<(), GuardError> {
        let frame = protocol::encode(&Request::Release { version: VERSION }).ok_or(
            GuardError::InvalidClaim {
                why: "release over the frame limit",
            },
        )?;
        let mut io = FrameIo::new(&self.stream, RELEASE_TIMEOUT);
        io.send(&frame)?;
        let (reply, _fds) = io.receive()?;
        match reply {
            Reply::Released => Ok(()),
            Reply::Refused { refusal } => Err(GuardError::Refused(refusal)),
            Reply::Granted(_) => Err(GuardError::protocol("a grant answered a release")),
        }
    }
}

/// The lease's connection to the guard (the guard's own tests speak the wire
/// on it); writing to it is the holder's business, as a release is.
impl AsFd for GuardLease {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// Claims `claim.group` from the guard at `socket`, waiting at most
/// `timeout` in all for the grant.
///
/// Before anything is sent: the socket's directory must pass the directory
/// rule ([`check_socket_directory`]) and the process serving it must run as
/// this user or root (`SO_PEERCRED`: [`GuardError::UntrustedGuard`]). Every
/// descriptor handed over must be owned by this user or root
/// ([`GuardError::ForeignDescriptor`]).
///
/// The grant is checked against the claim before it is returned: its group
/// and layout, one descriptor per pool plus the journal and the listener,
/// each memfd a regular file of its size, each token 32 hex digits, the
/// listener bound at the granted address (which has the claim's IP, and
/// its port unless that was 0). A grant that fails a check is
/// [`GuardError::BadGrant`], and every descriptor received is closed.
pub fn claim(
    socket: &Path,
    claim: &GuardClaim,
    timeout: Duration,
) -> Result<(GuardLease, GuardGrant), GuardError> {
    if claim.incarnation == 0 {
        return Err(GuardError::InvalidClaim {
            why: "incarnation 0",
        });
    }
    let frame = protocol::encode(&Request::Claim(ClaimMsg {
        version: VERSION,
        group: claim.group,
        compat_digest: claim.compat_digest,
        layout: claim.layout.clone(),
        control: claim.control.clone(),
        incarnation: protocol::hex128(claim.incarnation),
    }))
    .ok_or(GuardError::InvalidClaim {
        why: "claim over the frame limit",
    })?;
    check_socket_directory(socket)?;
    let stream = UnixStream::connect(socket).map_err(GuardError::os("connect"))?;
    check_server(socket, &stream)?;
    let mut io = FrameIo::new(&stream, timeout);
    io.send(&frame)?;
    let (reply, fds) = io.receive()?;
    let grant = match reply {
        Reply::Granted(granted) => check_grant(claim, granted, fds)?,
        Reply::Refused { refusal } => return Err(GuardError::Refused(refusal)),
        Reply::Released => return Err(GuardError::protocol("a release answered a claim")),
    };
    Ok((
        GuardLease {
            stream,
            group: claim.group,
        },
        grant,
    ))
}

/// Refuses a guard socket whose directory another user owns or may write
/// (the directory rule of `local_users`: group or other write permission
/// refuses it, sticky or not). The guard checks where it binds, and a
/// client where it connects.
pub fn check_socket_directory(socket: &Path) -> Result<(), GuardError> {
    let socket_error = |why, e: io::Error| GuardError::Socket {
        path: socket.to_path_buf(),
        why,
        errno: e.raw_os_error(),
    };
    let parent = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = std::fs::canonicalize(parent)
        .map_err(|e| socket_error("its directory does not resolve", e))?;
    let meta =
        std::fs::metadata(&dir).map_err(|e| socket_error("its directory cannot be examined", e))?;
    match crate::local_users::refusal_of(&meta) {
        Some(why) => Err(GuardError::SharedDirectory { path: dir, why }),
        None => Ok(()),
    }
}

/// Refuses a guard served by another user: whoever bound the path first
/// would get the claim and hand over memory it can read and write.
fn check_server(socket: &Path, stream: &UnixStream) -> Result<(), GuardError> {
    let (pid, uid) = kvcr_sys::fd_passing::peer_credentials(stream.as_fd())
        .map_err(GuardError::os("getsockopt(SO_PEERCRED)"))?;
    if crate::local_users::trusted_uid(uid) {
        Ok(())
    } else {
        Err(GuardError::UntrustedGuard {
            path: socket.to_path_buf(),
            pid,
            uid,
        })
    }
}

/// Refuses a granted descriptor another user owns (`fstat`).
fn check_owner(what: &str, fd: OwnedFd) -> Result<OwnedFd, GuardError> {
    let file = File::from(fd);
    let owner = file
        .metadata()
        .map_err(|_| GuardError::bad_grant(format!("the {what} cannot be examined")))?
        .uid();
    if crate::local_users::trusted_uid(owner) {
        Ok(OwnedFd::from(file))
    } else {
        Err(GuardError::ForeignDescriptor {
            what: what.to_owned(),
            owner,
        })
    }
}

/// Blocking frame I/O under one deadline.
struct FrameIo<'a> {
    stream: &'a UnixStream,
    timeout: Duration,
    deadline: Instant,
}

impl<'a> FrameIo<'a> {
    fn new(stream: &'a UnixStream, timeout: Duration) -> Self {
        // The one clock read of the client: its deadline.
        #[allow(clippy::disallowed_methods)]
        let now = Instant::now();
        Self {
            stream,
            timeout,
            deadline: now + timeout,
        }
    }

    /// Time left, or [`GuardError::Timeout`].
    fn remaining(&self) -> Result<Duration, GuardError> {
        #[allow(clippy::disallowed_methods)]
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(GuardError::Timeout {
                timeout: self.timeout,
            });
        }
        Ok(left)
    }

    fn io_error(&self, call: &'static str) -> impl Fn(io::Error) -> GuardError + '_ {
        move |e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => GuardError::Timeout {
                timeout: self.timeout,
            },
            _ => GuardError::os(call)(e),
        }
    }

    fn send(&mut self, frame: &[u8]) -> Result<(), GuardError> {
        let mut rest = frame;
        while !rest.is_empty() {
            self.stream
                .set_write_timeout(Some(self.remaining()?))
                .map_err(GuardError::os("setsockopt(SO_SNDTIMEO)"))?;
            match kvcr_sys::fd_passing::send_with_fds(self.stream.as_fd(), rest, &[]) {
                Ok(0) => return Err(GuardError::protocol("the guard closed the connection")),
                Ok(n) => rest = rest.get(n..).unwrap_or_default(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error("sendmsg")(e)),
            }
        }
        Ok(())
    }

    /// Fills `buf`, collecting any descriptors that come along.
    fn fill(&mut self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<(), GuardError> {
        let mut done = 0;
        while let Some(rest) = buf.get_mut(done..).filter(|r| !r.is_empty()) {
            self.stream
                .set_read_timeout(Some(self.remaining()?))
                .map_err(GuardError::os("setsockopt(SO_RCVTIMEO)"))?;
            match kvcr_sys::fd_passing::recv_with_fds(self.stream.as_fd(), rest) {
                Ok(got) => {
                    fds.extend(got.fds);
                    if got.truncated {
                        return Err(GuardError::protocol(
                            "more descriptors than a grant carries (some were lost)",
                        ));
                    }
                    if got.bytes == 0 {
                        return Err(GuardError::protocol("the guard closed the connection"));
                    }
                    done += got.bytes;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error("recvmsg")(e)),
            }
        }
        Ok(())
    }

    /// One reply and the descriptors that came with it.
    fn receive(&mut self) -> Result<(Reply, Vec<OwnedFd>), GuardError> {
        let mut fds = Vec::new();
        let mut header = [0u8; 4];
        self.fill(&mut header, &mut fds)?;
        let len = protocol::payload_len(header).ok_or_else(|| {
            GuardError::protocol(format!(
                "a frame of {} bytes (at most {})",
                u32::from_le_bytes(header),
                protocol::MAX_FRAME
            ))
        })?;
        let mut payload = vec![0u8; len];
        self.fill(&mut payload, &mut fds)?;
        let reply = serde_json::from_slice(&payload)
            .map_err(|e| GuardError::protocol(format!("not a reply: {e}")))?;
        Ok((reply, fds))
    }
}

/// Checks a grant against its claim and takes its descriptors.
fn check_grant(
    claim: &GuardClaim,
    granted: GrantedMsg,
    fds: Vec<OwnedFd>,
) -> Result<GuardGrant, GuardError> {
    let pools = claim.layout.pools.len();
    if granted.version != VERSION {
        return Err(GuardError::bad_grant(format!(
            "version {}",
            granted.version
        )));
    }
    if granted.group != claim.group {
        return Err(GuardError::bad_grant(format!(
            "group {} for a claim of group {}",
            granted.group, claim.group
        )));
    }
    if granted.layout != claim.layout {
        return Err(GuardError::bad_grant("another layout"));
    }
    if fds.len() != pools + 2 {
        return Err(GuardError::bad_grant(format!(
            "{} descriptors for {pools} pools (expected {})",
            fds.len(),
            pools + 2
        )));
    }
    if granted.pool_tokens.len() != pools {
        return Err(GuardError::bad_grant(format!(
            "{} pool tokens for {pools} pools",
            granted.pool_tokens.len()
        )));
    }
    let tokens = granted
        .pool_tokens
        .iter()
        .map(|t| protocol::parse_token(t))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| GuardError::bad_grant("a pool token is not 32 hex digits"))?;
    let control: SocketAddr = granted
        .control
        .parse()
        .map_err(|_| GuardError::bad_grant("the control address is not ip:port"))?;
    let asked: Option<SocketAddr> = claim.control.parse().ok();
    if asked
        .is_some_and(|a| a.ip() != control.ip() || (a.port() != 0 && a.port() != control.port()))
    {
        return Err(GuardError::bad_grant(format!(
            "control {control} for a claim of {}",
            claim.control
        )));
    }
    let incarnation = |text: &String| {
        protocol::parse_hex128(text)
            .ok_or_else(|| GuardError::bad_grant("an incarnation is not 32 hex digits"))
    };
    let previous_incarnation = granted
        .previous_incarnation
        .as_ref()
        .map(incarnation)
        .transpose()?;
    let dead_incarnations = granted
        .dead_incarnations
        .iter()
        .map(incarnation)
        .collect::<Result<Vec<_>, _>>()?;
    let member_key = protocol::parse_member_key(&granted.member_key)
        .ok_or_else(|| GuardError::bad_grant("the member key is not 64 hex digits"))?;
    if !granted.warm && previous_incarnation.is_some() {
        return Err(GuardError::bad_grant(
            "a fresh grant names a previous incarnation",
        ));
    }

    let mut fds = fds.into_iter();
    let mut next_file = |what: &str, len: u64| {
        let file = File::from(check_owner(
            what,
            fds.next()
                .ok_or_else(|| GuardError::bad_grant("descriptors ran out"))?,
        )?);
        let ok = file.metadata().is_ok_and(|m| m.is_file() && m.len() == len);
        if ok {
            Ok(file)
        } else {
            Err(GuardError::bad_grant(format!(
                "the {what} is not a file of {len} bytes"
            )))
        }
    };
    let journal = next_file("journal", claim.layout.journal_bytes)?;
    let mut files = Vec::with_capacity(pools);
    for ((i, spec), token) in claim.layout.pools.iter().enumerate().zip(tokens) {
        let len = spec
            .bytes()
            .ok_or_else(|| GuardError::bad_grant(format!("pool {i}'s size overflows")))?;
        files.push((next_file(&format!("pool {i}"), len)?, token));
    }
    let listener = TcpListener::from(check_owner(
        "listener",
        fds.next()
            .ok_or_else(|| GuardError::bad_grant("descriptors ran out"))?,
    )?);
    match listener.local_addr() {
        Ok(bound) if bound == control => {}
        Ok(bound) => {
            return Err(GuardError::bad_grant(format!(
                "the listener is bound at {bound}, not {control}"
            )));
        }
        Err(_) => {
            return Err(GuardError::bad_grant(
                "the last descriptor is not a TCP socket",
            ));
        }
    }
    Ok(GuardGrant {
        journal,
        pools: files,
        listener,
        control,
        warm: granted.warm,
        previous_incarnation,
        dead_incarnations,
        member_key,
    })
}
