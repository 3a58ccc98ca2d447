//! Tasks (leaf): background tasks owned by the part of the router that
//! starts them (a shard's committer, cache feeder and keepalive task, the
//! placement monitor, the metrics upkeep), and the deadline of the request
//! a task serves, which the HTTP layer sets and every etcd call made for
//! the request obeys, and the names the lines logged for it carry.

use std::cell::{Cell, RefCell};
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

/// What names the request a task serves on the lines logged while it is
/// served: its route's label, its id, and once known the shard it went to
/// and its outcome. Kept here rather than in a tracing span, whose fields
/// the log's formatter writes out when the span is made and as each is
/// recorded, for every request: the log reads these only when it writes a
/// line ([`request_names`]).
pub struct RequestNames {
    pub op: &'static str,
    pub id: String,
    shard: RefCell<Option<Box<str>>>,
    outcome: Cell<Option<&'static str>>,
}

impl RequestNames {
    pub fn new(op: &'static str, id: String) -> Self {
        Self {
            op,
            id,
            shard: RefCell::new(None),
            outcome: Cell::new(None),
        }
    }

    /// The shard the request went to, once known.
    pub fn shard(&self) -> Option<std::cell::Ref<'_, str>> {
        std::cell::Ref::filter_map(self.shard.borrow(), |s| s.as_deref()).ok()
    }

    /// The request's outcome, once answered.
    pub fn outcome(&self) -> Option<&'static str> {
        self.outcome.get()
    }
}

tokio::task_local! {
    /// The names of the request this task serves.
    static REQUEST_NAMES: RequestNames;
}

/// Runs `f` (the serving of one request) named by `names`. Not an `async
/// fn`: that would hold `f` twice (its argument, then the scope's), and
/// copy it from one to the other on its first poll.
pub fn naming<F: Future>(names: RequestNames, f: F) -> impl Future<Output = F::Output> {
    REQUEST_NAMES.scope(names, f)
}

/// [`naming`] for synchronous code (the log format's tests).
#[cfg(test)]
pub(crate) fn naming_sync<R>(names: RequestNames, f: impl FnOnce() -> R) -> R {
    REQUEST_NAMES.sync_scope(names, f)
}

/// Notes the shard the request being served went to.
pub fn name_shard(shard: &str) {
    let _ = REQUEST_NAMES.try_with(|n| *n.shard.borrow_mut() = Some(shard.into()));
}

/// Notes the outcome of the request being served.
pub fn name_outcome(outcome: &'static str) {
    let _ = REQUEST_NAMES.try_with(|n| n.outcome.set(Some(outcome)));
}

/// `f` of the names of the request this task serves, if it serves one.
pub fn request_names<R>(f: impl FnOnce(&RequestNames) -> R) -> Option<R> {
    REQUEST_NAMES.try_with(f).ok()
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
    async fn a_requests_names_are_seen_only_inside_its_scope() {
        assert!(request_names(|_| ()).is_none());
        name_shard("ignored");
        let names = RequestNames::new("acquire", "id-1".into());
        naming(names, async {
            let seen = || request_names(|n| (n.shard().map(|s| s.to_string()), n.outcome()));
            assert_eq!(seen(), Some((None, None)));
            name_shard("a");
            name_outcome("ok");
            assert_eq!(seen(), Some((Some("a".to_string()), Some("ok"))));
            assert_eq!(
                request_names(|n| (n.op, n.id.clone())),
                Some(("acquire", "id-1".into()))
            );
        })
        .await;
        assert!(request_names(|_| ()).is_none());
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
