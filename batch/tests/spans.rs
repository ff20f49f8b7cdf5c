//! Each batch's events are filed under its own span: a driver suspended in
//! an await leaves no span entered on the thread for another batch's
//! events to land in.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use quiesce_batch::sim::{Sim, SimConfig, SimTarget};
use quiesce_batch::{Batch, BatchOptions};
use quiesce_runtime::Runtime;
use tracing::span::{Attributes, Id};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;

/// A batch span (marked in the span's extensions).
struct BatchSpan;

/// For each event: how many batch spans enclose it.
#[derive(Clone, Default)]
struct Nesting(Arc<Mutex<Vec<(String, usize)>>>);

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        if f.name() == "message" {
            self.0 = format!("{v:?}");
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Nesting {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() == "batch" {
            ctx.span(id).unwrap().extensions_mut().insert(BatchSpan);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let batches = ctx.event_scope(event).map_or(0, |scope| {
            scope
                .filter(|s| s.extensions().get::<BatchSpan>().is_some())
                .count()
        });
        let mut m = Message(String::new());
        event.record(&mut m);
        self.0.lock().unwrap().push((m.0, batches));
    }
}

#[test]
fn interleaved_batches_log_under_their_own_spans() {
    let nesting = Nesting::default();
    let subscriber = tracing_subscriber::registry().with(nesting.clone());
    tracing::subscriber::with_default(subscriber, || {
        Runtime::new().unwrap().block_on(async {
            // Every transfer fails (retryably): each batch logs as it
            // fences, and again as it retries after a backoff.
            let cfg = SimConfig {
                retryable_fail: 100,
                max_turns: 6,
                ..SimConfig::reliable(6)
            };
            let sim = Sim::new(3, cfg);
            let submit = |seed: u64| {
                let opts = BatchOptions::default().retry(2, Duration::from_millis(1 + seed));
                let mut b = Batch::new(sim.clone(), opts);
                for _ in 0..3 {
                    b.write(vec![0u8; 64], SimTarget { peer: 0, len: 64 })
                        .ok()
                        .unwrap();
                }
                b.submit()
            };
            let (a, b) = (submit(0), submit(1));
            let both = quiesce_runtime::spawn_local(a);
            let _ = b.await;
            let _ = both.await;
        });
    });
    let events = nesting.0.lock().unwrap();
    assert!(
        events.iter().filter(|(_, n)| *n >= 1).count() >= 4,
        "the batches logged under their spans: {events:?}"
    );
    let nested: Vec<_> = events.iter().filter(|(_, n)| *n > 1).collect();
    assert!(
        nested.is_empty(),
        "events under another batch's span: {nested:?}"
    );
}
