//! Another local user against a runner's own files and sockets (issue 40,
//! item 5): a real second process of uid 65534 (`nobody`) plants G3 files,
//! symlinks a G3 name to root's file, binds the guard's socket path first
//! and serves the claim, or hands its own memory through a guard; the runner
//! (root here, as in CI) must refuse each, typed, and touch nothing.
//!
//! Each probe runs twice: in a shared sticky directory (the directory rule
//! refuses it, naming the directory) and in a directory made private after
//! the other user planted its name there (the checks on what is opened
//! refuse it: the file's owner, `O_NOFOLLOW`, `SO_PEERCRED`).
//!
//! The second user is this test binary again, run with `uid`/`gid` 65534
//! and `KVCR_OTHER_USER` naming its part ([`another_user_entry`]). Acting as
//! another user needs root: not root, these tests fail, unless
//! `KVCR_TEST_ROOT=0` says root is unavailable here (then they say SKIP).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use kvcr_runner::error::Error;
use kvcr_runner::g3::G3Error;
use kvcr_runner::guard::protocol::{self, ClaimMsg, GrantedMsg, Reply, Request};
use kvcr_runner::guard::{self, GuardClaim, GuardError, Layout, PoolSpec};
use kvcr_runner::{G3Options, GuardOptions, PeerOptions, Runner, RunnerConfig};
use kvcr_sys::{fd_passing, memfd};

/// The other user: `nobody`.
const NOBODY: u32 = 65534;

const BLOCK: u64 = 4096;

/// Where the other user planted its name before the runner started.
#[derive(Debug, Clone, Copy)]
enum Where {
    /// A shared sticky directory (mode 1777, like `/tmp`).
    SharedSticky,
    /// A directory that was shared while the name was planted and then made
    /// private (mode 0755, root's).
    MadePrivateAfter,
}

/// Whether this process can act as another user. Not root: a failure, unless
/// `KVCR_TEST_ROOT=0` says root is unavailable (then a SKIP line).
fn can_act_as_another_user() -> bool {
    if fd_passing::effective_uid() == 0 {
        return true;
    }
    if std::env::var("KVCR_TEST_ROOT").as_deref() == Ok("0") {
        println!("SKIP (KVCR_TEST_ROOT=0): a second local user needs root");
        return false;
    }
    panic!(
        "the local-user tests run a process as uid {NOBODY} and need root; \
         set KVCR_TEST_ROOT=0 to say root is unavailable here"
    );
}

/// A scratch folder the other user can reach, with `shared/` (1777) in it
/// and `private/` (0700, root's), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        // Under the system's temporary folder, not the target folder: the
        // checkout may sit where uid 65534 cannot reach (`/root`, 0700).
        let dir =
            std::env::temp_dir().join(format!("kvcr-local-users-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (sub, mode) in [("", 0o755), ("shared", 0o1777), ("private", 0o700)] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        Self(dir)
    }

    fn shared(&self) -> PathBuf {
        self.0.join("shared")
    }

    fn private(&self) -> PathBuf {
        self.0.join("private")
    }

    /// After the other user acted: a directory made private, or left shared.
    fn settle(&self, place: Where) {
        if let Where::MadePrivateAfter = place {
            let private = std::fs::Permissions::from_mode(0o755);
            std::fs::set_permissions(self.shared(), private).unwrap();
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of this test binary the other user can run: the checkout (and
/// its target folder) may sit where uid 65534 cannot reach, so it is copied
/// once into a 0755 folder under the system's temporary folder (removed by
/// the next run once this process is gone).
fn reachable_exe() -> PathBuf {
    static EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        // Earlier runs' copies, their process gone, are removed first.
        for entry in std::fs::read_dir(std::env::temp_dir()).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("kvcr-other-user-")
                && !Path::new("/proc").join(pid).exists()
            {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = std::env::temp_dir().join(format!("kvcr-other-user-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let exe = dir.join("it");
        std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        exe
    })
    .clone()
}

/// The other user, running `part` with `args`; its stdout is piped.
struct OtherUser {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl OtherUser {
    fn start(part: &str, args: &[&Path]) -> Self {
        let mut cmd = Command::new(reachable_exe());
        cmd.args([
            "--exact",
            "local_users::another_user_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVCR_OTHER_USER", part)
        .env("KVCR_OTHER_USER_ARGS", std::env::join_paths(args).unwrap())
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| {
            panic!("running this test binary as uid {NOBODY}: {e} (it must be readable by all)")
        });
        let out = BufReader::new(child.stdout.take().unwrap());
        Self { child, out }
    }

    /// The next line the other user reports (`other user: ...`), without
    /// its prefix; `None` once it has exited.
    fn report(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line).unwrap() == 0 {
                return None;
            }
            // The harness prints the test's name on the same line first.
            match line.trim_end().split_once("other user: ") {
                Some((_, report)) => return Some(report.to_owned()),
                // Its test harness's own lines, shown with a failure.
                None => print!("(other user's output) {line}"),
            }
        }
    }

    /// Waits for its report `expected` (it panics on anything else).
    fn expect(&mut self, expected: &str) {
        let got = self.report();
        assert_eq!(got.as_deref(), Some(expected), "the other user's report");
    }

    /// Tells it to finish (closes its stdin) and collects what it still
    /// reports.
    fn finish(mut self) -> Vec<String> {
        drop(self.child.stdin.take());
        let mut reports = Vec::new();
        while let Some(report) = self.report() {
            reports.push(report);
        }
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the other user failed: {status}");
        reports
    }
}

impl Drop for OtherUser {
    fn drop(&mut self) {
        // Only after a failed assertion: `finish` waited for it otherwise.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The other user's side: does nothing unless `KVCR_OTHER_USER` names a part
/// (set only by [`OtherUser::start`]).
#[test]
fn another_user_entry() {
    let Ok(part) = std::env::var("KVCR_OTHER_USER") else {
        return;
    };
    let args: Vec<PathBuf> =
        std::env::split_paths(&std::env::var_os("KVCR_OTHER_USER_ARGS").unwrap()).collect();
    assert_eq!(
        fd_passing::effective_uid(),
        NOBODY,
        "runs as the other user"
    );
    let report = |what: &str| {
        println!("other user: {what}");
        std::io::stdout().flush().unwrap();
    };
    let wait_for_the_end = || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
    };
    match part.as_str() {
        // Files the runner will be told to use, readable and writable by all.
        "plant" => {
            for path in &args {
                std::fs::write(path, b"").unwrap();
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
            }
            report("planted");
        }
        "symlink" => {
            std::os::unix::fs::symlink(&args[1], &args[0]).unwrap();
            report("linked");
        }
        // A guard of its own at the runner's socket path, serving one claim
        // with memory this user owns.
        "fake guard" => {
            let listener = UnixListener::bind(&args[0]).unwrap();
            std::fs::set_permissions(&args[0], std::fs::Permissions::from_mode(0o777)).unwrap();
            report("bound");
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let served = serve_one_claim(&stream.unwrap(), own_memory);
                    report(if served { "claim served" } else { "no claim" });
                }
            });
            // Nobody may ever connect (the runner refused the directory):
            // the test's end ends this process, accept or not.
            wait_for_the_end();
            std::process::exit(0);
        }
        // One pool memfd of this user's, held open for the test to take.
        "memfd" => {
            let len: u64 = args[0].to_str().unwrap().parse().unwrap();
            let (file, _) = memfd::create_pool_file(len).unwrap();
            use std::os::fd::AsRawFd;
            report(&format!(
                "memfd {} {}",
                std::process::id(),
                file.as_raw_fd()
            ));
            wait_for_the_end();
        }
        other => panic!("no part {other}"),
    }
}

/// The journal, pools and listener a guard would make for `claim`, made by
/// this process (so owned by its user).
fn own_memory(claim: &ClaimMsg) -> (Vec<OwnedFd>, Vec<String>, String) {
    let mut fds = vec![OwnedFd::from(
        memfd::create_journal_file(claim.layout.journal_bytes).unwrap(),
    )];
    let mut tokens = Vec::new();
    for pool in &claim.layout.pools {
        let (file, token) = memfd::create_pool_file(pool.bytes().unwrap()).unwrap();
        fds.push(OwnedFd::from(file));
        tokens.push(protocol::token_hex(&token));
    }
    let listener = TcpListener::bind(&claim.control).unwrap();
    let control = listener.local_addr().unwrap().to_string();
    fds.push(OwnedFd::from(listener));
    (fds, tokens, control)
}

/// Reads one claim from `stream` and grants it with what `memory` makes
/// (descriptors, pool tokens, control address), as a guard would; `false`
/// when the connection closed before a claim came.
fn serve_one_claim(
    mut stream: &UnixStream,
    memory: impl FnOnce(&ClaimMsg) -> (Vec<OwnedFd>, Vec<String>, String),
) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut header = [0u8; 4];
    if stream.read_exact(&mut header).is_err() {
        return false;
    }
    let mut payload = vec![0u8; protocol::payload_len(header).unwrap()];
    stream.read_exact(&mut payload).unwrap();
    let Request::Claim(claim) = protocol::decode_request(&payload).unwrap() else {
        panic!("not a claim");
    };
    let (fds, pool_tokens, control) = memory(&claim);
    let reply = Reply::Granted(GrantedMsg {
        version: protocol::VERSION,
        group: claim.group,
        layout: claim.layout.clone(),
        pool_tokens,
        control,
        warm: false,
        previous_incarnation: None,
        dead_incarnations: vec![],
        member_key: protocol::MemberKeyHex("11".repeat(32)),
    });
    let frame = protocol::encode(&reply).unwrap();
    let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
    let sent = fd_passing::send_with_fds(stream.as_fd(), &frame, &borrowed).unwrap();
    assert_eq!(sent, frame.len());
    true
}

fn a_claim() -> GuardClaim {
    GuardClaim {
        group: 1,
        compat_digest: 0xfeed,
        layout: Layout {
            pools: vec![
                PoolSpec {
                    name: "kv".into(),
                    block_bytes: BLOCK,
                    blocks: 4,
                },
                PoolSpec {
                    name: "state".into(),
                    block_bytes: 2 * BLOCK,
                    blocks: 2,
                },
            ],
            journal_bytes: 3 * BLOCK,
        },
        control: "127.0.0.1:0".into(),
        incarnation: 1,
    }
}

/// Starts a runner whose G3 files are `paths`; the G3 error it refused with.
fn g3_refusal(paths: Vec<PathBuf>) -> G3Error {
    let config = RunnerConfig {
        g3: Some(G3Options {
            paths,
            capacity_bytes_per_file: 4 * BLOCK,
        }),
        prefault: false,
        ..RunnerConfig::single_pool("kv", BLOCK, 4)
    };
    match Runner::start(config, None) {
        Ok(_) => panic!("the runner started on files another user planted"),
        Err(Error::Startup { cause, .. }) => match *cause {
            Error::G3(e) => e,
            other => panic!("{other}"),
        },
        Err(other) => panic!("{other}"),
    }
}

/// Another user pre-creates the G3 files (readable and writable by all):
/// the runner refuses to start and leaves them as they were (empty).
#[rstest::rstest]
#[case::shared_sticky(Where::SharedSticky)]
#[case::made_private_after(Where::MadePrivateAfter)]
fn g3_files_another_user_made_are_refused(#[case] place: Where) {
    let _serial = crate::serial();
    if !can_act_as_another_user() {
        return;
    }
    let dir = Scratch::new(&format!("plant-{place:?}"));
    let paths: Vec<PathBuf> = (0..2)
        .map(|i| dir.shared().join(format!("g3-{i}")))
        .collect();
    let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
    let mut other = OtherUser::start("plant", &refs);
    other.expect("planted");
    assert!(other.finish().is_empty());
    dir.settle(place);

    let e = g3_refusal(paths.clone());
    match place {
        Where::SharedSticky => assert!(
            matches!(&e, G3Error::SharedDirectory { path, .. } if *path == dir.shared()),
            "{e:?}"
        ),
        Where::MadePrivateAfter => assert_eq!(
            e,
            G3Error::NotOwned {
                path: paths[0].clone(),
                owner: NOBODY
            }
        ),
    }
    for path in &paths {
        assert_eq!(std::fs::metadata(path).unwrap().len(), 0, "{path:?}");
    }
}

/// Another user symlinks a G3 file's name to root's file: the runner never
/// follows it (refuses to start) and root's file keeps its bytes.
#[rstest::rstest]
#[case::shared_sticky(Where::SharedSticky)]
#[case::made_private_after(Where::MadePrivateAfter)]
fn a_g3_name_another_user_symlinked_is_never_followed(#[case] place: Where) {
    let _serial = crate::serial();
    if !can_act_as_another_user() {
        return;
    }
    let dir = Scratch::new(&format!("symlink-{place:?}"));
    let victim = dir.private().join("roots-file");
    let original: Vec<u8> = (0..4 * BLOCK).map(|i| (i % 251) as u8).collect();
    std::fs::write(&victim, &original).unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = dir.shared().join("g3-0");
    let mut other = OtherUser::start("symlink", &[&link, &victim]);
    other.expect("linked");
    assert!(other.finish().is_empty());
    dir.settle(place);

    let e = g3_refusal(vec![link.clone()]);
    match place {
        Where::SharedSticky => assert!(
            matches!(&e, G3Error::SharedDirectory { path, .. } if *path == dir.shared()),
            "{e:?}"
        ),
        Where::MadePrivateAfter => assert!(
            matches!(&e, G3Error::Path { path, errno: Some(libc::ELOOP), .. } if *path == link),
            "{e:?}"
        ),
    }
    assert_eq!(std::fs::read(&victim).unwrap(), original, "root's file");
}

/// Another user binds the guard's socket path first and serves claims with
/// memory of its own: the client refuses before it sends anything (the
/// other user never sees a claim), and a runner told to use that guard
/// fails its start.
#[rstest::rstest]
#[case::shared_sticky(Where::SharedSticky)]
#[case::made_private_after(Where::MadePrivateAfter)]
fn a_guard_socket_another_user_bound_is_refused(#[case] place: Where) {
    let _serial = crate::serial();
    if !can_act_as_another_user() {
        return;
    }
    let dir = Scratch::new(&format!("guard-{place:?}"));
    let socket = dir.shared().join("guard.sock");
    let mut other = OtherUser::start("fake guard", &[&socket]);
    other.expect("bound");
    dir.settle(place);

    let result = guard::claim(&socket, &a_claim(), Duration::from_secs(10));
    let e = result.map(|_| ()).unwrap_err();
    match place {
        Where::SharedSticky => assert!(
            matches!(&e, GuardError::SharedDirectory { path, .. } if *path == dir.shared()),
            "{e:?}"
        ),
        Where::MadePrivateAfter => {
            assert!(
                matches!(&e, GuardError::UntrustedGuard { uid, path, .. }
                    if *path == socket && *uid == NOBODY),
                "{e:?}"
            );
            // It connected, saw who serves, and closed without a word.
            other.expect("no claim");
            // A runner under that "guard" fails its start at the claim, as
            // for any guard failure.
            let mut options = PeerOptions::loopback();
            options.guard = Some(GuardOptions::new(&socket, 1, 0xfeed));
            let config = RunnerConfig {
                prefault: false,
                ..RunnerConfig::single_pool("kv", BLOCK, 4)
            };
            match Runner::start_with_peers(config, None, &options).map(|_| ()) {
                Err(Error::Startup { stage, cause, .. }) => {
                    assert_eq!(stage, "claim guard");
                    assert!(
                        matches!(&*cause, Error::Guard(GuardError::UntrustedGuard { .. })),
                        "{cause}"
                    );
                }
                other => panic!("{other:?}"),
            }
            other.expect("no claim");
        }
    }
    assert!(!other.finish().iter().any(|r| r == "claim served"));
}

/// A guard of this user that hands over another user's memory (a pool memfd
/// the other user made and still holds): the grant is refused, naming the
/// descriptor and its owner.
#[test]
fn a_grant_of_another_users_memory_is_refused() {
    let _serial = crate::serial();
    if !can_act_as_another_user() {
        return;
    }
    let dir = Scratch::new("foreign-memfd");
    let claim = a_claim();
    let pool_bytes = claim.layout.pools[0].bytes().unwrap();
    let len = PathBuf::from(pool_bytes.to_string());
    let mut other = OtherUser::start("memfd", &[&len]);
    let report = other.report().unwrap();
    let mut words = report.split(' ').skip(1);
    let (pid, fd) = (words.next().unwrap(), words.next().unwrap());
    let foreign = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/fd/{fd}"))
        .unwrap();

    let socket = dir.private().join("guard.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let guard = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let served = serve_one_claim(&stream, |claim| {
            let (mut fds, tokens, control) = own_memory(claim);
            fds[1] = OwnedFd::from(foreign);
            (fds, tokens, control)
        });
        let _ = (&stream).read_to_end(&mut Vec::new());
        served
    });
    let e = guard::claim(&socket, &claim, Duration::from_secs(10))
        .map(|_| ())
        .unwrap_err();
    assert!(guard.join().unwrap(), "the grant was sent");
    assert_eq!(
        e,
        GuardError::ForeignDescriptor {
            what: "pool 0".into(),
            owner: NOBODY
        }
    );
    assert!(other.finish().is_empty());
}
