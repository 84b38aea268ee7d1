//! Tests of the G3 file tier: striping and round trips, every refusal at
//! open, locks across stores and processes, a full filesystem, a file
//! removed underneath, batches against an in-memory model.
//!
//! Tests that need a second process re-run this test binary with
//! `KVCR_G3_CHILD` set (see [`child_entry`]). The real "disk full" test
//! mounts a small ext4 image and needs root: it runs when `KVCR_TEST_ROOT=1`
//! (and then fails, not skips, when it cannot); the `RLIMIT_FSIZE` test
//! checks the same mapping (`EFBIG`) unprivileged.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;

use proptest::prelude::*;

use super::*;
use crate::copy::test_memory::TestBuffer;

/// One G3 test at a time: a process forked (to spawn a child) while a store
/// is open shares the store's locked file description until its `exec`
/// closes it (`O_CLOEXEC`), so for that moment a file stays locked after its
/// store closed; tests that spawn processes and tests that reopen files must
/// not overlap.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A scratch directory next to the test binary (on the build's disk, where
/// `O_DIRECT` works; `/tmp` may be a tmpfs that refuses it), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let exe = std::env::current_exe().unwrap();
        let base = exe.parent().unwrap().parent().unwrap().join("g3-tests");
        let dir = base.join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn paths(&self, n: usize) -> Vec<PathBuf> {
        (0..n).map(|i| self.path(&format!("g3-{i}"))).collect()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random bytes (SplitMix64).
fn fill(buf: &mut [u8], seed: u64) {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef;
    for chunk in buf.chunks_mut(8) {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let bytes = z.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0; len];
    fill(&mut v, seed);
    v
}

const SLOT: u64 = 16 << 10;

fn options(paths: Vec<PathBuf>, slots_per_file: u64) -> G3Options {
    G3Options {
        paths,
        capacity_bytes_per_file: slots_per_file * SLOT,
    }
}

fn buf(len: u64) -> DirectBuf {
    DirectBuf::new(len as usize, 4096).unwrap()
}

/// `len` bytes of `seed`'s pattern ([`fill`]), registered in `store`'s
/// memory (page-aligned) for the address-named entry points.
fn registered(store: &G3Store, len: u64, seed: u64) -> TestBuffer {
    let mut bytes = vec![0u8; len as usize];
    fill(&mut bytes, seed);
    TestBuffer::with(store.memory(), len as usize, &bytes)
}

/// Random bytes through 3 files and back; each slot's bytes sit in file
/// `i % 3` at `(i / 3) * slot` (read raw, through the page cache, which
/// direct writes keep coherent).
#[test]
fn round_trip_stripes_slots_across_three_files() {
    let _serial = serial();
    let dir = Scratch::new("stripes");
    let paths = dir.paths(3);
    let store = G3Store::open(&options(paths.clone(), 4), SLOT).unwrap();
    assert_eq!(store.slots(), 12);
    assert_eq!(store.file_count(), 3);
    assert_eq!(store.slot_bytes(), SLOT);
    assert!(store.workers() >= 2);
    let mut srcs: Vec<DirectBuf> = (0..12).map(|_| buf(SLOT)).collect();
    for (i, src) in srcs.iter_mut().enumerate() {
        fill(src, 1000 + i as u64);
    }
    let mut items: Vec<G3SliceIo<'_>> = srcs
        .iter()
        .enumerate()
        .map(|(i, src)| G3SliceIo::Write {
            slot: i as u64,
            src,
        })
        .collect();
    let outcomes = store.run_batch_slices(&mut items);
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");

    for slot in 0..12u64 {
        let (file, offset) = store.location(slot).unwrap();
        assert_eq!(file, (slot % 3) as usize);
        assert_eq!(offset, (slot / 3) * SLOT);
        let raw = std::fs::read(&paths[file]).unwrap();
        let at = offset as usize;
        assert_eq!(
            &raw[at..at + SLOT as usize],
            &srcs[slot as usize][..],
            "slot {slot}"
        );
    }
    assert_eq!(store.location(12), None);

    let mut dsts: Vec<DirectBuf> = (0..12).map(|_| buf(SLOT)).collect();
    let mut items: Vec<G3SliceIo<'_>> = dsts
        .iter_mut()
        .enumerate()
        .map(|(i, dst)| G3SliceIo::Read {
            slot: 11 - i as u64,
            dst,
        })
        .collect();
    let outcomes = store.run_batch_slices(&mut items);
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    for (i, dst) in dsts.iter().enumerate() {
        assert_eq!(&dst[..], &srcs[11 - i][..], "read {i}");
    }

    // The one-slot path, on the calling thread.
    let mut one = buf(SLOT);
    store.read_slot_into(7, &mut one).unwrap();
    assert_eq!(&one[..], &srcs[7][..]);
    fill(&mut one, 77);
    store.write_slot_from(7, &one).unwrap();
    let mut back = buf(SLOT);
    store.read_slot_into(7, &mut back).unwrap();
    assert_eq!(&back[..], &one[..]);
}

/// Files are created mode 0600 and not preallocated (a file grows as slots
/// are written); `Sparse` extends them to the capacity without blocks.
#[test]
fn sizing_grow_and_sparse() {
    let _serial = serial();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = Scratch::new("sizing");
    let paths = dir.paths(2);
    {
        let store = G3Store::open(&options(paths.clone(), 8), SLOT).unwrap();
        for p in &paths {
            let meta = std::fs::metadata(p).unwrap();
            assert_eq!(meta.len(), 0);
            assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        }
        // A slot never written, past the end of its file: a short read.
        let mut dst = buf(SLOT);
        match store.read_slot_into(5, &mut dst) {
            Err(G3Error::ShortIo {
                slot: 5,
                op: G3Op::Read,
                done: 0,
                len,
                ..
            }) => assert_eq!(len, SLOT),
            other => panic!("{other:?}"),
        }
    }
    let tuning = G3Tuning {
        sizing: G3Sizing::Sparse,
        ..G3Tuning::default()
    };
    let store = G3Store::open_with(&options(paths.clone(), 8), SLOT, tuning).unwrap();
    for p in &paths {
        let meta = std::fs::metadata(p).unwrap();
        assert_eq!(meta.len(), 8 * SLOT);
        assert!(
            meta.blocks() * 512 < 8 * SLOT,
            "sparse: {} blocks",
            meta.blocks()
        );
    }
    let mut dst = buf(SLOT);
    dst.fill(0xaa);
    store.read_slot_into(15, &mut dst).unwrap();
    assert!(dst.iter().all(|b| *b == 0), "a hole reads as zeros");
}

/// A slot outside the store, memory of the wrong length or misaligned: a
/// typed refusal per item, nothing moved, the other items unaffected.
#[test]
fn bad_items_are_refused_one_by_one() {
    let _serial = serial();
    let dir = Scratch::new("items");
    let store = G3Store::open(&options(dir.paths(2), 2), SLOT).unwrap();
    let good = registered(&store, SLOT, 0);
    let big = registered(&store, 2 * SLOT, 1);
    let align = store.alignment();
    let items = [
        G3Io::write(4, good.addr(), SLOT),
        G3Io::write(0, good.addr(), SLOT - 512),
        G3Io::write(0, big.addr() + 1, SLOT),
        G3Io::write(1, good.addr(), SLOT),
        G3Io::read(u64::MAX, good.addr(), SLOT),
        G3Io::read(0, 0, SLOT),
        G3Io::read(0, u64::MAX - 4095, SLOT),
    ];
    // Every range that passes validation lies inside `good` or `big`
    // (registered); the only read-direction items fail validation (out of
    // range, null, wrapping) before touching memory.
    let outcomes = store.run_batch(&items);
    assert!(matches!(
        outcomes[0],
        Err(G3Error::SlotRange { slot: 4, slots: 4 })
    ));
    assert!(matches!(outcomes[1], Err(G3Error::Buffer { slot: 0, .. })));
    if align > 1 {
        assert!(
            matches!(outcomes[2], Err(G3Error::Buffer { slot: 0, .. })),
            "{:?}",
            outcomes[2]
        );
    }
    assert!(outcomes[3].is_ok());
    assert!(matches!(outcomes[4], Err(G3Error::SlotRange { .. })));
    assert!(matches!(outcomes[5], Err(G3Error::Buffer { addr: 0, .. })));
    assert!(matches!(outcomes[6], Err(G3Error::Buffer { .. })));
    let mut small = vec![0u8; 100];
    assert!(matches!(
        store.read_slot_into(1, &mut small),
        Err(G3Error::Buffer { len: 100, .. })
    ));
    // An empty batch is fine.
    assert!(store.run_batch_slices(&mut []).is_empty());
}

#[track_caller]
fn refused(options: &G3Options, slot_bytes: u64) -> G3Error {
    match G3Store::open(options, slot_bytes) {
        Ok(store) => panic!("opened: {store:?}"),
        Err(e) => e,
    }
}

/// Configuration refusals name what is wrong.
#[test]
fn bad_configurations_are_refused() {
    let _serial = serial();
    let dir = Scratch::new("config");
    let check = |options: G3Options, slot: u64, want: &str| match refused(&options, slot) {
        G3Error::Config { why } => assert!(why.contains(want), "{why}"),
        other => panic!("{other:?}"),
    };
    check(options(Vec::new(), 1), SLOT, "at least one path");
    check(options(dir.paths(1), 1), 0, "slot size");
    check(
        options(dir.paths(1), 0),
        SLOT,
        "capacity per file must be positive",
    );
    check(
        G3Options {
            paths: dir.paths(1),
            capacity_bytes_per_file: SLOT * 3 / 2,
        },
        SLOT,
        "multiple of the slot size",
    );
    check(
        G3Options {
            paths: dir.paths(1),
            capacity_bytes_per_file: 1 << 63,
        },
        1 << 62,
        "largest file offset",
    );
    // No file was created by a refused configuration.
    assert!(!dir.path("g3-0").exists());
}

/// A slot size that is not a multiple of the file's direct-I/O alignment.
#[test]
fn misaligned_slot_size_is_refused() {
    let _serial = serial();
    let dir = Scratch::new("align");
    let align = G3Store::open(&options(dir.paths(1), 1), SLOT)
        .unwrap()
        .offset_alignment();
    assert!(align >= 2, "reported direct-I/O offset alignment {align}");
    let slot = align + align / 2;
    match refused(
        &G3Options {
            paths: dir.paths(1),
            capacity_bytes_per_file: slot * 2,
        },
        slot,
    ) {
        G3Error::Alignment {
            slot_bytes,
            align: a,
            path,
        } => {
            assert_eq!((slot_bytes, a), (slot, align));
            assert_eq!(path, dir.path("g3-0"));
        }
        other => panic!("{other:?}"),
    }
}

/// Aliases of one file (the same spelling, another spelling, a symlinked
/// directory, a hard link), a symlink as the file's own name, and things
/// that are not files are refused, and a refused open releases the locks it
/// took.
#[test]
fn aliases_and_non_files_are_refused() {
    let _serial = serial();
    let dir = Scratch::new("paths");
    let a = dir.path("a");
    let opts = |paths: Vec<PathBuf>| options(paths, 1);

    // The same path twice, and spelled another way.
    let e = refused(&opts(vec![a.clone(), a.clone()]), SLOT);
    assert_eq!(
        e,
        G3Error::Duplicate {
            path: a.clone(),
            same_as: a.clone()
        }
    );
    std::fs::create_dir(dir.path("sub")).unwrap();
    let other_spelling = dir.path("sub/../a");
    let e = refused(&opts(vec![a.clone(), other_spelling.clone()]), SLOT);
    assert!(
        matches!(&e, G3Error::Duplicate { path, .. } if *path == other_spelling),
        "{e:?}"
    );

    // A symlink as the file's own name is never followed (issue 40: one to
    // another user's file would be written through): refused whatever it
    // points at, an existing file, one of the store's, or nothing yet.
    std::os::unix::fs::symlink(&a, dir.path("link")).unwrap();
    let is_symlink = |e: &G3Error| match e {
        G3Error::Path { why, errno, .. } => *errno == Some(libc::ELOOP) && why.contains("symlink"),
        _ => false,
    };
    let e = refused(&opts(vec![a.clone(), dir.path("link")]), SLOT);
    assert!(is_symlink(&e), "{e:?}");
    let e = refused(&opts(vec![dir.path("link"), a.clone()]), SLOT);
    assert!(is_symlink(&e), "{e:?}");
    std::os::unix::fs::symlink(dir.path("not-yet"), dir.path("link-ahead")).unwrap();
    let e = refused(&opts(vec![dir.path("link-ahead")]), SLOT);
    assert!(is_symlink(&e), "{e:?}");
    assert!(!dir.path("not-yet").exists(), "nothing was made through it");
    // A symlinked directory above the file.
    std::os::unix::fs::symlink(&dir.0, dir.path("dirlink")).unwrap();
    let e = refused(&opts(vec![a.clone(), dir.path("dirlink/a")]), SLOT);
    assert!(matches!(e, G3Error::Duplicate { .. }), "{e:?}");

    // A hard link: refused on its own, before any lock.
    std::fs::hard_link(&a, dir.path("hard")).unwrap();
    let e = refused(&opts(vec![dir.path("hard")]), SLOT);
    assert_eq!(
        e,
        G3Error::HardLink {
            path: dir.path("hard"),
            links: 2
        }
    );
    std::fs::remove_file(dir.path("hard")).unwrap();

    // Not regular files.
    let e = refused(&opts(vec![dir.path("sub")]), SLOT);
    assert!(
        matches!(&e, G3Error::Path { why, .. } if why.contains("not a regular file")),
        "{e:?}"
    );
    let fifo = dir.path("fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let e = refused(&opts(vec![fifo]), SLOT);
    assert!(
        matches!(&e, G3Error::Path { why, .. } if why.contains("not a regular file")),
        "{e:?}"
    );
    std::os::unix::fs::symlink(dir.path("nowhere/x"), dir.path("dangling")).unwrap();
    let e = refused(&opts(vec![dir.path("dangling")]), SLOT);
    assert!(is_symlink(&e), "{e:?}");
    let e = refused(&opts(vec![dir.path("missing/x")]), SLOT);
    assert!(
        matches!(&e, G3Error::Path { why, errno: Some(libc::ENOENT), .. } if why.contains("parent")),
        "{e:?}"
    );
    let e = refused(&opts(vec![PathBuf::from("/")]), SLOT);
    assert!(matches!(e, G3Error::Path { .. }), "{e:?}");

    // Every refusal above released what it had locked: `a` opens.
    let store = G3Store::open(&opts(vec![a.clone(), dir.path("b")]), SLOT).unwrap();
    assert_eq!(
        store.paths().collect::<Vec<_>>(),
        [a.as_path(), &dir.path("b")]
    );
}

/// A directory others may write is refused, naming it, whatever its sticky
/// bit; a file of ours that was already there and that others may read or
/// write is refused; one made private opens. (Files and names of another
/// user: `tests/it/local_users.rs`, with a real second user.)
#[test]
fn shared_directories_and_exposed_files_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let _serial = serial();
    let dir = Scratch::new("local");
    let shared = dir.path("shared");
    std::fs::create_dir(&shared).unwrap();
    let file = shared.join("g3-0");
    for mode in [0o777, 0o1777, 0o770, 0o1730] {
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = refused(&options(vec![file.clone()], 1), SLOT);
        assert!(
            matches!(&e, G3Error::SharedDirectory { path, .. } if *path == shared),
            "{mode:#o}: {e:?}"
        );
        assert!(!file.exists(), "{mode:#o}: nothing is made in it");
    }
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(&file, b"").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = refused(&options(vec![file.clone()], 1), SLOT);
    assert_eq!(
        e,
        G3Error::Exposed {
            path: file.clone(),
            mode: 0o644
        }
    );
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    G3Store::open(&options(vec![file], 1), SLOT).unwrap();
}

/// A second store on a file the first holds is refused; dropping the first
/// releases the lock. A refused open releases the locks it had taken.
#[test]
fn a_second_store_on_a_locked_file_is_refused() {
    let _serial = serial();
    let dir = Scratch::new("lock");
    let paths = dir.paths(2);
    let first = G3Store::open(&options(vec![paths[1].clone()], 1), SLOT).unwrap();
    // `paths[0]` is locked, then `paths[1]` is refused: `paths[0]` is freed.
    let e = refused(&options(paths.clone(), 1), SLOT);
    assert_eq!(
        e,
        G3Error::Locked {
            path: paths[1].clone()
        }
    );
    let zero = G3Store::open(&options(vec![paths[0].clone()], 1), SLOT).unwrap();
    drop(first);
    drop(zero);
    let both = G3Store::open(&options(paths, 1), SLOT).unwrap();
    assert_eq!(both.slots(), 2);
}

/// Re-runs this binary as a child whose `child_entry` acts by `mode`.
fn child(mode: &str, path: &Path, extra: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "g3::tests::child_entry",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("KVCR_G3_CHILD", mode)
    .env("KVCR_G3_PATH", path)
    .stdout(Stdio::piped());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd
}

/// The child's report: its first `G3CHILD ` line.
fn report(stdout: impl std::io::Read) -> String {
    BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.split_once("G3CHILD ").map(|(_, r)| r.to_owned()))
        .unwrap_or_default()
}

/// Not a test of its own: the body of the child processes (a no-op unless
/// `KVCR_G3_CHILD` is set).
#[test]
fn child_entry() {
    let Ok(mode) = std::env::var("KVCR_G3_CHILD") else {
        return;
    };
    let path = PathBuf::from(std::env::var("KVCR_G3_PATH").unwrap());
    let say = |what: &str| {
        println!("\nG3CHILD {what}");
        std::io::stdout().flush().unwrap();
    };
    match mode.as_str() {
        // Hold the store until stdin closes.
        "hold" => {
            let _store = G3Store::open(&options(vec![path], 1), SLOT).unwrap();
            say("held");
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        }
        // Try to open; say how it went.
        "try" => match G3Store::open(&options(vec![path], 1), SLOT) {
            Ok(_) => say("opened"),
            Err(G3Error::Locked { .. }) => say("locked"),
            Err(e) => say(&format!("other {e}")),
        },
        // Under a file-size limit of 2 slots, write 3.
        "fsize" => {
            direct_io::limit_file_size(2 * SLOT).unwrap();
            let store = G3Store::open(&options(vec![path], 4), SLOT).unwrap();
            let src = buf(SLOT);
            let outcomes: Vec<String> = (0..3)
                .map(|slot| match store.write_slot_from(slot, &src) {
                    Ok(()) => "ok".to_owned(),
                    Err(G3Error::NoSpace { slot: s, errno, .. }) => {
                        format!("nospace:{s}:{errno}")
                    }
                    Err(e) => format!("other:{e}"),
                })
                .collect();
            say(&outcomes.join(","));
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// Locks hold across processes both ways: a child's store refuses ours
/// until it exits, and ours refuses the child's.
#[test]
fn locks_hold_across_processes() {
    let _serial = serial();
    let dir = Scratch::new("lock-proc");
    let path = dir.path("g3");
    // A child holds it.
    let mut holder = child("hold", &path, &[])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(holder.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    // libtest prints "test <name> ... " before the child's own line.
    while !line.contains("G3CHILD ") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child said nothing");
    }
    assert!(line.trim().ends_with("G3CHILD held"), "{line}");
    assert_eq!(
        refused(&options(vec![path.clone()], 1), SLOT),
        G3Error::Locked { path: path.clone() }
    );
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    // We hold it: the child is refused; then it is free again.
    let ours = G3Store::open(&options(vec![path.clone()], 1), SLOT).unwrap();
    let tried = child("try", &path, &[]).output().unwrap();
    assert_eq!(report(&tried.stdout[..]), "locked");
    drop(ours);
    let tried = child("try", &path, &[]).output().unwrap();
    assert_eq!(report(&tried.stdout[..]), "opened");
}

/// A write past the process's file-size limit (`RLIMIT_FSIZE`, `EFBIG`) is
/// a typed `NoSpace`, like a full disk; the writes before it stand.
#[test]
fn a_file_size_limit_surfaces_as_no_space() {
    let _serial = serial();
    let dir = Scratch::new("fsize");
    let path = dir.path("g3");
    let out = child("fsize", &path, &[]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        report(&out.stdout[..]),
        format!("ok,ok,nospace:2:{}", libc::EFBIG)
    );
}

/// A small ext4 filesystem on a loop device (root).
struct LoopMount {
    mnt: PathBuf,
}

impl LoopMount {
    fn new(dir: &Scratch, mib: u64) -> Result<Self, String> {
        let image = dir.path("ext4.img");
        let mnt = dir.path("mnt");
        std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
        let file = std::fs::File::create(&image).map_err(|e| e.to_string())?;
        file.set_len(mib << 20).map_err(|e| e.to_string())?;
        let run = |cmd: &mut Command| -> Result<(), String> {
            let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "{cmd:?}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            }
        };
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image))?;
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&mnt))?;
        Ok(Self { mnt })
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

/// A full filesystem: writes succeed until the disk is full, then the
/// write that hit it is `NoSpace` with `ENOSPC`; the slots written before
/// still read back. Needs root (`KVCR_TEST_ROOT=1`).
#[test]
fn a_full_filesystem_surfaces_as_no_space() {
    let _serial = serial();
    if std::env::var("KVCR_TEST_ROOT").as_deref() != Ok("1") {
        eprintln!("skipped: set KVCR_TEST_ROOT=1 (root, loop devices) to run");
        return;
    }
    let dir = Scratch::new("enospc");
    let mount = LoopMount::new(&dir, 16).unwrap_or_else(|e| panic!("KVCR_TEST_ROOT=1: {e}"));
    let slot = 1u64 << 20;
    let store = G3Store::open(
        &G3Options {
            paths: vec![mount.mnt.join("a"), mount.mnt.join("b")],
            capacity_bytes_per_file: 32 * slot,
        },
        slot,
    )
    .unwrap();
    let mut src = DirectBuf::new(slot as usize, 4096).unwrap();
    let mut written = Vec::new();
    let mut failure = None;
    for s in 0..store.slots() {
        fill(&mut src, s);
        match store.write_slot_from(s, &src) {
            Ok(()) => written.push(s),
            Err(e) => {
                failure = Some((s, e));
                break;
            }
        }
    }
    let (s, e) = failure.expect("a 16 MiB filesystem took 64 MiB");
    assert!(written.len() >= 4, "only {} slots fit", written.len());
    match e {
        G3Error::NoSpace {
            slot,
            errno,
            ref path,
        } => {
            assert_eq!((slot, errno), (s, libc::ENOSPC));
            assert_eq!(path, &mount.mnt.join(if s % 2 == 0 { "a" } else { "b" }));
        }
        other => panic!("{other:?}"),
    }
    let mut dst = DirectBuf::new(slot as usize, 4096).unwrap();
    for s in written {
        fill(&mut src, s);
        store.read_slot_into(s, &mut dst).unwrap();
        assert!(dst[..] == src[..], "slot {s}");
    }
    drop(store);
    drop(mount);
}

/// A file unlinked (or renamed away) underneath: I/O goes on working
/// through the open descriptor, and `check` reports it.
#[test]
fn a_file_removed_underneath_is_reported_by_check() {
    let _serial = serial();
    let dir = Scratch::new("gone");
    let paths = dir.paths(2);
    let store = G3Store::open(&options(paths.clone(), 2), SLOT).unwrap();
    assert_eq!(store.check(), Ok(()));
    let src = pattern(SLOT as usize, 3);
    let mut src_buf = buf(SLOT);
    src_buf.copy_from_slice(&src);
    store.write_slot_from(1, &src_buf).unwrap();

    std::fs::remove_file(&paths[1]).unwrap();
    assert_eq!(
        store.check(),
        Err(G3Error::FileGone {
            path: paths[1].clone(),
            how: G3Gone::Unlinked,
            slot: None,
            errno: None
        })
    );
    // The descriptor still reaches the inode: reads and writes succeed.
    let mut dst = buf(SLOT);
    store.read_slot_into(1, &mut dst).unwrap();
    assert_eq!(&dst[..], &src[..]);
    store.write_slot_from(3, &src_buf).unwrap();
    // A new file at the path is not ours: still gone (our inode has no name).
    std::fs::write(&paths[1], b"x").unwrap();
    assert!(matches!(
        store.check(),
        Err(G3Error::FileGone {
            how: G3Gone::Unlinked,
            ..
        })
    ));
    drop(store);

    // Renamed away: the file has a name, the path leads elsewhere.
    let store = G3Store::open(&options(vec![paths[0].clone()], 2), SLOT).unwrap();
    std::fs::rename(&paths[0], dir.path("moved")).unwrap();
    assert_eq!(
        store.check(),
        Err(G3Error::FileGone {
            path: paths[0].clone(),
            how: G3Gone::PathElsewhere,
            slot: None,
            errno: None
        })
    );
    store.sync_data().unwrap();
}

/// `submit` returns at once and calls back with every outcome; dropping
/// the store runs what was submitted and calls every callback first.
#[test]
fn submitted_batches_call_back_even_when_the_store_drops() {
    let _serial = serial();
    let dir = Scratch::new("submit");
    let store = G3Store::open(&options(dir.paths(3), 4), SLOT).unwrap();
    let srcs: Vec<TestBuffer> = (0..12).map(|i| registered(&store, SLOT, i)).collect();
    let (tx, rx) = mpsc::channel();
    for round in 0..4 {
        let items: Vec<G3Io> = srcs
            .iter()
            .enumerate()
            .map(|(i, b)| G3Io::write(i as u64, b.addr(), SLOT))
            .collect();
        let tx = tx.clone();
        // `srcs` stay registered until after the store is dropped (which
        // calls every callback), and nothing writes them.
        store.submit(items, move |outcomes| tx.send((round, outcomes)).unwrap());
    }
    // An empty batch is called back at once; a panicking callback is
    // caught and counted.
    let tx2 = tx.clone();
    store.submit(Vec::new(), move |o| tx2.send((99, o)).unwrap());
    let b = &srcs[0];
    store.submit(vec![G3Io::write(0, b.addr(), SLOT)], |_| panic!("callback"));
    drop(store);
    drop(tx);
    let mut got: Vec<(i32, Vec<Result<(), G3Error>>)> = rx.iter().collect();
    got.sort_by_key(|(r, _)| *r);
    assert_eq!(got.len(), 5);
    assert_eq!(got[4], (99, Vec::new()));
    for (_, outcomes) in &got[..4] {
        assert_eq!(outcomes.len(), 12);
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    }
}

/// A panicking callback is counted, and the workers keep serving.
#[test]
fn a_panicking_callback_is_counted() {
    let _serial = serial();
    let dir = Scratch::new("panic");
    let store = G3Store::open(&options(dir.paths(1), 2), SLOT).unwrap();
    let b = registered(&store, SLOT, 0);
    let (tx, rx) = mpsc::channel();
    // `b` stays registered until after the store is dropped, which calls
    // every callback before it is gone.
    store.submit(vec![G3Io::write(0, b.addr(), SLOT)], |_| panic!("callback"));
    store.submit(vec![G3Io::write(1, b.addr(), SLOT)], move |o| {
        tx.send(o).unwrap()
    });
    assert_eq!(rx.recv().unwrap(), vec![Ok(())]);
    drop(store);
}

/// Several threads run batches on one store at once.
#[test]
fn concurrent_batches_share_the_workers() {
    let _serial = serial();
    let dir = Scratch::new("concurrent");
    let store = G3Store::open(&options(dir.paths(2), 16), SLOT).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let store = &store;
            s.spawn(move || {
                let slots: Vec<u64> = (0..8).map(|k| t * 8 + k).collect();
                let srcs: Vec<DirectBuf> = slots
                    .iter()
                    .map(|&slot| {
                        let mut b = buf(SLOT);
                        fill(&mut b, slot);
                        b
                    })
                    .collect();
                let mut items: Vec<G3SliceIo<'_>> = slots
                    .iter()
                    .zip(&srcs)
                    .map(|(&slot, src)| G3SliceIo::Write { slot, src })
                    .collect();
                assert!(store.run_batch_slices(&mut items).iter().all(Result::is_ok));
                let mut dsts: Vec<DirectBuf> = slots.iter().map(|_| buf(SLOT)).collect();
                let mut items: Vec<G3SliceIo<'_>> = slots
                    .iter()
                    .zip(dsts.iter_mut())
                    .map(|(&slot, dst)| G3SliceIo::Read { slot, dst })
                    .collect();
                assert!(store.run_batch_slices(&mut items).iter().all(Result::is_ok));
                for (src, dst) in srcs.iter().zip(&dsts) {
                    assert!(src[..] == dst[..]);
                }
            });
        }
    });
}

/// The runner's threads share one store (`&self` API).
#[test]
fn the_store_is_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<G3Store>();
    shared::<DirectBuf>();
    shared::<G3Error>();
}

/// Error messages name the path, the slot and the OS error.
#[test]
fn errors_print_what_failed() {
    let e = G3Error::NoSpace {
        path: "/d/g3-1".into(),
        slot: 7,
        errno: libc::ENOSPC,
    };
    let text = e.to_string();
    assert!(
        text.contains("/d/g3-1") && text.contains("slot 7") && text.contains("os error 28"),
        "{text}"
    );
    assert_eq!(e.errno(), Some(libc::ENOSPC));
    let e = G3Error::Io {
        path: "/d/g3-0".into(),
        slot: 2,
        op: G3Op::Read,
        errno: libc::EIO,
    };
    assert!(e.to_string().contains("read of slot 2"), "{e}");
    assert_eq!(G3Error::Locked { path: "/x".into() }.errno(), None);
}

/// One step of the model test: a batch of distinct slots, each written with
/// a seed or read.
#[derive(Debug, Clone)]
enum Step {
    Write(u64, u64),
    Read(u64),
}

fn batch(slots: u64) -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::hash_map(
        0..slots,
        prop_oneof![any::<u64>().prop_map(Some), Just(None)],
        1..10,
    )
    .prop_map(|m| {
        m.into_iter()
            .map(|(slot, seed)| match seed {
                Some(seed) => Step::Write(slot, seed),
                None => Step::Read(slot),
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random batches of writes and reads (distinct slots per batch, as the
    /// core guarantees) against a map: every read returns the last bytes
    /// written to its slot, zeros if none (sparse files), and every item
    /// succeeds.
    #[test]
    fn batches_match_a_model(files in 1usize..4, per_file in 1u64..5, batches in proptest::collection::vec(batch(15), 1..8)) {
        let _serial = serial();
        let dir = Scratch::new("model");
        let tuning = G3Tuning { workers: 3, sizing: G3Sizing::Sparse };
        let store = G3Store::open_with(&options(dir.paths(files), per_file), SLOT, tuning).unwrap();
        let slots = store.slots();
        let mut model: HashMap<u64, u64> = HashMap::new();
        for steps in batches {
            let mut bufs: Vec<DirectBuf> = steps.iter().map(|_| buf(SLOT)).collect();
            for (step, b) in steps.iter().zip(bufs.iter_mut()) {
                if let Step::Write(_, seed) = step {
                    fill(b, *seed);
                }
            }
            let mut items: Vec<G3SliceIo<'_>> = steps
                .iter()
                .zip(bufs.iter_mut())
                .map(|(step, b)| match step {
                    Step::Write(slot, _) => G3SliceIo::Write { slot: *slot, src: b },
                    Step::Read(slot) => G3SliceIo::Read { slot: *slot, dst: b },
                })
                .collect();
            let outcomes = store.run_batch_slices(&mut items);
            drop(items);
            for ((step, outcome), b) in steps.iter().zip(&outcomes).zip(&bufs) {
                let slot = match step { Step::Write(s, _) | Step::Read(s) => *s };
                if slot >= slots {
                    prop_assert!(matches!(outcome, Err(G3Error::SlotRange { .. })), "{outcome:?}");
                    continue;
                }
                prop_assert!(outcome.is_ok(), "{:?}", outcome);
                match step {
                    Step::Write(slot, seed) => { model.insert(*slot, *seed); }
                    Step::Read(slot) => {
                        let want = match model.get(slot) {
                            Some(seed) => pattern(SLOT as usize, *seed),
                            None => vec![0; SLOT as usize],
                        };
                        prop_assert!(b[..] == want[..], "slot {} differs", slot);
                    }
                }
            }
        }
    }
}
