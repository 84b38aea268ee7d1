//! Public-contract tests of kvcr-foundation (one integration binary).

mod endpoints;
mod frames;
mod hints;
mod keys;
mod tiers;
