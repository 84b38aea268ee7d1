//! Unit tests of `attempt` internals.
