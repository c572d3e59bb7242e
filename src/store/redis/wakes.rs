//! Waking waiters through Redis pub/sub: a waiter marks the key's record (mark.lua), and the
//! owner's completion or release of a marked record publishes its name (complete.lua,
//! release.lua); each process listens on one connection of its own.
//!
//! On one server, every key's end is told on one channel (`{prefix}ends`, the record's name as
//! the message), which the listener subscribes to once: a waiter costs no subscription of its
//! own. On a Redis Cluster, a key's end is told on the key's own shard channel (`SPUBLISH`, the
//! record's name as the channel), so a notification stays on the key's shard, and the listener
//! subscribes to it (`SSUBSCRIBE`) while a waiter of the process waits for the key.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use ::redis::{
    AsyncConnectionConfig, Client, ProtocolVersion, PushInfo, PushKind, RedisError, Value,
    aio::MultiplexedConnection, cluster::ClusterClientBuilder, cluster_async::ClusterConnection,
};
use tokio::sync::mpsc;

use super::{
    RedisStore, STORE,
    connection::Backend,
    script::{MARK, evalsha, evaluate},
};
use crate::store::{
    BoxFuture, Marked, RecordKey, StoreError, Wake,
    wake::{Listeners, Started, Subscription},
};

/// A store's waking of waiters: the channel a server's keys end on, and the listener, started
/// by the first waiter (and again after it stopped: its runtime shut down).
#[derive(Debug)]
pub(super) struct Wakes {
    ends: Arc<str>,
    listeners: Started,
}

impl Wakes {
    pub(super) fn new(prefix: &str) -> Self {
        Self {
            ends: Arc::from(format!("{prefix}ends")),
            listeners: Started::default(),
        }
    }

    /// The command and the channel the end of the record at `key` is told with.
    pub(super) fn publish<'a>(
        &'a self,
        key: &'a str,
        backend: &Backend,
    ) -> (&'static str, &'a str) {
        match backend {
            Backend::Server { .. } => ("PUBLISH", &self.ends),
            Backend::Cluster(_) => ("SPUBLISH", key),
        }
    }
}

impl crate::store::Wakes for RedisStore {
    /// On one server, at once once the listener is subscribed; on a cluster, once its
    /// `SSUBSCRIBE` to the key's channel is confirmed (or another waiter of the process's was).
    fn listen<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<Wake, StoreError>> {
        Box::pin(async move {
            let listeners = self.listeners();
            let listening = listeners.listen(self.record_key(record)).await;
            listening
                .ok_or_else(|| StoreError::backend(STORE, "the Redis listener is not listening"))
        })
    }

    fn mark<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<Marked, StoreError>> {
        Box::pin(async move {
            let key = self.record_key(record);
            let eval = evalsha(&MARK, (&key, None), (None::<u64>, 0));
            let held: i64 = self
                .call(async |connection| evaluate(connection, &MARK, &eval).await)
                .await?;
            Ok(if held == 1 {
                Marked::Waited
            } else {
                Marked::Ended
            })
        })
    }
}

impl RedisStore {
    /// The registry of the keys this process's waiters listen for, its listener started on
    /// the current runtime if none runs.
    fn listeners(&self) -> Arc<Listeners> {
        self.wakes.listeners.listeners(|listeners, requests| {
            let listener = Listener {
                backend: self.backend.clone(),
                timeout: self.timeout.max(Duration::from_secs(1)),
                ends: Arc::clone(&self.wakes.ends),
                listeners,
            };
            tokio::spawn(listener.run(requests));
        })
    }
}

/// The task that keeps the listening connection and wakes the waiters it is told of, until
/// the registry is gone (the store dropped).
struct Listener {
    backend: Backend,
    /// How long connecting, and each command, may take.
    timeout: Duration,
    /// One server's channel.
    ends: Arc<str>,
    listeners: Weak<Listeners>,
}

/// The listening connection: to the one server, subscribed to its channel (kept open: it only
/// listens), or to the cluster.
enum Listening {
    Server { _subscribed: MultiplexedConnection },
    Cluster(ClusterConnection),
}

impl Listener {
    /// Connects, serves, and connects again when the connection is lost (every waiter then
    /// claims again: what was told meanwhile is lost), until the registry is gone.
    async fn run(self, mut requests: mpsc::UnboundedReceiver<Subscription>) {
        let mut pause = Duration::from_millis(50);
        loop {
            let (sender, mut pushes) = mpsc::unbounded_channel();
            match self.connect(sender).await {
                Ok(listening) => {
                    pause = Duration::from_millis(50);
                    if !self.serve(listening, &mut requests, &mut pushes).await {
                        return;
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, "the Redis listener could not connect; waiters poll");
                    // Meanwhile a waiter is told no: it polls.
                    while let Ok(request) = requests.try_recv() {
                        if let Subscription::Start(_, done) = request {
                            let _ = done.send(false);
                        }
                    }
                    if requests.is_closed() {
                        return;
                    }
                }
            }
            let Some(listeners) = self.listeners.upgrade() else {
                return;
            };
            listeners.wake_all();
            drop(listeners);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// A connection in RESP3, its pushes sent to `pushes`: on one server subscribed to its
    /// channel; on a cluster subscribed again to the keys waited for.
    async fn connect(
        &self,
        pushes: mpsc::UnboundedSender<PushInfo>,
    ) -> Result<Listening, RedisError> {
        let timeout = self.timeout;
        match &self.backend {
            Backend::Server { client, .. } => {
                let node = client.get_connection_info().clone();
                let settings = node.redis_settings().clone();
                let node = node.set_redis_settings(settings.set_protocol(ProtocolVersion::RESP3));
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    .set_push_sender(pushes);
                let mut connection = Client::open(node)?
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                connection.subscribe(&*self.ends).await?;
                Ok(Listening::Server {
                    _subscribed: connection,
                })
            }
            Backend::Cluster(cluster) => {
                let client = ClusterClientBuilder::new(cluster.seeds.clone())
                    .use_protocol(ProtocolVersion::RESP3)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .push_sender(pushes)
                    .build()?;
                let mut connection = client.get_async_connection().await?;
                let ids = self
                    .listeners
                    .upgrade()
                    .map(|l| l.ids())
                    .unwrap_or_default();
                for id in ids {
                    connection.ssubscribe(&id).await?;
                }
                Ok(Listening::Cluster(connection))
            }
        }
    }

    /// Serves `listening` until it is lost (`true`: connect again) or the registry is gone.
    async fn serve(
        &self,
        mut listening: Listening,
        requests: &mut mpsc::UnboundedReceiver<Subscription>,
        pushes: &mut mpsc::UnboundedReceiver<PushInfo>,
    ) -> bool {
        loop {
            tokio::select! {
                biased;
                push = pushes.recv() => {
                    let Some(push) = push else { return true };
                    if !self.told(push) {
                        return true;
                    }
                }
                request = requests.recv() => {
                    let Some(request) = request else { return false };
                    if self.subscription(&mut listening, request).await.is_err() {
                        return true;
                    }
                }
            }
        }
    }

    /// Starts or stops listening for a key: nothing to send on one server (its channel is
    /// every key's); its shard channel on a cluster.
    async fn subscription(
        &self,
        listening: &mut Listening,
        request: Subscription,
    ) -> Result<(), RedisError> {
        match (listening, request) {
            (Listening::Server { .. }, Subscription::Start(_, done)) => {
                let _ = done.send(true);
            }
            (Listening::Server { .. }, Subscription::Stop(_)) => {}
            (Listening::Cluster(connection), Subscription::Start(id, done)) => {
                let subscribed = connection.ssubscribe(&id).await;
                let _ = done.send(subscribed.is_ok());
                subscribed?;
            }
            (Listening::Cluster(connection), Subscription::Stop(id)) => {
                let listened = self.listeners.upgrade().is_some_and(|l| l.is_listened(&id));
                if !listened {
                    connection.sunsubscribe(&id).await?;
                }
            }
        }
        Ok(())
    }

    /// What Redis pushed: `false` when the connection was lost.
    fn told(&self, push: PushInfo) -> bool {
        let Some(listeners) = self.listeners.upgrade() else {
            return true;
        };
        match push.kind {
            // One server: the message is the record's name.
            PushKind::Message => {
                if let Some(Value::BulkString(key)) = push.data.get(1) {
                    listeners.wake(&String::from_utf8_lossy(key));
                }
                true
            }
            // A cluster: the channel is the record's name.
            PushKind::SMessage => {
                if let Some(Value::BulkString(key)) = push.data.first() {
                    listeners.wake(&String::from_utf8_lossy(key));
                }
                true
            }
            PushKind::Disconnection => false,
            _ => true,
        }
    }
}
