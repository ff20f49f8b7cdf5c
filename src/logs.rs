//! Where a program's `tracing` events go: stderr, one line each, filtered
//! by `QUIESCE_LOG` (default `warn`). The `quiesce` command and the
//! examples call [`init`]; a program embedding quiesce that has its own
//! subscriber keeps it (quiesce's crates only emit events).
//!
//! Without a subscriber every warning the crates log — a fence that ran out
//! of grace, a batch leaked because its runtime was gone, a peer refused —
//! would vanish. `QUIESCE_LOG` takes `tracing-subscriber`'s `Targets`
//! directives: a level (`info`), per-crate levels (`quiesce_batch=debug`),
//! or both (`warn,quiesce_transports=info`). Events below the filter cost
//! their call site's cached "disabled", as with no subscriber.

use tracing_subscriber::filter::Targets;
use tracing_subscriber::prelude::*;

/// The variable that sets the filter.
pub const LOG_ENV: &str = "QUIESCE_LOG";
/// The filter when [`LOG_ENV`] is unset.
const DEFAULT: &str = "warn";

/// Installs the stderr subscriber, unless the process has one. A filter
/// that does not parse is reported and replaced by the default, rather
/// than silencing the logs.
pub fn init() {
    let (filter, bad) = match std::env::var(LOG_ENV) {
        Ok(v) => match v.parse::<Targets>() {
            Ok(f) => (f, None),
            Err(e) => (default_filter(), Some((v, e))),
        },
        Err(_) => (default_filter(), None),
    };
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false);
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .try_init();
    if let Some((v, e)) = bad {
        tracing::warn!("{LOG_ENV}={v:?} is not a filter ({e}); logging at {DEFAULT}");
    }
}

fn default_filter() -> Targets {
    DEFAULT.parse().expect("the default filter parses")
}
