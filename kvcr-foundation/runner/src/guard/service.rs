//! The guard's service: its socket, its loop and its groups.
//!
//! One thread runs a current-thread tokio runtime:
//! * the accept loop admits a connection when fewer than
//!   `max_pending` are waiting for their grant (else it is closed at once),
//!   from a process of the guard's uid or root, taking the peer's pidfd
//!   when it connected;
//! * a connection task reads one claim (within `claim_timeout`), decides it
//!   against the [`Registry`] and sends the grant with its descriptors; it
//!   then becomes the lease's task, waiting for whichever comes first: a
//!   `Release` on the connection, or the claimant's pidfd turning readable
//!   (its exit, seen through epoll, no polling). The lease outlives the
//!   connection: an EOF only stops the reading.
//!
//! Every decision is made under one mutex, in [`Registry`], without I/O
//! but the making of a group's memory and listener (on a group's first
//! claim: `fallocate` of its whole size, so the guard answers nothing else
//! until that is done; a claimant that gave up meanwhile finds the group
//! made when it comes back); a claim that finds the
//! group leased checks the holder's pidfd itself, so a holder that has
//! exited but whose exit the lease task has not seen yet does not block it.
//!
//! A group goes `Fresh` (made, never handed out) → `Leased` →
//! `Released` (clean) or `Orphaned` (its holder died) → `Leased` → ...
//! An `Orphaned` group is served by a backup runner when the guard is
//! configured to ([`GuardConfig::serve`]): started when the lease task sees
//! the holder's exit, stopped (dropped, on the service thread) before the
//! next claim of the group is granted.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use super::fd_passing::{self, PeerProcess};
use super::protocol::{self, ClaimMsg, GrantedMsg, Layout, Refusal, Reply, Request, VERSION};
use super::{BackupServing, GuardConfig, GuardError, GuardLog};

/// Starts guards.
#[derive(Debug)]
pub struct GuardService;

impl GuardService {
    /// Serves `socket` with the default [`GuardConfig`].
    pub fn start(socket: &Path) -> Result<GuardHandle, GuardError> {
        Self::start_with(socket, GuardConfig::default())
    }

    /// Serves `socket`: refuses when a guard answers there, removes a stale
    /// socket file (never a file that is not a socket), binds it with mode
    /// 0600 and runs the service on a thread of its own until the handle
    /// is dropped.
    pub fn start_with(socket: &Path, config: GuardConfig) -> Result<GuardHandle, GuardError> {
        let listener = bind(socket)?;
        let inode = std::fs::symlink_metadata(socket)
            .map(|m| (m.dev(), m.ino()))
            .ok();
        let unlink = Unlink {
            path: socket.to_path_buf(),
            inode,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(GuardError::os("tokio runtime"))?;
        listener
            .set_nonblocking(true)
            .map_err(GuardError::os("fcntl(O_NONBLOCK)"))?;
        let listener = {
            let _entered = runtime.enter();
            UnixListener::from_std(listener).map_err(GuardError::os("epoll_ctl"))?
        };
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("kvcr-guard".into())
            .spawn(move || runtime.block_on(run(listener, config, stopped)))
            .map_err(GuardError::os("thread spawn"))?;
        Ok(GuardHandle {
            stop: Some(stop),
            thread: Some(thread),
            unlink,
        })
    }
}

/// A running guard. Dropping it stops the service: its thread is joined,
/// every group's memory and listener is closed, and the socket file is
/// removed (if it is still the one the guard bound).
#[derive(Debug)]
pub struct GuardHandle {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), GuardError>>>,
    unlink: Unlink,
}

impl GuardHandle {
    /// The socket served.
    pub fn socket_path(&self) -> &Path {
        &self.unlink.path
    }

    /// Runs until the service fails (it does not stop by itself otherwise):
    /// what a guard process's main thread does.
    pub fn wait(mut self) -> Result<(), GuardError> {
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(GuardError::protocol("the guard's thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for GuardHandle {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Removes the socket file on drop if it is still the one bound.
#[derive(Debug)]
struct Unlink {
    path: PathBuf,
    inode: Option<(u64, u64)>,
}

impl Drop for Unlink {
    fn drop(&mut self) {
        let now = std::fs::symlink_metadata(&self.path)
            .map(|m| (m.dev(), m.ino()))
            .ok();
        if now.is_some() && now == self.inode {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the socket: refused when something answers there; a stale socket
/// file is removed first; mode 0600.
fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, GuardError> {
    let socket_error = |why, e: io::Error| GuardError::Socket {
        path: path.to_path_buf(),
        why,
        errno: e.raw_os_error(),
    };
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => {
            return Err(GuardError::AlreadyRunning {
                path: path.to_path_buf(),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            let meta = std::fs::symlink_metadata(path)
                .map_err(|e| socket_error("cannot be inspected", e))?;
            if !meta.file_type().is_socket() {
                return Err(GuardError::Socket {
                    path: path.to_path_buf(),
                    why: "exists and is not a socket",
                    errno: None,
                });
            }
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(socket_error("is stale and cannot be removed", e));
                }
                _ => {}
            }
        }
        Err(e) => return Err(socket_error("cannot be probed", e)),
    }
    let listener = std::os::unix::net::UnixListener::bind(path)
        .map_err(|e| socket_error("cannot be bound", e))?;
    // Until this, the file has the umask's mode; peers of another uid are
    // refused at accept anyway.
    if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        let _ = std::fs::remove_file(path);
        return Err(socket_error("cannot be made private", e));
    }
    Ok(listener)
}

/// The shared state of one guard.
struct Shared {
    registry: Mutex<Registry>,
    config: GuardConfig,
}

impl Shared {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn log(&self, text: String) {
        self.config.log.line(text);
    }
}

/// The service: the accept loop until `stop` resolves (sent or dropped).
async fn run(
    listener: UnixListener,
    config: GuardConfig,
    mut stop: oneshot::Receiver<()>,
) -> Result<(), GuardError> {
    let shared = Arc::new(Shared {
        registry: Mutex::new(Registry::new(&config)),
        config,
    });
    let pending = Arc::new(Semaphore::new(shared.config.max_pending));
    let uid = fd_passing::effective_uid();
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => return Ok(()),
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => match e.raw_os_error() {
                // Out of descriptors or memory: the connection stays queued;
                // try again a little later rather than spin.
                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                    shared.log(format!("accept: {e}; retrying in 100 ms"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Some(libc::ECONNABORTED | libc::EINTR | libc::EPROTO) => continue,
                _ => return Err(GuardError::os("accept")(e)),
            },
        };
        // Over the limit: closed at once (dropped).
        let Ok(permit) = Arc::clone(&pending).try_acquire_owned() else {
            continue;
        };
        let peer = match fd_passing::peer_process(stream.as_fd()) {
            Ok(peer) => peer,
            Err(e) => {
                shared.log(format!("a connection's peer is unknown ({e}); closed"));
                continue;
            }
        };
        if peer.uid != uid && peer.uid != 0 {
            shared.log(format!(
                "pid {} of uid {} is not served (uid {uid} only); closed",
                peer.pid, peer.uid
            ));
            continue;
        }
        tokio::spawn(serve(Arc::clone(&shared), stream, peer, permit));
    }
}

/// Why a frame could not be read.
enum ReadError {
    /// The connection failed or closed.
    Io,
    /// The header announced a frame over the limit.
    TooLong(u32),
}

async fn read_frame(stream: &mut UnixStream) -> Result<Vec<u8>, ReadError> {
    let mut header = [0u8; 4];
    stream
        .read_exact(&mut header)
        .await
        .map_err(|_| ReadError::Io)?;
    let len =
        protocol::payload_len(header).ok_or(ReadError::TooLong(u32::from_le_bytes(header)))?;
    let mut payload = vec![0u8; len];
    stream
        .read_exact(&mut payload)
        .await
        .map_err(|_| ReadError::Io)?;
    Ok(payload)
}

/// A frame not written in full; whether its descriptors went out.
struct WriteFailed {
    fds_sent: bool,
}

/// Writes a whole frame, `fds` attached to its first byte.
async fn write_frame(
    stream: &UnixStream,
    frame: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), WriteFailed> {
    let mut sent = 0;
    while let Some(rest) = frame.get(sent..).filter(|r| !r.is_empty()) {
        let attach = if sent == 0 { fds } else { &[] };
        let result = stream
            .async_io(Interest::WRITABLE, || {
                fd_passing::send_with_fds(stream.as_fd(), rest, attach)
            })
            .await;
        match result {
            Ok(n) if n > 0 => sent += n,
            _ => return Err(WriteFailed { fds_sent: sent > 0 }),
        }
    }
    Ok(())
}

/// Sends a refusal (best effort); the caller then closes the connection.
async fn refuse(stream: &UnixStream, refusal: Refusal) {
    if let Some(frame) = protocol::encode(&Reply::Refused { refusal }) {
        let _ = write_frame(stream, &frame, &[]).await;
    }
}

/// One connection: its claim, then its lease.
async fn serve(
    shared: Arc<Shared>,
    mut stream: UnixStream,
    peer: PeerProcess,
    permit: OwnedSemaphorePermit,
) {
    let first = tokio::time::timeout(shared.config.claim_timeout, read_frame(&mut stream)).await;
    let payload = match first {
        Ok(Ok(payload)) => payload,
        Ok(Err(ReadError::TooLong(len))) => {
            let why = format!("a frame of {len} bytes (at most {})", protocol::MAX_FRAME);
            return refuse(&stream, Refusal::Invalid { why }).await;
        }
        // Closed, failed, or silent for too long.
        Ok(Err(ReadError::Io)) | Err(_) => return,
    };
    let claim = match protocol::decode_request(&payload) {
        Ok(Request::Claim(claim)) => claim,
        Ok(Request::Release { .. }) => {
            let why = "no lease on this connection to release".to_owned();
            return refuse(&stream, Refusal::Invalid { why }).await;
        }
        Err(refusal) => return refuse(&stream, refusal).await,
    };
    let pidfd = Arc::new(peer.pidfd);
    // Registered before the grant: a lease whose holder cannot be watched
    // is never handed out.
    let exit = match fd_passing::watch_exit(Arc::clone(&pidfd)) {
        Ok(exit) => exit,
        Err(e) => {
            let why = format!("cannot watch the claimant's pidfd: {e}");
            return refuse(&stream, Refusal::Failed { why }).await;
        }
    };
    let decided = shared
        .registry()
        .claim(&claim, peer.pid, &pidfd, &shared.config.log);
    let grant = match decided {
        Ok(grant) => grant,
        Err(refusal) => {
            shared.log(format!(
                "claim of group {} by pid {} refused: {refusal}",
                claim.group, peer.pid
            ));
            return refuse(&stream, refusal).await;
        }
    };
    let fds: Vec<BorrowedFd<'_>> = grant.fds.iter().map(AsFd::as_fd).collect();
    let sent = match protocol::encode(&Reply::Granted(grant.reply.clone())) {
        Some(frame) => write_frame(&stream, &frame, &fds).await,
        None => Err(WriteFailed { fds_sent: false }),
    };
    drop(fds);
    let stream = match sent {
        Ok(()) => Some(stream),
        // The descriptors never left: nobody got the memory.
        Err(WriteFailed { fds_sent: false }) => {
            shared
                .registry()
                .rollback(grant.group, grant.lease, grant.prior);
            shared.log(format!(
                "grant of group {} to pid {} not delivered; withdrawn",
                grant.group, peer.pid
            ));
            return;
        }
        // They did: the lease stands, fenced by the process as always.
        Err(WriteFailed { fds_sent: true }) => None,
    };
    drop(grant.fds);
    drop(permit);
    hold(shared, stream, grant.group, grant.lease, exit).await;
}

/// What a lease's task woke for.
enum LeaseEvent {
    Exited,
    Frame(Result<Vec<u8>, ReadError>),
}

/// A lease's task: until a `Release` or the holder's exit.
async fn hold(
    shared: Arc<Shared>,
    mut stream: Option<UnixStream>,
    group: u32,
    lease: u64,
    exit: AsyncFd<Arc<OwnedFd>>,
) {
    loop {
        let event = tokio::select! {
            ready = exit.readable() => match ready {
                Ok(_) => LeaseEvent::Exited,
                // Only when the runtime goes away.
                Err(_) => return,
            },
            frame = async {
                match stream.as_mut() {
                    Some(stream) => read_frame(stream).await,
                    None => std::future::pending().await,
                }
            } => LeaseEvent::Frame(frame),
        };
        let payload = match event {
            LeaseEvent::Exited => {
                shared.registry().died(group, lease, &shared.config.log);
                return;
            }
            LeaseEvent::Frame(Ok(payload)) => payload,
            LeaseEvent::Frame(Err(_)) => {
                stream = None;
                continue;
            }
        };
        let Some(connection) = stream.take() else {
            continue;
        };
        match protocol::decode_request(&payload) {
            Ok(Request::Release { .. }) => {
                let reply = if shared.registry().release(group, lease, &shared.config.log) {
                    Reply::Released
                } else {
                    Reply::Refused {
                        refusal: Refusal::Invalid {
                            why: "the lease has ended".into(),
                        },
                    }
                };
                if let Some(frame) = protocol::encode(&reply) {
                    let _ = write_frame(&connection, &frame, &[]).await;
                }
                return;
            }
            // The connection is closed after a refusal; the lease stands.
            Ok(Request::Claim(_)) => {
                let why = "this connection holds a lease already".to_owned();
                refuse(&connection, Refusal::Invalid { why }).await;
            }
            Err(refusal) => refuse(&connection, refusal).await,
        }
    }
}

/// Where a group's lease stands.
#[derive(Debug)]
enum GroupState {
    /// Made, never handed out: nobody has had the memory.
    Fresh,
    /// A live process holds it.
    Leased(Lease),
    /// Its last holder released it.
    Released {
        /// That holder's incarnation.
        incarnation: u128,
    },
    /// Its last holder died holding it.
    Orphaned {
        /// That holder's incarnation.
        dead: u128,
    },
}

#[derive(Debug)]
struct Lease {
    id: u64,
    pid: u32,
    incarnation: u128,
    pidfd: Arc<OwnedFd>,
}

/// One group: what its first claim fixed, its memory and its listener.
#[derive(Debug)]
struct Group {
    compat_digest: u64,
    layout: Layout,
    /// The first claim's control string.
    control_asked: String,
    /// Where the listener is bound.
    control: SocketAddr,
    journal: File,
    pools: Vec<(File, [u8; 16])>,
    listener: TcpListener,
    state: GroupState,
    /// Incarnations that died holding it, oldest first.
    dead: VecDeque<u128>,
    /// While orphaned: the runner serving its recovered pages to peers.
    backup: Option<crate::Runner>,
}

impl Group {
    /// Makes the memory and binds the listener of a group's first claim.
    fn create(claim: &ClaimMsg, control: SocketAddr) -> Result<Self, Refusal> {
        let failed = |what: &str, e: &dyn std::fmt::Display| Refusal::Failed {
            why: format!("{what}: {e}"),
        };
        let journal = crate::shared_memory::create_journal_file(claim.layout.journal_bytes)
            .map_err(|e| failed("journal memfd", &e))?;
        let mut pools = Vec::with_capacity(claim.layout.pools.len());
        for (i, spec) in claim.layout.pools.iter().enumerate() {
            let bytes = spec.bytes().unwrap_or(0);
            let pool = crate::shared_memory::create_pool_file(bytes)
                .map_err(|e| failed(&format!("pool {i} memfd"), &e))?;
            pools.push(pool);
        }
        let listener = TcpListener::bind(control)
            .map_err(|e| failed(&format!("bind control {control}"), &e))?;
        let bound = listener
            .local_addr()
            .map_err(|e| failed("control address", &e))?;
        Ok(Self {
            compat_digest: claim.compat_digest,
            layout: claim.layout.clone(),
            control_asked: claim.control.clone(),
            control: bound,
            journal,
            pools,
            listener,
            state: GroupState::Fresh,
            dead: VecDeque::new(),
            backup: None,
        })
    }

    /// The first field in which `claim` differs from the group.
    fn difference(&self, claim: &ClaimMsg, control: SocketAddr) -> Option<String> {
        if claim.compat_digest != self.compat_digest {
            return Some("compat_digest".into());
        }
        if let Some(field) = self.layout.first_difference(&claim.layout) {
            return Some(field);
        }
        if claim.control != self.control_asked && control != self.control {
            return Some("control".into());
        }
        None
    }

    /// Copies of the descriptors to send: journal, pools, listener.
    fn descriptors(&self) -> io::Result<Vec<OwnedFd>> {
        let mut fds = Vec::with_capacity(self.pools.len() + 2);
        fds.push(OwnedFd::from(self.journal.try_clone()?));
        for (pool, _) in &self.pools {
            fds.push(OwnedFd::from(pool.try_clone()?));
        }
        fds.push(OwnedFd::from(self.listener.try_clone()?));
        Ok(fds)
    }
}

/// Starts the backup runner of orphaned `group` (see [`BackupServing`]);
/// `None`, logged, when its journal cannot be served from or it fails to
/// start (the memory stays held either way).
fn start_backup(
    id: u32,
    group: &Group,
    serving: &BackupServing,
    log: &GuardLog,
) -> Option<crate::Runner> {
    use kvcr_contracts::endpoint::{AdvertisePolicy, BindAddress, Host};
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
    let claimed = match crate::warm::backup(id, pools, listener, &group.journal, &dead) {
        Ok(c) => c,
        Err(e) => {
            failed(e.to_string());
            return None;
        }
    };
    let config = crate::RunnerConfig {
        pools: group
            .layout
            .pools
            .iter()
            .map(|p| crate::PoolConfig {
                name: p.name.clone(),
                block_size: p.block_bytes,
                blocks: p.blocks,
            })
            .collect(),
        operation_timeout: serving.operation_timeout,
        // The pages are in the guard's memory already; nothing is written.
        prefault: false,
        ..crate::RunnerConfig::default()
    };
    let mut peer = serving.peer.clone();
    peer.guard = None;
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
    match crate::Runner::start_backup(config, &peer, claimed) {
        Ok(runner) => {
            let seated = runner
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

/// A claim granted but not yet delivered.
struct Grant {
    reply: GrantedMsg,
    fds: Vec<OwnedFd>,
    group: u32,
    lease: u64,
    /// The group's state before, restored if the grant is not delivered.
    prior: GroupState,
}

/// Every group, and every decision about them.
struct Registry {
    groups: BTreeMap<u32, Group>,
    next_lease: u64,
    max_groups: usize,
    max_pools: usize,
    max_group_bytes: u64,
    dead_kept: usize,
    serve: Option<BackupServing>,
}

impl Registry {
    fn new(config: &GuardConfig) -> Self {
        Self {
            groups: BTreeMap::new(),
            next_lease: 1,
            max_groups: config.max_groups,
            max_pools: config.max_pools,
            max_group_bytes: config.max_group_bytes,
            dead_kept: config.dead_kept,
            serve: config.serve.clone(),
        }
    }

    /// Decides a claim by `pid` (whose pidfd is `pidfd`); on a grant, the
    /// group is leased to it at once.
    fn claim(
        &mut self,
        claim: &ClaimMsg,
        pid: u32,
        pidfd: &Arc<OwnedFd>,
        log: &GuardLog,
    ) -> Result<Grant, Refusal> {
        if claim.version != VERSION {
            return Err(Refusal::Version { got: claim.version });
        }
        let invalid = |why: String| Refusal::Invalid { why };
        let incarnation = protocol::parse_hex128(&claim.incarnation)
            .filter(|i| *i != 0)
            .ok_or_else(|| invalid("incarnation is not 32 hex digits, not all 0".into()))?;
        let control: SocketAddr = claim
            .control
            .parse()
            .map_err(|_| invalid(format!("control {:?} is not ip:port", claim.control)))?;
        claim
            .layout
            .check(self.max_pools, self.max_group_bytes)
            .map_err(invalid)?;

        let group = match self.groups.get_mut(&claim.group) {
            Some(group) => {
                if let Some(field) = group.difference(claim, control) {
                    return Err(Refusal::Mismatch {
                        group: claim.group,
                        field,
                    });
                }
                group
            }
            None => {
                if self.groups.len() >= self.max_groups {
                    return Err(Refusal::TooManyGroups {
                        limit: u32::try_from(self.max_groups).unwrap_or(u32::MAX),
                    });
                }
                let group = Group::create(claim, control)?;
                log.line(format!(
                    "group {} made: {} pools, journal {} bytes, control {}",
                    claim.group,
                    group.pools.len(),
                    group.layout.journal_bytes,
                    group.control
                ));
                self.groups.entry(claim.group).or_insert(group)
            }
        };
        // A holder that has exited, though its task has not seen it yet.
        if let GroupState::Leased(lease) = &group.state
            && fd_passing::has_exited(lease.pidfd.as_fd()).unwrap_or(false)
        {
            let lease_id = lease.id;
            Self::end_by_death(claim.group, group, lease_id, self.dead_kept, log);
        }
        if let GroupState::Leased(lease) = &group.state {
            return Err(Refusal::Held {
                group: claim.group,
                pid: lease.pid,
            });
        }
        // The new primary takes over from the backup: it stops first (its
        // sessions close; destinations redial the same address).
        if let Some(backup) = group.backup.take() {
            let incarnation = backup.incarnation();
            drop(backup);
            log.line(format!(
                "group {}: backup {incarnation} stopped for the claim",
                claim.group
            ));
        }
        let fds = group.descriptors().map_err(|e| Refusal::Failed {
            why: format!("dup: {e}"),
        })?;
        let (warm, previous) = match group.state {
            GroupState::Fresh => (false, None),
            GroupState::Released { incarnation } | GroupState::Orphaned { dead: incarnation } => {
                (true, Some(incarnation))
            }
            GroupState::Leased(_) => (true, None),
        };
        let lease = self.next_lease;
        self.next_lease += 1;
        let prior = std::mem::replace(
            &mut group.state,
            GroupState::Leased(Lease {
                id: lease,
                pid,
                incarnation,
                pidfd: Arc::clone(pidfd),
            }),
        );
        let reply = GrantedMsg {
            version: VERSION,
            group: claim.group,
            layout: group.layout.clone(),
            pool_tokens: group
                .pools
                .iter()
                .map(|(_, token)| protocol::token_hex(token))
                .collect(),
            control: group.control.to_string(),
            warm,
            previous_incarnation: previous.map(protocol::hex128),
            dead_incarnations: group.dead.iter().copied().map(protocol::hex128).collect(),
        };
        log.line(format!(
            "group {} granted to pid {pid} (incarnation {}){}",
            claim.group,
            protocol::hex128(incarnation),
            if warm { ", warm" } else { ", fresh" }
        ));
        Ok(Grant {
            reply,
            fds,
            group: claim.group,
            lease,
            prior,
        })
    }

    /// The lease's holder exited: the group is orphaned, its incarnation
    /// dead.
    fn end_by_death(id: u32, group: &mut Group, lease: u64, dead_kept: usize, log: &GuardLog) {
        let GroupState::Leased(held) = &group.state else {
            return;
        };
        if held.id != lease {
            return;
        }
        let (pid, dead) = (held.pid, held.incarnation);
        group.state = GroupState::Orphaned { dead };
        group.dead.push_back(dead);
        while group.dead.len() > dead_kept {
            group.dead.pop_front();
        }
        log.line(format!(
            "primary pid {pid} (incarnation {}) of group {id} died",
            protocol::hex128(dead)
        ));
    }

    /// The holder of lease `lease` on `group` exited: with serving
    /// configured, a backup serves the group's pages until the next claim.
    fn died(&mut self, group: u32, lease: u64, log: &GuardLog) {
        let dead_kept = self.dead_kept;
        let Some(entry) = self.groups.get_mut(&group) else {
            return;
        };
        Self::end_by_death(group, entry, lease, dead_kept, log);
        if let (Some(serving), GroupState::Orphaned { .. }, None) =
            (&self.serve, &entry.state, &entry.backup)
        {
            entry.backup = start_backup(group, entry, serving, log);
        }
    }

    /// The holder of lease `lease` on `group` released it; false when that
    /// lease has ended already.
    fn release(&mut self, group: u32, lease: u64, log: &GuardLog) -> bool {
        let Some(entry) = self.groups.get_mut(&group) else {
            return false;
        };
        let GroupState::Leased(held) = &entry.state else {
            return false;
        };
        if held.id != lease {
            return false;
        }
        let (pid, incarnation) = (held.pid, held.incarnation);
        entry.state = GroupState::Released { incarnation };
        log.line(format!(
            "group {group} released by pid {pid} (incarnation {})",
            protocol::hex128(incarnation)
        ));
        true
    }

    /// A grant that was never delivered: the group goes back to `prior`.
    fn rollback(&mut self, group: u32, lease: u64, prior: GroupState) {
        if let Some(entry) = self.groups.get_mut(&group)
            && matches!(&entry.state, GroupState::Leased(held) if held.id == lease)
        {
            entry.state = prior;
        }
    }
}
