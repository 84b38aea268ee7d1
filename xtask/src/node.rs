//! The runner node process (`kvcr-foundation/examples/node.rs`) as the
//! orchestrators drive it (`cargo xtask demo`, `cargo xtask e2e`): spawned
//! with flags, one JSON command per line on stdin, one `<WORD> <json>` answer
//! per line on stdout, every answer awaited within a bound (a hung node fails
//! the run instead of hanging it).

// `serde_json::Value` indexing returns `Null` for a missing key; it never panics.
#![allow(clippy::indexing_slicing)]

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

/// The longest the orchestrator waits for one answer. Far beyond any
/// operation deadline a node is started with (its own waits are bounded at
/// 120 s): reaching it means the node is hung, not slow.
const ANSWER_BOUND: Duration = Duration::from_secs(300);
/// How long a node gets to close its runner and exit after `exit`.
const EXIT_BOUND: Duration = Duration::from_secs(30);

/// Builds the node example: release for the demo and full e2e runs, the dev
/// profile (already built by `cargo xtask test`) for `e2e --quick`; and the
/// guard the `engine-crash` scenarios start next to nodes.
pub(crate) fn build(root: &Path, release: bool) -> Result<PathBuf> {
    cargo_build(
        root,
        release,
        &["-p", "kvcr-foundation", "--example", "node"],
    )?;
    build_guard(root, release)?;
    Ok(example_path(root, release, "node"))
}

/// Builds the `kvcr-guard` binary; returns its path.
pub(crate) fn build_guard(root: &Path, release: bool) -> Result<PathBuf> {
    cargo_build(root, release, &["-p", "kvcr-guard", "--bin", "kvcr-guard"])?;
    Ok(profile_dir(root, release).join("kvcr-guard"))
}

fn cargo_build(root: &Path, release: bool, targets: &[&str]) -> Result<()> {
    let mut cmd = crate::cargo();
    cmd.current_dir(root).args(["build", "--locked", "--quiet"]);
    if release {
        cmd.arg("--release");
    }
    cmd.args(targets);
    crate::run(&mut cmd)
}

/// The `kvcr-guard` binary built next to the node binary `node`.
pub(crate) fn guard_path(node: &Path) -> Option<PathBuf> {
    Some(node.parent()?.parent()?.join("kvcr-guard"))
}

/// Where cargo puts an example's binary (`CARGO_TARGET_DIR` honoured).
pub(crate) fn example_path(root: &Path, release: bool, example: &str) -> PathBuf {
    profile_dir(root, release).join("examples").join(example)
}

/// Cargo's output folder for a profile (`CARGO_TARGET_DIR` honoured).
fn profile_dir(root: &Path, release: bool) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map_or_else(|| root.join("target"), |dir| root.join(dir));
    target.join(if release { "release" } else { "debug" })
}

/// How a publishing node tags its KV events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Ownership {
    /// kvcr's default wire: its own events tagged `ownership: "kvcr"`.
    #[default]
    Field,
    /// Ownership left to the stream (the worker domain, `--ownership
    /// stream`), which is all that Dynamo 1.6.1's standalone indexer indexes.
    Stream,
}

/// How to start one node.
#[derive(Debug, Clone)]
pub(crate) struct NodeSpec {
    pub(crate) blocks: u64,
    pub(crate) block_bytes: u64,
    pub(crate) tls: Option<String>,
    pub(crate) publish: bool,
    pub(crate) replay: bool,
    /// How its events are tagged (with `publish`).
    pub(crate) ownership: Ownership,
    pub(crate) pub_hwm: Option<u32>,
    pub(crate) timeout_ms: Option<u64>,
    pub(crate) abandon_ms: Option<u64>,
    pub(crate) port: Option<u16>,
    /// Runs it inside this network namespace (`ip netns exec`), listening on
    /// and advertising `host` there.
    pub(crate) netns: Option<(String, std::net::IpAddr)>,
    /// Where the node's stderr goes (UCX and runner diagnostics); inherited
    /// when `None`.
    pub(crate) log: Option<PathBuf>,
    /// A G3 file tier: its folder and each file's bytes (`--g3`, `--g3-bytes`).
    pub(crate) g3: Option<(PathBuf, u64)>,
    /// The pool belongs to the guard at this socket (`--guard`), with this
    /// journal size (`--guard-journal-bytes`, the node's default when
    /// `None`).
    pub(crate) guard: Option<(PathBuf, Option<u64>)>,
}

impl NodeSpec {
    pub(crate) fn new(blocks: u64, block_bytes: u64) -> Self {
        Self {
            blocks,
            block_bytes,
            tls: None,
            publish: false,
            replay: false,
            ownership: Ownership::Field,
            pub_hwm: None,
            timeout_ms: None,
            abandon_ms: None,
            port: None,
            netns: None,
            log: None,
            g3: None,
            guard: None,
        }
    }

    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "--blocks".to_owned(),
            self.blocks.to_string(),
            "--block-bytes".to_owned(),
            self.block_bytes.to_string(),
        ];
        let mut opt = |name: &str, value: Option<String>| {
            if let Some(value) = value {
                args.push(name.to_owned());
                args.push(value);
            }
        };
        opt("--tls", self.tls.clone());
        opt("--pub-hwm", self.pub_hwm.map(|v| v.to_string()));
        opt("--timeout-ms", self.timeout_ms.map(|v| v.to_string()));
        opt("--abandon-ms", self.abandon_ms.map(|v| v.to_string()));
        opt("--port", self.port.map(|v| v.to_string()));
        opt(
            "--g3",
            self.g3.as_ref().map(|(dir, _)| dir.display().to_string()),
        );
        opt(
            "--g3-bytes",
            self.g3.as_ref().map(|(_, bytes)| bytes.to_string()),
        );
        opt(
            "--guard",
            self.guard.as_ref().map(|(s, _)| s.display().to_string()),
        );
        opt(
            "--guard-journal-bytes",
            self.guard
                .as_ref()
                .and_then(|(_, b)| b.map(|b| b.to_string())),
        );
        opt(
            "--host",
            self.netns.as_ref().map(|(_, host)| host.to_string()),
        );
        if self.publish {
            args.push("--publish".to_owned());
        }
        if self.replay {
            args.push("--replay".to_owned());
        }
        if self.ownership == Ownership::Stream {
            args.extend(["--ownership".to_owned(), "stream".to_owned()]);
        }
        args
    }
}

/// One running node. Dropping it asks it to exit, and kills it if it does not
/// within [`EXIT_BOUND`] (a stopped node is continued first).
pub(crate) struct Node {
    pub(crate) name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// Its peer control endpoint.
    pub(crate) endpoint: String,
    /// Its KV-event PUB endpoint (`--publish`).
    pub(crate) events: Option<String>,
    /// Its replay ROUTER endpoint (`--replay`).
    pub(crate) replay: Option<String>,
    /// Its runner's incarnation.
    pub(crate) incarnation: String,
    /// Its process id (also the worker id in its KV-event topic).
    pub(crate) pid: u64,
    /// Bytes of pages it asks a source for per write (0: one write per
    /// operation).
    pub(crate) write_batch_bytes: u64,
    /// How it started under a guard (`READY`'s `warm_start`; null without).
    pub(crate) warm_start: Value,
    stopped: bool,
    reaped: bool,
}

/// The cluster secret of this orchestrator run: 32 random bytes, hex, made
/// once per process and handed to every node it starts (environment variable
/// `KVCR_CLUSTER_SECRET`), so the runners authenticate each other without any
/// setup step.
pub(crate) fn cluster_secret() -> &'static str {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        use std::io::Read;
        let mut bytes = [0u8; 32];
        if let Err(e) = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)) {
            // Without a random source no run can be made safe: stop here.
            eprintln!("xtask: cannot read /dev/urandom for the cluster secret: {e}");
            std::process::exit(1);
        }
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    })
}

impl Node {
    pub(crate) fn spawn(binary: &Path, name: &str, spec: &NodeSpec) -> Result<Self> {
        let mut cmd = match &spec.netns {
            Some((netns, _)) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", netns]).arg(binary);
                // UCX's tcp transport on the link, not on the namespace's
                // loopback.
                cmd.env("UCX_NET_DEVICES", crate::link::DEVICE);
                cmd
            }
            None => Command::new(binary),
        };
        cmd.env("KVCR_CLUSTER_SECRET", cluster_secret());
        cmd.args(spec.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(log) = &spec.log {
            if let Some(dir) = log.parent() {
                std::fs::create_dir_all(dir)?;
            }
            cmd.stderr(File::create(log).with_context(|| format!("creating {}", log.display()))?);
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = child.stdout.take().context("stdout")?;
        let lines = crate::stdout_lines(stdout);
        let mut node = Self {
            name: name.to_owned(),
            child,
            stdin: Some(stdin),
            lines,
            endpoint: String::new(),
            events: None,
            replay: None,
            incarnation: String::new(),
            pid: 0,
            write_batch_bytes: 0,
            warm_start: Value::Null,
            stopped: false,
            reaped: false,
        };
        let ready = node.read("READY")?;
        node.endpoint = ready["endpoint"].as_str().unwrap_or_default().to_owned();
        node.events = ready["events"].as_str().map(str::to_owned);
        node.replay = ready["replay"].as_str().map(str::to_owned);
        node.incarnation = ready["incarnation"].as_str().unwrap_or_default().to_owned();
        node.write_batch_bytes = ready["write_batch_bytes"].as_u64().unwrap_or(0);
        node.warm_start = ready["warm_start"].clone();
        node.pid = ready["pid"]
            .as_u64()
            .unwrap_or_else(|| u64::from(node.child.id()));
        Ok(node)
    }

    pub(crate) fn send(&mut self, value: &Value) -> Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .with_context(|| format!("{} is closed", self.name))?;
        writeln!(stdin, "{value}")?;
        stdin.flush()?;
        Ok(())
    }

    /// The next answer, which must be `word` (an `ERROR` answer is an error).
    pub(crate) fn read(&mut self, word: &str) -> Result<Value> {
        let line = match self.lines.recv_timeout(ANSWER_BOUND) {
            Ok(line) => line,
            Err(RecvTimeoutError::Disconnected) => {
                bail!("{} exited before answering {word}", self.name)
            }
            Err(RecvTimeoutError::Timeout) => bail!(
                "{} did not answer {word} within {} s",
                self.name,
                ANSWER_BOUND.as_secs()
            ),
        };
        self.parse(word, &line)
    }

    /// The next answer if one is there already (which must be `word`).
    pub(crate) fn try_read(&mut self, word: &str) -> Result<Option<Value>> {
        match self.lines.try_recv() {
            Ok(line) => self.parse(word, &line).map(Some),
            Err(mpsc::TryRecvError::Empty) => Ok(None),
            Err(mpsc::TryRecvError::Disconnected) => {
                bail!("{} exited before answering {word}", self.name)
            }
        }
    }

    fn parse(&self, word: &str, line: &str) -> Result<Value> {
        let (got, body) = line
            .trim_end()
            .split_once(' ')
            .unwrap_or((line.trim_end(), "{}"));
        if got != word {
            bail!("{}: expected {word}, got {line}", self.name);
        }
        Ok(serde_json::from_str(body)?)
    }

    /// Sends a command and reads its answer.
    pub(crate) fn call(&mut self, command: &Value, word: &str) -> Result<Value> {
        self.send(command)?;
        self.read(word)
    }

    /// The node's `STATS` answer.
    pub(crate) fn stats(&mut self) -> Result<Value> {
        self.call(&json!({"cmd": "stats"}), "STATS")
    }

    pub(crate) fn signal(&mut self, signal: Signal) -> Result<()> {
        let pid = i32::try_from(self.child.id()).context("pid")?;
        kill(Pid::from_raw(pid), signal)
            .with_context(|| format!("kill({pid}, {signal}) of {}", self.name))?;
        match signal {
            Signal::SIGSTOP => self.stopped = true,
            Signal::SIGCONT => self.stopped = false,
            _ => {}
        }
        Ok(())
    }

    /// SIGKILL and reap: the process is gone when this returns.
    pub(crate) fn kill_and_reap(&mut self) -> Result<ExitStatus> {
        self.signal(Signal::SIGKILL)?;
        self.stdin = None;
        let status = self.child.wait()?;
        self.reaped = true;
        Ok(status)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.reaped {
            return;
        }
        if self.stopped {
            let _ = self.signal(Signal::SIGCONT);
        }
        let _ = self.send(&json!({"cmd": "exit"}));
        self.stdin = None;
        crate::wait_or_kill(&mut self.child, EXIT_BOUND, &self.name);
    }
}
