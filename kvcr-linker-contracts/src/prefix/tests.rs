//! Unit tests of `prefix` internals.
