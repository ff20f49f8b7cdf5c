//! Where a program's `tracing` events go: stderr, one line each, filtered
//! by `QUIESCE_LOG` (default `warn`).
//!
//! quiesce's crates only emit events; without a subscriber every warning
//! — a fence that ran out of grace, a batch leaked because its runtime was
//! gone, a refused proof — would vanish. The `quiesce` command and the
//! examples call [`init`] (as `quiesce::logs::init`), a C program
//! `quiesce_log_to_stderr`; the Python package routes the same events to
//! `logging` with the same filter. A program that installed a subscriber of
//! its own keeps it. `QUIESCE_LOG` takes `tracing-subscriber`'s `Targets`
//! directives: a level (`info`), per-crate levels (`quiesce_batch=debug`),
//! or both (`warn,quiesce_transports=info`). Events below the filter cost
//! their call site's cached "disabled", as with no subscriber.

use tracing_subscriber::filter::Targets;
use tracing_subscriber::prelude::*;

/// The variable that sets the filter.
pub const LOG_ENV: &str = "QUIESCE_LOG";
/// The filter when [`LOG_ENV`] is unset or does not parse.
pub const DEFAULT_FILTER: &str = "warn";

/// The filter [`LOG_ENV`] asks for; if it does not parse, the default and
/// a sentence saying so (to log once a subscriber is in place).
pub fn env_filter() -> (Targets, Option<String>) {
    match std::env::var(LOG_ENV) {
        Ok(v) => match v.parse::<Targets>() {
            Ok(f) => (f, None),
            Err(e) => (
                default_filter(),
                Some(format!(
                    "{LOG_ENV}={v:?} is not a filter ({e}); logging at {DEFAULT_FILTER}"
                )),
            ),
        },
        Err(_) => (default_filter(), None),
    }
}

fn default_filter() -> Targets {
    DEFAULT_FILTER.parse().expect("the default filter parses")
}

/// Installs a subscriber that writes the events `filter` lets through to
/// stderr. False if the process has a subscriber already (it stays).
pub fn to_stderr(filter: Targets) -> bool {
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false);
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .try_init()
        .is_ok()
}

/// [`to_stderr`] with the filter from [`LOG_ENV`]; a filter that does not
/// parse is reported and replaced by the default, rather than silencing
/// the logs. False if the process has a subscriber already.
pub fn init() -> bool {
    let (filter, bad) = env_filter();
    if !to_stderr(filter) {
        return false;
    }
    if let Some(why) = bad {
        tracing::warn!("{why}");
    }
    true
}
