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
//! An orphaned group's backup runner ([`GuardConfig::serve`]) is started
//! when the lease task sees the holder's exit and stopped (dropped, on the
//! service thread) before the next claim of the group is granted.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use kvcr_runner::guard::protocol::{self, Refusal, Reply, Request};
use kvcr_sys::fd_passing::{self, PeerProcess};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use crate::registry::Registry;
use crate::{GuardConfig, GuardError, os_error, protocol_error};

/// Starts guards.
#[derive(Debug)]
pub struct GuardService;

impl GuardService {
    /// Serves `socket` with the default [`GuardConfig`].
    pub fn start(socket: &Path) -> Result<GuardHandle, GuardError> {
        Self::start_with(socket, GuardConfig::default())
    }

    /// Serves `socket`: refuses a directory another user owns or may write
    /// ([`GuardError::SharedDirectory`]) and a socket a guard answers at,
    /// removes a stale socket file (never a file that is not a socket),
    /// binds it with mode 0600 and runs the service on a thread of its own
    /// until the handle is dropped.
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
            .map_err(os_error("tokio runtime"))?;
        listener
            .set_nonblocking(true)
            .map_err(os_error("fcntl(O_NONBLOCK)"))?;
        let listener = {
            let _entered = runtime.enter();
            UnixListener::from_std(listener).map_err(os_error("epoll_ctl"))?
        };
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("kvcr-guard".into())
            .spawn(move || runtime.block_on(run(listener, config, stopped)))
            .map_err(os_error("thread spawn"))?;
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
            Some(Err(_)) => Err(protocol_error("the guard's thread panicked")),
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

/// Binds the socket: refused in a directory another user owns or may write
/// (`kvcr_runner::guard::check_socket_directory`), or when something
/// answers there; a stale socket file is removed first; mode 0600.
fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, GuardError> {
    kvcr_runner::guard::check_socket_directory(path)?;
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
                _ => return Err(os_error("accept")(e)),
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
