//! The Redis store's [`Watcher`]: Redis's client-side caching (RESP3 client tracking) tells a
//! [`CachedStore`](crate::store::CachedStore) the moment a key whose answer it serves changes.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use ::redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, ErrorKind, ProtocolVersion,
    PushInfo, PushKind, RedisError, RedisResult, ServerErrorKind, Value,
    aio::MultiplexedConnection, cluster_routing::Slot,
};
use tokio::{
    sync::mpsc,
    time::{Instant, MissedTickBehavior},
};

use super::{
    RedisStore,
    connection::{Backend, slot_ranges},
    record::Record,
};
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
/// On a Redis Cluster it keeps one such connection to each master, reads each key on the
/// master of its slot (the slots as `CLUSTER SLOTS` gave them when it connected), and hears
/// from the cluster only when every master answered its ping. A read the cluster redirects for
/// good (`MOVED`: its slots moved since), or any master's connection lost, drops every watched
/// answer, and the watcher connects again with the slots as they are then. A key whose slot is
/// being migrated (`ASK`) is left unwatched, and served for the cache's bound.
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
        let Some(changes) = self.shared.changes.get() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let queued = self.shared.queued.lock();
        if let Some(queued) = queued.unwrap_or_else(PoisonError::into_inner).take() {
            let (seeds, cluster) = match &self.shared.store.backend {
                Backend::Server { client, .. } => {
                    (vec![client.get_connection_info().clone()], false)
                }
                Backend::Cluster(cluster) => (cluster.seeds.clone(), true),
            };
            let tracking = Tracking {
                seeds,
                cluster,
                store: self.shared.store.clone(),
                changes: changes.clone(),
            };
            runtime.spawn(tracking.run(queued));
        }
        // Full: this answer is served for the cache's bound, as without a watcher.
        let _ = self.shared.asks.try_send(watch);
    }
}

/// The task that keeps the tracking connections, and tells the cache what Redis tells it.
struct Tracking {
    /// The server, or the cluster's seeds.
    seeds: Vec<ConnectionInfo>,
    cluster: bool,
    store: RedisStore,
    changes: Changes,
}

/// The tracking connections: one to the server, or one to each master of a cluster.
struct Connections {
    nodes: Vec<MultiplexedConnection>,
    /// On a cluster, the node (in `nodes`) serving each slot.
    slots: Option<HashMap<Slot, usize>>,
}

impl Connections {
    /// The node that serves `key`: `None` on a cluster whose slots did not cover it.
    fn node_of(&self, key: &str) -> Option<usize> {
        match &self.slots {
            None => Some(0),
            Some(slots) => slots.get(&Slot::for_key(key)).copied(),
        }
    }
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
                Ok((connections, pushes)) => {
                    pause = Duration::from_millis(50);
                    self.track(connections, pushes, &mut queued).await
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

    /// The tracking connections, and where their pushes arrive.
    async fn connect(
        &self,
    ) -> Result<(Connections, mpsc::UnboundedReceiver<PushInfo>), RedisError> {
        let (sender, pushes) = mpsc::unbounded_channel();
        let (masters, slots) = if self.cluster {
            let (masters, slots) = self.slot_map().await?;
            (masters, Some(slots))
        } else {
            (self.seeds.clone(), None)
        };
        let mut nodes = Vec::with_capacity(masters.len());
        for master in masters {
            nodes.push(self.tracking(master, &sender).await?);
        }
        Ok((Connections { nodes, slots }, pushes))
    }

    /// A connection's settings: the store's timeouts.
    fn config(&self) -> AsyncConnectionConfig {
        let timeout = self.store.timeout;
        AsyncConnectionConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(timeout.max(Duration::from_secs(1))))
    }

    /// A connection to `node` in RESP3 with client tracking on, its pushes sent to `pushes`.
    async fn tracking(
        &self,
        node: ConnectionInfo,
        pushes: &mpsc::UnboundedSender<PushInfo>,
    ) -> Result<MultiplexedConnection, RedisError> {
        let settings = node.redis_settings().clone();
        let node = node.set_redis_settings(settings.set_protocol(ProtocolVersion::RESP3));
        let config = self.config().set_push_sender(pushes.clone());
        let mut connection = Client::open(node)?
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        ::redis::cmd("CLIENT")
            .arg("TRACKING")
            .arg("ON")
            .query_async::<()>(&mut connection)
            .await?;
        Ok(connection)
    }

    /// The cluster's masters, and the master (among them) of each slot, from the first seed
    /// that answers `CLUSTER SLOTS`.
    async fn slot_map(&self) -> Result<(Vec<ConnectionInfo>, HashMap<Slot, usize>), RedisError> {
        let mut failed = None;
        for seed in &self.seeds {
            let asked = async {
                let client = Client::open(seed.clone())?;
                let mut connection = client
                    .get_multiplexed_async_connection_with_config(&self.config())
                    .await?;
                let slots: Vec<Vec<Value>> = ::redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async(&mut connection)
                    .await?;
                parse_slots(seed, slots)
            };
            match asked.await {
                Ok(map) => return Ok(map),
                Err(error) if refused(&error) => return Err(error),
                Err(error) => failed = Some(error),
            }
        }
        Err(failed.unwrap_or_else(|| (ErrorKind::Client, "a cluster without seeds").into()))
    }

    /// Serves the connections until one is lost or the cache is gone.
    async fn track(
        &self,
        mut connections: Connections,
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
                    for connection in &mut connections.nodes {
                        let pong = ::redis::cmd("PING").query_async::<()>(connection).await;
                        if pong.is_err() {
                            return Ended::Lost;
                        }
                    }
                    // Every node answered: each told all it had to tell before.
                    self.changes.heard_since(sent);
                }
                count = queued.recv_many(&mut batch, BATCH) => {
                    if count == 0 {
                        return Ended::Closed;
                    }
                    if self.read(&mut connections, &mut batch).await.is_err() {
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

    /// Reads the keys of `batch` on the tracking connections (each on its master's), so that
    /// Redis tells of their next change, and tells the cache which still hold the answer it
    /// keeps. A key a cluster moved (`MOVED`) fails the read: the slots changed. A key in a
    /// slot being migrated (`ASK`) is left unwatched.
    async fn read(
        &self,
        connections: &mut Connections,
        batch: &mut Vec<Watch>,
    ) -> Result<(), RedisError> {
        let keys: Vec<String> = batch
            .iter()
            .map(|watch| self.store.record_key(watch.record()))
            .collect();
        let nodes: Vec<Option<usize>> = keys.iter().map(|key| connections.node_of(key)).collect();
        for (node, connection) in connections.nodes.iter_mut().enumerate() {
            let mine: Vec<usize> = (0..keys.len())
                .filter(|&i| nodes[i] == Some(node))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let mut pipeline = ::redis::pipe();
            for &i in &mine {
                pipeline.cmd("GET").arg(&keys[i]);
            }
            let values: Vec<RedisResult<Option<Vec<u8>>>> =
                pipeline.ignore_errors().query_async(connection).await?;
            for (i, value) in mine.into_iter().zip(values) {
                match value {
                    Ok(value) => self.holds(&batch[i], value.as_deref()),
                    // Its slot is migrating: left unwatched (served for the bound), the others
                    // kept; the slots are read again when a key is moved for good (`MOVED`).
                    Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::Ask) => {}
                    Err(error) => return Err(error),
                }
            }
        }
        batch.clear();
        Ok(())
    }

    /// Tells the cache that `watch` is watched if the record read, `value`, holds its answer.
    fn holds(&self, watch: &Watch, value: Option<&[u8]>) {
        let record = value.and_then(|value| Record::parse(value).ok());
        let holds = record.is_some_and(|record| {
            record.matches(watch.fingerprint())
                && record.response().ok().flatten().as_ref() == Some(watch.response())
        });
        if holds {
            self.changes.watching(watch);
        }
    }
}

/// The masters and the master of each slot, from `CLUSTER SLOTS` as `seed` answered it: each
/// entry a slot range and its master (host, port, …), then its replicas. A master is reached
/// with the seed's settings (credentials, TLS) at its own address.
fn parse_slots(
    seed: &ConnectionInfo,
    ranges: Vec<Vec<Value>>,
) -> Result<(Vec<ConnectionInfo>, HashMap<Slot, usize>), RedisError> {
    let mut masters: Vec<(String, u16)> = Vec::new();
    let mut slots = HashMap::new();
    for ((start, end), address) in slot_ranges(ranges)? {
        let node = masters
            .iter()
            .position(|m| *m == address)
            .unwrap_or_else(|| {
                masters.push(address);
                masters.len() - 1
            });
        slots.extend((start..=end).filter_map(Slot::new).map(|slot| (slot, node)));
    }
    let masters = masters
        .into_iter()
        .map(|(host, port)| at(seed, host, port))
        .collect();
    Ok((masters, slots))
}

/// `seed`'s settings at `host:port` (the seed's host where the cluster gives none).
fn at(seed: &ConnectionInfo, host: String, port: u16) -> ConnectionInfo {
    let addr = match seed.addr().clone() {
        ConnectionAddr::Tcp(seed_host, _) => {
            ConnectionAddr::Tcp(if host.is_empty() { seed_host } else { host }, port)
        }
        ConnectionAddr::TcpTls {
            host: seed_host,
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host: if host.is_empty() { seed_host } else { host },
            port,
            insecure,
            tls_params,
        },
        other => other,
    };
    seed.clone().set_addr(addr)
}

#[cfg(test)]
mod tests {
    use ::redis::IntoConnectionInfo;

    use super::*;

    /// A `CLUSTER SLOTS` entry: the range, its master, and a replica.
    fn range(start: i64, end: i64, host: &str, port: i64) -> Vec<Value> {
        let node = |host: &str, port: i64| {
            let id = Value::BulkString(b"0123abcd".to_vec());
            Value::Array(vec![Value::BulkString(host.into()), Value::Int(port), id])
        };
        vec![
            Value::Int(start),
            Value::Int(end),
            node(host, port),
            node("10.0.0.9", 7009),
        ]
    }

    #[test]
    fn every_slot_goes_to_its_master_reached_with_the_seeds_settings() {
        let seed = "redis://app:secret@10.0.0.1:7000/"
            .into_connection_info()
            .unwrap();
        let ranges = vec![
            range(0, 5460, "10.0.0.1", 7000),
            // A master that announces no host is at the seed's.
            range(5461, 10922, "", 7001),
            range(10923, 16383, "10.0.0.1", 7000),
        ];
        let (masters, slots) = parse_slots(&seed, ranges).unwrap();
        let addresses: Vec<&ConnectionAddr> = masters.iter().map(ConnectionInfo::addr).collect();
        assert_eq!(
            addresses,
            [
                &ConnectionAddr::Tcp("10.0.0.1".into(), 7000),
                &ConnectionAddr::Tcp("10.0.0.1".into(), 7001),
            ],
            "one connection per master, replicas left out"
        );
        assert!(
            masters
                .iter()
                .all(|m| m.redis_settings().password() == Some("secret"))
        );
        assert_eq!(slots.len(), 16384);
        let node = |slot| slots[&Slot::new(slot).unwrap()];
        assert_eq!(
            (node(0), node(5461), node(10922), node(16383)),
            (0, 1, 1, 0)
        );
    }
}
