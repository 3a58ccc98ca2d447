//! Background tasks owned by the part of the router that starts them
//! (leaf): a shard's committer, cache feeder and keepalive task, the
//! placement monitor, the metrics upkeep.

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
}
