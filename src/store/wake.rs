//! Waking the duplicates that wait for a key, wherever in the fleet they are: what a store that
//! tells of a key's end hands a waiter ([`Wake`], [`Marked`]), and the registry of the keys a
//! process listens for ([`Listeners`]), which each such store keeps its subscriptions in.
//!
//! A store that wakes waiters does it in two halves. A waiter *listens* for the key (the store
//! subscribes, once per process and key, on one connection per process: Redis pub/sub, Postgres
//! `LISTEN`), then *marks* the key's record as waited for; the owner's completion or release of
//! a marked record, and only of a marked one, publishes the key's end. A completion nobody waits
//! for costs nothing more, and the notification carries no answer: the woken waiter claims
//! again, and the store answers it.

// The registry serves the stores that listen (Redis, Postgres); without them, only `Wake` and
// `Marked` are used, by the layer and by stores of one's own.
#![cfg_attr(
    not(any(feature = "redis", feature = "postgres")),
    expect(dead_code, reason = "the registry is the Redis and Postgres stores'")
)]

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError, Weak},
    time::Duration,
};

use tokio::sync::{Notify, mpsc, oneshot};

/// What a waiter holds while it listens for a key's end ([`Wakes::listen`](super::Wakes::listen)):
/// [`notified`](Self::notified) resolves when the store says the key ended (completed,
/// released) or that it may have missed saying so (its connection was lost). Dropping the last
/// `Wake` of a key in a process stops listening for it.
#[derive(Debug)]
pub struct Wake {
    listened: Arc<Listened>,
}

impl Wake {
    /// Resolves at the next word of the key's end. Create it (and
    /// [`enable`](tokio::sync::futures::Notified::enable) it) before the claim or the mark that
    /// could see the key end, so that no word between them is missed.
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.listened.notify.notified()
    }
}

/// What marking a record found ([`Wakes::mark`](super::Wakes::mark)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Marked {
    /// The key is held (in flight or committed, its lease alive) and its record marked: its
    /// end will be told to the listeners.
    Waited,
    /// The key is not held: completed, released, expired or gone. Claim again now.
    Ended,
    /// The record is locked by a transaction (the owner's fence, about to commit): mark again
    /// in a moment.
    Busy,
}

/// A key a process listens for: the waiters' notification, and whether the store's listener
/// has subscribed for it.
#[derive(Debug)]
struct Listened {
    id: String,
    notify: Notify,
    /// Told once the subscription is confirmed (or failed).
    confirmed: Notify,
    state: Mutex<Confirmation>,
    registry: Weak<Listeners>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Confirmation {
    Pending,
    Listening,
    Failed,
}

impl Drop for Listened {
    fn drop(&mut self) {
        if let Some(registry) = self.registry.upgrade() {
            registry.forget(&self.id);
        }
    }
}

/// What the store's listening task is asked to do.
#[derive(Debug)]
#[cfg_attr(
    not(feature = "redis"),
    expect(dead_code, reason = "the ids are a Redis Cluster's channels")
)]
pub(crate) enum Subscription {
    /// Listen for `id`; say on `done` whether it does.
    Start(String, oneshot::Sender<bool>),
    /// Stop listening for `id` (unless a waiter listens for it again meanwhile: see
    /// [`Listeners::is_listened`]).
    Stop(String),
}

/// The keys a process listens for, by the id the store publishes their end under (a Redis
/// channel, a Postgres payload), shared by a store and its listening task: one subscription per
/// process and key, whatever the number of waiters.
#[derive(Debug)]
pub(crate) struct Listeners {
    keys: Mutex<HashMap<String, Weak<Listened>>>,
    task: mpsc::UnboundedSender<Subscription>,
}

/// A store's registry and the task that serves it, started by the first waiter and again once
/// that task stopped (its runtime shut down): what each store that listens keeps, whatever its
/// connection.
#[derive(Debug, Default)]
pub(crate) struct Started(Mutex<Option<Arc<Listeners>>>);

impl Started {
    /// The registry whose task runs, or a new one, whose task `start` spawns with the registry
    /// it serves (held weakly: the task ends when the store is gone) and what it is asked.
    pub(crate) fn listeners(
        &self,
        start: impl FnOnce(Weak<Listeners>, mpsc::UnboundedReceiver<Subscription>),
    ) -> Arc<Listeners> {
        let mut running = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(listeners) = running.as_ref().filter(|listeners| listeners.is_served()) {
            return Arc::clone(listeners);
        }
        let (listeners, requests) = Listeners::new();
        start(Arc::downgrade(&listeners), requests);
        *running = Some(Arc::clone(&listeners));
        listeners
    }
}

/// How long a waiter waits for its subscription to be confirmed before it does without.
const CONFIRMATION: Duration = Duration::from_secs(1);

impl Listeners {
    /// A registry, and the receiving end of what its task is asked to do.
    pub(crate) fn new() -> (Arc<Self>, mpsc::UnboundedReceiver<Subscription>) {
        let (task, requests) = mpsc::unbounded_channel();
        let keys = Mutex::default();
        (Arc::new(Self { keys, task }), requests)
    }

    /// Listens for `id`: a [`Wake`] once the task subscribed for it (at once, where another
    /// waiter of the process listens already), `None` if it could not (the task is gone, or its
    /// server did not confirm within a second).
    pub(crate) async fn listen(self: &Arc<Self>, id: String) -> Option<Wake> {
        let (listened, new) = {
            let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
            match keys.get(&id).and_then(Weak::upgrade) {
                Some(listened) => (listened, false),
                None => {
                    let listened = Arc::new(Listened {
                        id: id.clone(),
                        notify: Notify::new(),
                        confirmed: Notify::new(),
                        state: Mutex::new(Confirmation::Pending),
                        registry: Arc::downgrade(self),
                    });
                    keys.insert(id.clone(), Arc::downgrade(&listened));
                    (listened, true)
                }
            }
        };
        if new {
            let (done, confirmed) = oneshot::channel();
            self.task.send(Subscription::Start(id, done)).ok()?;
            let listening = tokio::time::timeout(CONFIRMATION, confirmed).await;
            let state = match listening {
                Ok(Ok(true)) => Confirmation::Listening,
                _ => Confirmation::Failed,
            };
            *listened
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = state;
            listened.confirmed.notify_waiters();
        } else {
            let confirmed = listened.confirmed.notified();
            let state = *listened
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if state == Confirmation::Pending {
                let _ = tokio::time::timeout(CONFIRMATION, confirmed).await;
            }
        }
        let state = *listened
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        (state == Confirmation::Listening).then_some(Wake { listened })
    }

    /// Wakes the waiters of `id`: the store said the key ended.
    pub(crate) fn wake(&self, id: &str) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(listened) = keys.get(id).and_then(Weak::upgrade) {
            listened.notify.notify_waiters();
        }
    }

    /// Wakes every waiter: the listener's connection was lost, and with it any word sent
    /// meanwhile. Each claims again at once.
    pub(crate) fn wake_all(&self) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        for listened in keys.values().filter_map(Weak::upgrade) {
            listened.notify.notify_waiters();
        }
    }

    /// Whether a waiter of this process listens for `id`: a subscription asked to stop is kept
    /// if one started listening again meanwhile.
    #[cfg_attr(
        not(feature = "redis"),
        expect(dead_code, reason = "a Redis Cluster's")
    )]
    pub(crate) fn is_listened(&self, id: &str) -> bool {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        keys.get(id)
            .is_some_and(|listened| listened.strong_count() > 0)
    }

    /// Whether its task still runs (its runtime did not shut down).
    pub(crate) fn is_served(&self) -> bool {
        !self.task.is_closed()
    }

    /// The ids waiters listen for: what a listener that connected again subscribes to anew.
    #[cfg_attr(
        not(feature = "redis"),
        expect(dead_code, reason = "a Redis Cluster's")
    )]
    pub(crate) fn ids(&self) -> Vec<String> {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let listened = keys
            .iter()
            .filter(|(_, listened)| listened.strong_count() > 0);
        listened.map(|(id, _)| id.clone()).collect()
    }

    /// The last waiter of `id` is gone: its entry goes, and the task stops listening.
    fn forget(&self, id: &str) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if keys
            .get(id)
            .is_some_and(|listened| listened.strong_count() == 0)
        {
            keys.remove(id);
            let _ = self.task.send(Subscription::Stop(id.to_owned()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that confirms every subscription, and says what it was asked.
    fn confirming(
        mut requests: mpsc::UnboundedReceiver<Subscription>,
    ) -> mpsc::UnboundedReceiver<String> {
        let (said, heard) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(request) = requests.recv().await {
                let _ = match request {
                    Subscription::Start(id, done) => {
                        let _ = done.send(true);
                        said.send(format!("start {id}"))
                    }
                    Subscription::Stop(id) => said.send(format!("stop {id}")),
                };
            }
        });
        heard
    }

    #[tokio::test]
    async fn one_subscription_per_key_whatever_the_waiters_and_woken_together() {
        let (listeners, requests) = Listeners::new();
        let mut heard = confirming(requests);
        let first = listeners.listen("k".into()).await.expect("listening");
        let second = listeners.listen("k".into()).await.expect("listening");
        assert_eq!(heard.recv().await.unwrap(), "start k");
        {
            let (a, b) = (first.notified(), second.notified());
            tokio::pin!(a, b);
            a.as_mut().enable();
            b.as_mut().enable();
            listeners.wake("k");
            a.await;
            b.await;
        }
        drop(first);
        assert!(listeners.is_listened("k"));
        drop(second);
        assert_eq!(heard.recv().await.unwrap(), "stop k");
        assert!(!listeners.is_listened("k"));
    }

    #[tokio::test]
    async fn a_subscription_the_task_refuses_is_no_wake() {
        let (listeners, mut requests) = Listeners::new();
        tokio::spawn(async move {
            while let Some(Subscription::Start(_, done)) = requests.recv().await {
                let _ = done.send(false);
            }
        });
        assert!(listeners.listen("k".into()).await.is_none());
    }
}
