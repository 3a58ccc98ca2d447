//! Tasks (leaf): background tasks owned by the part of the router that
//! starts them (a shard's committer, cache feeder and keepalive task, the
//! placement monitor, the metrics upkeep), and the deadline of the request
//! a task serves, which the HTTP layer sets and every etcd call made for
//! the request obeys.

use std::future::Future;
use std::time::Instant;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Owns a background task: dropping the guard cancels and aborts it, so no
/// task outlives the part of the router that started it.
pub struct TaskGuard {
    task: JoinHandle<()>,
    cancel: CancellationToken,
}

impl TaskGuard {
    pub fn new(task: JoinHandle<()>, cancel: CancellationToken) -> Self {
        Self { task, cancel }
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.task.abort();
    }
}

tokio::task_local! {
    /// When the request this task serves must be answered: no etcd call
    /// made for it waits past that.
    static REQUEST_DEADLINE: Instant;
}

/// Runs `f` (a request's handler) with `deadline` as the bound of every
/// etcd call it makes in its own task.
pub async fn under_deadline<F: Future>(deadline: Instant, f: F) -> F::Output {
    REQUEST_DEADLINE.scope(deadline, f).await
}

/// The deadline of the request this task serves, if it serves one.
pub fn request_deadline() -> Option<Instant> {
    REQUEST_DEADLINE.try_with(|d| *d).ok()
}

/// Whether the request being served is past its deadline.
pub fn past_request_deadline() -> bool {
    request_deadline().is_some_and(|d| Instant::now() >= d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dropping_the_guard_cancels_and_ends_its_task() {
        let cancel = CancellationToken::new();
        let seen = cancel.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _tx = tx; // dropped when the task ends
            std::future::pending::<()>().await;
        });
        drop(TaskGuard::new(task, cancel));
        assert!(seen.is_cancelled());
        // The task was aborted: its sender is gone.
        assert!(rx.await.is_err());
    }

    #[tokio::test]
    async fn a_request_deadline_is_seen_only_inside_its_scope() {
        assert_eq!(request_deadline(), None);
        let at = Instant::now() + std::time::Duration::from_secs(1);
        assert_eq!(
            under_deadline(at, async { request_deadline() }).await,
            Some(at)
        );
        assert_eq!(request_deadline(), None);
    }
}
