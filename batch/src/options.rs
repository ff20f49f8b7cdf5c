//! How a batch behaves: deadline, failure policy, retries, fence grace, size.

use std::time::Duration;

/// What a task failure does to the rest of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Let every other task finish; report all results.
    #[default]
    Drain,
    /// Fence the rest at once (remote fence, then local teardown if needed).
    FailFast,
}

/// Retries of failed tasks, each only after the whole batch has quiesced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Extra attempts after the first (0: no retry).
    pub attempts: u32,
    /// Wait before the first retry; doubled for each later one.
    pub backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 0,
            backoff: Duration::from_millis(1),
        }
    }
}

/// The longest wait a batch keeps: a deadline, fence grace or retry backoff
/// past it is taken as it.
pub use quiesce_runtime::time::LONGEST_WAIT;

/// Batch settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOptions {
    /// After this long the batch fences whatever is still in flight.
    pub deadline: Option<Duration>,
    /// See [`FailurePolicy`].
    pub policy: FailurePolicy,
    /// See [`RetryPolicy`].
    pub retry: RetryPolicy,
    /// How long a fence may take. Halfway through, a remote fence that has
    /// not brought every task home is backed by a local teardown of the
    /// peers' connections; at the end the outcome is `CompletionUnknown`.
    pub fence_grace: Duration,
    /// Most tasks in one batch; adding more is a typed error.
    pub max_tasks: usize,
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            deadline: None,
            policy: FailurePolicy::Drain,
            retry: RetryPolicy::default(),
            fence_grace: Duration::from_millis(200),
            max_tasks: 4096,
        }
    }
}

impl BatchOptions {
    /// These options with every wait at most [`LONGEST_WAIT`]: what a
    /// batch runs with, however its fields were set.
    pub(crate) fn bounded(mut self) -> Self {
        // Whole seconds decide it (cheaper than comparing Durations, on
        // every batch).
        let bound = |d: &mut Duration| {
            if d.as_secs() >= LONGEST_WAIT.as_secs() {
                *d = LONGEST_WAIT;
            }
        };
        if let Some(d) = &mut self.deadline {
            bound(d);
        }
        bound(&mut self.fence_grace);
        bound(&mut self.retry.backoff);
        self
    }

    /// Sets the deadline.
    pub fn deadline(mut self, d: Duration) -> Self {
        self.deadline = Some(d);
        self
    }

    /// Sets the failure policy.
    pub fn policy(mut self, p: FailurePolicy) -> Self {
        self.policy = p;
        self
    }

    /// Sets retries.
    pub fn retry(mut self, attempts: u32, backoff: Duration) -> Self {
        self.retry = RetryPolicy { attempts, backoff };
        self
    }

    /// Sets the fence grace.
    pub fn fence_grace(mut self, d: Duration) -> Self {
        self.fence_grace = d;
        self
    }

    /// Sets the task limit.
    pub fn max_tasks(mut self, n: usize) -> Self {
        self.max_tasks = n;
        self
    }

    /// Raises the task limit to hold `n` tasks, never lowers it: for a
    /// call whose own array of `n` entries is the batch's bound (the C
    /// ABI's and Python's calls; a KV cache's blocks times its layers pass
    /// the default of 4,096).
    ///
    /// ```
    /// use quiesce_batch::BatchOptions;
    /// let opts = BatchOptions::default().max_tasks(64);
    /// assert_eq!(opts.room_for(10_000).max_tasks, 10_000);
    /// assert_eq!(opts.room_for(8).max_tasks, 64);
    /// ```
    pub fn room_for(self, n: usize) -> Self {
        let at_least = n.max(self.max_tasks);
        self.max_tasks(at_least)
    }
}
