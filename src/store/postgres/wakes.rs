//! Waking waiters through Postgres `LISTEN`/`NOTIFY`: a waiter marks the key's row
//! ([`MARK`]), and the owner's completion or release of a marked row says so (`waited`), upon
//! which the store notifies ([`TELL`]); each process listens on one connection of its own.
//!
//! The notification is sent by the store after the completion's statement, and only for keys a
//! duplicate waits for: a completion nobody waits for takes no notify lock at its commit. Every
//! key's end is told on one channel, `tower_idempotency`, with the key's id as the payload, so a
//! waiter costs no `LISTEN` of its own. On Citus the channel is the coordinator's (the pool's
//! server): only keys a duplicate waits for pass through it, and while it is down waiters poll.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use sqlx::{
    Row,
    postgres::{PgListener, PgPoolOptions},
};
use tokio::sync::{mpsc, watch};

use super::{
    PostgresStore, STORE,
    shards::hashtext,
    sql::{MARK, TELL},
};
use crate::store::{
    BoxFuture, Marked, RecordKey, StoreError, Wake,
    wake::{Listeners, Started, Subscription},
};

/// The channel every key's end is told on.
const CHANNEL: &str = "tower_idempotency";

/// The listener's `application_name`, by which an operator (or a test) finds its session.
pub(crate) const LISTENER: &str = "tower-idempotency listener";

/// A key's id on the channel: the hashes Postgres computes of its scope and key
/// (`hashtext(scope):hashtext(key)`), short whatever their length. Two keys of one id wake
/// each other's waiters, who claim again and find theirs still held.
fn id(scope: &str, key: &str) -> String {
    format!(
        "{}:{}",
        hashtext(scope.as_bytes()),
        hashtext(key.as_bytes())
    )
}

/// The registry of the keys this process's waiters listen for, with the listener, shared by the
/// store's clones.
pub(super) type Listening = Arc<Started>;

impl crate::store::Wakes for PostgresStore {
    fn listen<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<Wake, StoreError>> {
        Box::pin(async move {
            let listeners = self.listeners();
            let id = id(record.scope(), record.key().as_str());
            let listening = listeners.listen(id).await;
            listening
                .ok_or_else(|| StoreError::backend(STORE, "the Postgres listener is not listening"))
        })
    }

    fn mark<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<Marked, StoreError>> {
        Box::pin(async move {
            let key = (record.scope(), record.key().as_str());
            let row = self
                .on_key(key, async |connection| {
                    sqlx::query(MARK)
                        .bind(key.0)
                        .bind(key.1)
                        .fetch_one(connection)
                        .await
                })
                .await?;
            let (marked, held): (bool, bool) = (
                row.try_get("marked").map_err(super::backend)?,
                row.try_get("held").map_err(super::backend)?,
            );
            Ok(match (marked, held) {
                (true, _) => Marked::Waited,
                (false, true) => Marked::Busy,
                (false, false) => Marked::Ended,
            })
        })
    }
}

impl PostgresStore {
    /// Tells the instances that listen that `keys` (scope, key), which a duplicate waits for,
    /// ended. A notification lost costs a waiter its slow poll: failures are only logged.
    pub(super) async fn tell<'k>(&self, keys: impl IntoIterator<Item = (&'k str, &'k str)>) {
        let ids: Vec<String> = keys
            .into_iter()
            .map(|(scope, key)| id(scope, key))
            .collect();
        let told = self
            .on_connection(async |connection| {
                sqlx::query(TELL).bind(&ids).execute(connection).await
            })
            .await;
        if let Err(error) = told {
            tracing::debug!(
                error = &error as &dyn std::error::Error,
                "could not tell the waiters a key ended; they poll"
            );
        }
    }

    /// The registry of the keys this process's waiters listen for, its listener started on
    /// the current runtime if none runs.
    fn listeners(&self) -> Arc<Listeners> {
        self.listening.listeners(|listeners, requests| {
            let (up, pool) = (watch::Sender::new(false), self.listener_pool());
            tokio::spawn(answer(requests, up.subscribe(), pool.clone()));
            tokio::spawn(listen(pool, listeners, up));
        })
    }

    /// A pool of one connection for the listener, to the pool's server (Citus's coordinator),
    /// named so that an operator sees it for what it is.
    fn listener_pool(&self) -> sqlx::PgPool {
        let options = (*self.pool.connect_options())
            .clone()
            .application_name(LISTENER);
        PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(self.timeout.max(Duration::from_secs(1)))
            .connect_lazy_with(options)
    }
}

/// Answers whether the listener listens (once it does, for a waiter that came while it was
/// connecting): every key is told on its one channel, so a waiter needs no subscription of its
/// own, only a listener that is up. Once the registry is gone (the store dropped), closes the
/// listener's pool, which ends the listener.
async fn answer(
    mut requests: mpsc::UnboundedReceiver<Subscription>,
    up: watch::Receiver<bool>,
    pool: sqlx::PgPool,
) {
    while let Some(request) = requests.recv().await {
        if let Subscription::Start(_, done) = request {
            let mut up = up.clone();
            tokio::spawn(async move {
                let listening = up.wait_for(|up| *up).await.is_ok_and(|up| *up);
                let _ = done.send(listening);
            });
        }
    }
    pool.close().await;
}

/// Listens on the channel, wakes the waiters of each key told, and, when the connection is
/// lost, every waiter (what was told meanwhile is lost: each claims again), then listens
/// again; until the registry is gone.
async fn listen(pool: sqlx::PgPool, registry: Weak<Listeners>, up: watch::Sender<bool>) {
    let mut pause = Duration::from_millis(50);
    while !pool.is_closed() {
        let listening = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match listening.await {
            Ok(mut listener) => {
                up.send_replace(true);
                pause = Duration::from_millis(50);
                while let Ok(Some(notification)) = listener.try_recv().await {
                    let Some(listeners) = registry.upgrade() else {
                        return;
                    };
                    listeners.wake(notification.payload());
                }
            }
            Err(error) => {
                tracing::debug!(
                    error = &error as &dyn std::error::Error,
                    "the Postgres listener could not listen; waiters poll"
                );
            }
        }
        up.send_replace(false);
        let Some(listeners) = registry.upgrade() else {
            return;
        };
        listeners.wake_all();
        drop(listeners);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}
