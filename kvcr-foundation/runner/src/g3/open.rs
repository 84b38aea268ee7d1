//! Opening one G3 file: where its name lives, who may write there, and what
//! the file it names must be before a slot touches it.
//!
//! The directory is resolved (its own symlinks are the operator's), opened,
//! and checked on that descriptor against the directory rule
//! (`crate::local_users`). The file's own name is never resolved: it is
//! opened in the directory's descriptor (`openat`), `O_NOFOLLOW`, and made
//! with `O_CREAT | O_EXCL` when it is missing, so a file this open made is
//! this process's by construction. A file that was already there must be a
//! regular file of this process's uid, readable and writable by it alone,
//! checked on the opened descriptor (`fstat`), so nothing swapped in
//! between a look and the open is used.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::{DEFAULT_DIO_ALIGN, G3Error, G3File, direct_io};
use crate::local_users;

/// The mode a G3 file is made with.
const FILE_MODE: u32 = 0o600;

pub(super) fn path_error(path: &Path, why: &'static str, errno: Option<i32>) -> G3Error {
    G3Error::Path {
        path: path.to_owned(),
        why,
        errno,
    }
}

/// Where a configured file's name lives: its directory, open and checked.
pub(super) struct Located {
    /// The directory, opened `O_DIRECTORY`; the file is opened in it.
    dir: File,
    /// The file's own name in it.
    name: OsString,
    /// The resolved directory joined with the name (compared for
    /// duplicates, re-`stat`ed by `check`; its last component is never
    /// resolved).
    pub(super) canonical: PathBuf,
}

/// Resolves `path`'s directory (not its last component), opens it and
/// applies the directory rule to it.
pub(super) fn locate(path: &Path) -> Result<Located, G3Error> {
    let name = path
        .file_name()
        .ok_or_else(|| path_error(path, "names no file", None))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir_path = std::fs::canonicalize(parent).map_err(|e| {
        path_error(
            path,
            "its parent directory does not resolve",
            e.raw_os_error(),
        )
    })?;
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(&dir_path)
        .map_err(|e| {
            path_error(
                path,
                "its parent directory cannot be opened",
                e.raw_os_error(),
            )
        })?;
    let meta = dir.metadata().map_err(|e| {
        path_error(
            path,
            "its parent directory cannot be examined",
            e.raw_os_error(),
        )
    })?;
    if let Some(why) = local_users::refusal_of(&meta) {
        return Err(G3Error::SharedDirectory {
            path: dir_path,
            why,
        });
    }
    Ok(Located {
        canonical: dir_path.join(name),
        name: name.to_owned(),
        dir,
    })
}

/// Opens (making it when missing) the located file, never through a symlink.
/// `true` when this call made it.
fn open_file(path: &Path, at: &Located) -> Result<(File, bool), G3Error> {
    use std::os::fd::AsFd;
    let opened =
        |create| kvcr_sys::direct_io::open_in_dir(at.dir.as_fd(), &at.name, libc::O_DIRECT, create);
    let result = match opened(Some(FILE_MODE)) {
        Ok(file) => Ok((file, true)),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => opened(None).map(|f| (f, false)),
        Err(e) => Err(e),
    };
    result.map_err(|e| {
        let errno = e.raw_os_error();
        let why = match errno {
            Some(libc::EISDIR) => "is not a regular file",
            Some(libc::EINVAL) => "its filesystem refuses O_DIRECT",
            Some(libc::ELOOP) => "is a symlink (a G3 file's own name is never followed)",
            _ => "cannot be opened",
        };
        path_error(path, why, errno)
    })
}

/// Opens, checks and locks one file; its memory and offset alignments.
pub(super) fn open_one(
    path: &Path,
    at: &Located,
    earlier: &[G3File],
) -> Result<(G3File, (u64, u64)), G3Error> {
    // A look before the open keeps it from opening a device or a FIFO (an
    // open can act on those); the descriptor's own `fstat` below decides.
    match std::fs::symlink_metadata(&at.canonical) {
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(path_error(
                path,
                "is a symlink (a G3 file's own name is never followed)",
                Some(libc::ELOOP),
            ));
        }
        Ok(meta) if !meta.file_type().is_file() => {
            return Err(path_error(path, "is not a regular file", None));
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(path_error(path, "cannot be examined", e.raw_os_error())),
    }
    let (file, created) = open_file(path, at)?;
    let meta = file
        .metadata()
        .map_err(|e| path_error(path, "cannot be examined", e.raw_os_error()))?;
    if !meta.file_type().is_file() {
        return Err(path_error(path, "is not a regular file", None));
    }
    // A file this call made (`O_EXCL`) is ours whatever the filesystem
    // reports as its owner (an NFS export squashing root, say).
    if !created {
        if meta.uid() != local_users::effective_uid() {
            return Err(G3Error::NotOwned {
                path: path.to_owned(),
                owner: meta.uid(),
            });
        }
        if meta.mode() & 0o077 != 0 {
            return Err(G3Error::Exposed {
                path: path.to_owned(),
                mode: meta.mode() & 0o7777,
            });
        }
    }
    if let Some(first) = earlier
        .iter()
        .find(|f| f.dev == meta.dev() && f.ino == meta.ino())
    {
        return Err(G3Error::Duplicate {
            path: path.to_owned(),
            same_as: first.path.clone(),
        });
    }
    if meta.nlink() > 1 {
        return Err(G3Error::HardLink {
            path: path.to_owned(),
            links: meta.nlink(),
        });
    }
    match direct_io::lock_exclusive(&file) {
        Ok(true) => {}
        Ok(false) => {
            return Err(G3Error::Locked {
                path: path.to_owned(),
            });
        }
        Err(errno) => return Err(path_error(path, "cannot be locked", Some(errno))),
    }
    let align = match direct_io::dio_alignment(&file) {
        Ok(Some((0, _) | (_, 0))) => {
            return Err(path_error(
                path,
                "its filesystem reports no direct-I/O support",
                None,
            ));
        }
        Ok(Some((mem, offset))) => (u64::from(mem), u64::from(offset)),
        Ok(None) => (DEFAULT_DIO_ALIGN, DEFAULT_DIO_ALIGN),
        Err(errno) => return Err(path_error(path, "cannot be examined", Some(errno))),
    };
    Ok((
        G3File {
            path: path.to_owned(),
            canonical: at.canonical.clone(),
            dev: meta.dev(),
            ino: meta.ino(),
            file,
        },
        align,
    ))
}
