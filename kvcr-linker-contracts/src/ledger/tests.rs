//! Unit tests of `ledger` internals.
