//! The Redis store's [`Watcher`]: Redis's client-side caching (RESP3 client tracking) tells a
//! [`CachedStore`](crate::store::CachedStore) the moment a key whose answer it serves changes.

use std::{
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use ::redis::{
    AsyncConnectionConfig, Client, ErrorKind, ProtocolVersion, PushInfo, PushKind, RedisError,
    ServerErrorKind, Value, aio::MultiplexedConnection,
};
use tokio::{
    sync::mpsc,
    time::{Instant, MissedTickBehavior},
};

use super::{RedisStore, connection::Backend, record::Record};
use crate::store::{Changes, Watch, Watcher};

/// Watches asked for and not yet sent to Redis, at most; more are dropped (their answers are
/// served for the cache's bound, as without a watcher).
const QUEUED: usize = 4096;

/// Watches sent to Redis in one pipeline, at most.
const BATCH: usize = 64;

/// Tells a [`CachedStore`](crate::store::CachedStore) in front of a [`RedisStore`] (alone, or
/// in front of Postgres in a [`TieredStore`](crate::store::TieredStore)) when an answer it serves
/// changes in Redis: [`RedisStore::watcher`].
///
/// It keeps one connection of its own to the server, in RESP3 with client tracking on (Redis 6
/// and newer, Valkey). To watch an answer it reads the key on that connection: Redis then tells
/// it of the next change to the key (the answer forgotten, its retention over, the key evicted
/// or overwritten, the database flushed), and the cache drops the answer when it is told. It
/// pings Redis every quarter of the cache's bound (at least once a second); each answer tells
/// the cache that every change before it was told. A lost connection drops every watched
/// answer, and the watcher connects again.
///
/// On a Redis Cluster it watches nothing (a tracking connection per master is not built yet):
/// the cache serves answers for its bound, as without a watcher.
#[derive(Debug, Clone)]
pub struct RedisWatcher {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    store: RedisStore,
    changes: OnceLock<Changes>,
    asks: mpsc::Sender<Watch>,
    /// Taken by the task that watches, started on the first watch (inside a runtime).
    queued: Mutex<Option<mpsc::Receiver<Watch>>>,
}

impl RedisStore {
    /// A [`Watcher`] on this store's server, for a [`CachedStore`](crate::store::CachedStore)
    /// in front of it: see [`RedisWatcher`].
    pub fn watcher(&self) -> RedisWatcher {
        let (asks, queued) = mpsc::channel(QUEUED);
        RedisWatcher {
            shared: Arc::new(Shared {
                store: self.clone(),
                changes: OnceLock::new(),
                asks,
                queued: Mutex::new(Some(queued)),
            }),
        }
    }
}

impl Watcher for RedisWatcher {
    fn start(&self, changes: Changes) {
        let _ = self.shared.changes.set(changes);
    }

    fn watch(&self, watch: Watch) {
        let Backend::Server { client, .. } = &self.shared.store.backend else {
            return;
        };
        let Some(changes) = self.shared.changes.get() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let queued = self.shared.queued.lock();
        if let Some(queued) = queued.unwrap_or_else(PoisonError::into_inner).take() {
            let tracking = Tracking {
                client: client.clone(),
                store: self.shared.store.clone(),
                changes: changes.clone(),
            };
            runtime.spawn(tracking.run(queued));
        }
        // Full: this answer is served for the cache's bound, as without a watcher.
        let _ = self.shared.asks.try_send(watch);
    }
}

/// The task that keeps the tracking connection, and tells the cache what Redis tells it.
struct Tracking {
    client: Client,
    store: RedisStore,
    changes: Changes,
}

/// Whether the server refused RESP3 or client tracking (`ERR unknown …`), rather than being
/// out of reach.
fn refused(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
}

/// Why a tracking connection ended.
enum Ended {
    /// The cache is gone: stop.
    Closed,
    /// The connection failed, or Redis said something that needs a new one.
    Lost,
}

impl Tracking {
    async fn run(self, mut queued: mpsc::Receiver<Watch>) {
        let mut pause = Duration::from_millis(50);
        while !self.changes.is_closed() {
            let ended = match self.connect().await {
                Ok((connection, pushes)) => {
                    pause = Duration::from_millis(50);
                    self.track(connection, pushes, &mut queued).await
                }
                Err(error) if refused(&error) => {
                    // Refused, not unreachable (a server without client tracking): answers
                    // are served for the cache's bound, as without a watcher.
                    tracing::warn!(%error, "Redis refused client tracking; the cache keeps to its bound");
                    return;
                }
                Err(error) => {
                    tracing::debug!(%error, "the Redis watcher could not connect");
                    Ended::Lost
                }
            };
            // What was watched on the lost connection is told no longer.
            self.changes.lost_track();
            if let Ended::Closed = ended {
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// A connection in RESP3 with client tracking on, and where its pushes arrive.
    async fn connect(
        &self,
    ) -> Result<(MultiplexedConnection, mpsc::UnboundedReceiver<PushInfo>), RedisError> {
        let info = self.client.get_connection_info().clone();
        let settings = info.redis_settings().clone();
        let info = info.set_redis_settings(settings.set_protocol(ProtocolVersion::RESP3));
        let (sender, pushes) = mpsc::unbounded_channel();
        let timeout = self.store.timeout;
        let config = AsyncConnectionConfig::new()
            .set_push_sender(sender)
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(timeout.max(Duration::from_secs(1))));
        let mut connection = Client::open(info)?
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        ::redis::cmd("CLIENT")
            .arg("TRACKING")
            .arg("ON")
            .query_async::<()>(&mut connection)
            .await?;
        Ok((connection, pushes))
    }

    /// Serves one connection until it is lost or the cache is gone.
    async fn track(
        &self,
        mut connection: MultiplexedConnection,
        mut pushes: mpsc::UnboundedReceiver<PushInfo>,
        queued: &mut mpsc::Receiver<Watch>,
    ) -> Ended {
        let bound = self.changes.bound().unwrap_or(Duration::ZERO);
        let every = (bound / 4).clamp(Duration::from_millis(5), Duration::from_secs(1));
        let mut ping = tokio::time::interval(every);
        ping.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            tokio::select! {
                biased;
                push = pushes.recv() => {
                    if !push.is_some_and(|push| self.told(push)) {
                        return Ended::Lost;
                    }
                }
                _ = ping.tick() => {
                    if self.changes.is_closed() {
                        return Ended::Closed;
                    }
                    let sent = Instant::now();
                    let pong = ::redis::cmd("PING").query_async::<()>(&mut connection).await;
                    match pong {
                        Ok(()) => self.changes.heard_since(sent),
                        Err(_) => return Ended::Lost,
                    }
                }
                count = queued.recv_many(&mut batch, BATCH) => {
                    if count == 0 {
                        return Ended::Closed;
                    }
                    if self.read(&mut connection, &mut batch).await.is_err() {
                        return Ended::Lost;
                    }
                }
            }
        }
    }

    /// What Redis pushed: `false` when the connection must be made again.
    fn told(&self, push: PushInfo) -> bool {
        match push.kind {
            PushKind::Invalidate => {
                match push.data.into_iter().next() {
                    Some(Value::Array(keys)) => {
                        for key in keys {
                            if let Value::BulkString(key) = key
                                && let Some(record) = self.store.parse_record_key(&key)
                            {
                                self.changes.changed(&record);
                            }
                        }
                    }
                    // A flush: every key changed.
                    _ => self.changes.all_changed(),
                }
                true
            }
            PushKind::Disconnection => false,
            _ => true,
        }
    }

    /// Reads the keys of `batch` on the tracking connection, so that Redis tells of their next
    /// change, and tells the cache which still hold the answer it keeps.
    async fn read(
        &self,
        connection: &mut MultiplexedConnection,
        batch: &mut Vec<Watch>,
    ) -> Result<(), RedisError> {
        let mut pipeline = ::redis::pipe();
        for watch in batch.iter() {
            pipeline
                .cmd("GET")
                .arg(self.store.record_key(watch.record()));
        }
        let values: Vec<Option<Vec<u8>>> = pipeline.query_async(connection).await?;
        for (watch, value) in batch.drain(..).zip(values) {
            let holds = value.as_deref().and_then(|value| Record::parse(value).ok());
            let holds = holds.is_some_and(|record| {
                record.matches(watch.fingerprint())
                    && record.response().ok().flatten().as_ref() == Some(watch.response())
            });
            if holds {
                self.changes.watching(&watch);
            }
        }
        Ok(())
    }
}
