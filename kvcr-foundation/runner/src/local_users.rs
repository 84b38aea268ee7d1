//! Other users of this host: the one rule for the directories that hold a
//! runner's local files and sockets (the G3 files, the guard's socket), and
//! whose descriptors a runner trusts.
//!
//! # The directory rule
//! A directory that holds a G3 file or the guard's socket is refused at
//! start, naming it, unless
//! 1. it is owned by this process's effective uid or by root, and
//! 2. neither its group nor others may write it (mode `& 0o022 == 0`).
//!
//! The sticky bit buys no exception: in a sticky shared directory (`/tmp`)
//! another user can still take a name first (a file, a symlink, a socket)
//! and the runner would then meet it at every start, so even with every
//! check below a shared directory means a refused start at best. Use a
//! directory of the runner's own (`/run/kvcr`, `$XDG_RUNTIME_DIR`, a
//! folder under the data disk's mount).
//!
//! The checks on what the runner opens in such a directory stay as the
//! second line, for names that were there before it was made private
//! (left by another user while it was open): a G3 file is opened by name in
//! the checked directory's descriptor, never through a symlink, created
//! `O_EXCL`, and a file that existed must be a regular file of the runner's
//! own uid that nobody else may read or write; the guard's socket must be
//! served by the runner's own uid or root (`SO_PEERCRED`), and every
//! descriptor a grant hands over must be owned by one of them.

use std::os::unix::fs::MetadataExt;

/// Root's uid: trusted everywhere (it can open anything anyway).
const ROOT: u32 = 0;

/// Why a directory with this owner and mode is refused for a process of
/// effective uid `me`, or `None` when it is accepted (the rule in the
/// module docs). `mode` is `st_mode` (type bits are ignored).
pub(crate) fn directory_refusal(owner: u32, mode: u32, me: u32) -> Option<&'static str> {
    if owner != me && owner != ROOT {
        return Some("is owned by another user");
    }
    if mode & 0o022 != 0 {
        return Some(
            "is writable by other users (group or other write permission; \
             the sticky bit is no exception)",
        );
    }
    None
}

/// [`directory_refusal`] of a directory's metadata, for this process.
pub(crate) fn refusal_of(meta: &std::fs::Metadata) -> Option<&'static str> {
    if !meta.is_dir() {
        return Some("is not a directory");
    }
    directory_refusal(meta.uid(), meta.mode(), effective_uid())
}

/// Whether a descriptor or peer owned by `uid` is trusted: this process's
/// effective uid, or root.
pub(crate) fn trusted_uid(uid: u32) -> bool {
    uid == effective_uid() || uid == ROOT
}

/// This process's effective uid.
pub(crate) fn effective_uid() -> u32 {
    kvcr_sys::fd_passing::effective_uid()
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::directory_refusal;

    const ME: u32 = 1000;
    const OTHER: u32 = 1001;

    /// The rule as a table: owner, mode, accepted.
    #[rstest]
    #[case::mine_private(ME, 0o700, true)]
    #[case::mine_readable(ME, 0o755, true)]
    #[case::roots_readable(0, 0o755, true)]
    #[case::mine_group_writable(ME, 0o775, false)]
    #[case::mine_world_writable(ME, 0o777, false)]
    #[case::mine_only_other_writable(ME, 0o702, false)]
    #[case::roots_sticky_shared(0, 0o1777, false)]
    #[case::mine_sticky_shared(ME, 0o1777, false)]
    #[case::mine_sticky_private(ME, 0o1755, true)]
    #[case::group_writable_sticky(0, 0o1770, false)]
    #[case::anothers_private(OTHER, 0o700, false)]
    #[case::anothers_readable(OTHER, 0o755, false)]
    #[case::setgid_mine(ME, 0o2755, true)]
    #[case::directory_type_bits(ME, 0o040_755, true)]
    #[case::directory_type_bits_shared(0, 0o041_777, false)]
    fn the_directory_rule(#[case] owner: u32, #[case] mode: u32, #[case] accepted: bool) {
        assert_eq!(directory_refusal(owner, mode, ME).is_none(), accepted);
    }

    /// Root running the runner trusts only root's directories and its own
    /// (the same uid), and still refuses shared ones.
    #[rstest]
    #[case::roots(0, 0o755, true)]
    #[case::anothers(OTHER, 0o755, false)]
    #[case::shared(0, 0o1777, false)]
    fn the_directory_rule_for_root(#[case] owner: u32, #[case] mode: u32, #[case] accepted: bool) {
        assert_eq!(directory_refusal(owner, mode, 0).is_none(), accepted);
    }

    #[test]
    fn a_refusal_names_the_reason() {
        let why = directory_refusal(OTHER, 0o755, ME).unwrap_or_default();
        assert!(why.contains("another user"), "{why}");
        let why = directory_refusal(ME, 0o1777, ME).unwrap_or_default();
        assert!(why.contains("sticky"), "{why}");
    }
}
