//! Request-lifetime hooks and the frozen per-attempt context.

use kvcr_contracts::{AttemptLedger, ControlEndpoint, FetchHint, RequestId, hint::FetchMode};
use kvcr_linker_contracts::{NoHooks, PrefixQuery, RequestContext, RequestHooks};

use crate::{base, incarnation, key};

fn query() -> PrefixQuery {
    PrefixQuery {
        namespace: base().id(),
        device_prefix_pages: 1,
        tail: vec![key(2), key(3)],
    }
}

fn hint(first: u64) -> FetchHint {
    FetchHint {
        source: ControlEndpoint::parse("tcp://10.0.0.5:25000").unwrap(),
        block_hashes: vec![key(first), key(first + 1)],
        mode: FetchMode::Copy,
        action_id: None,
    }
}

/// Every hook defaults to doing nothing and succeeding.
#[test]
fn default_hooks_do_nothing() {
    let mut ledger = AttemptLedger::new();
    let (context, _) = RequestContext::begin(&mut ledger, RequestId("r".into()), vec![], query());
    let mut hooks = NoHooks;
    assert!(!hooks.prepares_requests());
    hooks.request_started(&context).unwrap();
    hooks.request_finished(context.attempt()).unwrap();
    hooks.request_aborted(context.attempt()).unwrap();
    hooks.reset(incarnation(2)).unwrap();
    assert_eq!(hooks, NoHooks);
}

/// A linker overrides only what it needs; the rest keep their defaults.
#[test]
fn one_hook_overridden_keeps_the_other_defaults() {
    #[derive(Default)]
    struct CountsStarts(usize);
    impl RequestHooks for CountsStarts {
        fn request_started(&mut self, _: &RequestContext) -> kvcr_linker_contracts::Result<()> {
            self.0 += 1;
            Ok(())
        }
    }
    let mut ledger = AttemptLedger::new();
    let (context, _) = RequestContext::begin(&mut ledger, RequestId("r".into()), vec![], query());
    let mut hooks = CountsStarts::default();
    hooks.request_started(&context).unwrap();
    hooks.request_aborted(context.attempt()).unwrap();
    assert_eq!(hooks.0, 1);
    assert!(!hooks.prepares_requests());
}

/// Each attempt freezes the hints it was enqueued with; a retried request id
/// gets a newer attempt, reports the one it supersedes, and its own hints.
#[test]
fn context_snapshots_the_attempts_hints() {
    let mut ledger = AttemptLedger::new();
    let (first, superseded) =
        RequestContext::begin(&mut ledger, RequestId("r".into()), vec![hint(1)], query());
    assert_eq!(superseded, None);
    let (second, superseded) =
        RequestContext::begin(&mut ledger, RequestId("r".into()), vec![hint(7)], query());
    assert_eq!(superseded.as_ref(), Some(first.attempt()));
    assert!(second.attempt().generation > first.attempt().generation);
    assert_eq!(first.hints(), &[hint(1)]);
    assert_eq!(second.hints(), &[hint(7)]);
    assert_eq!(second.snapshot().attempt(), second.attempt());
    assert_eq!(second.query(), &query());
}
