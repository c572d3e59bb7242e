//! Where the store's commands go: one server through a connection manager, or a Redis Cluster
//! through the cluster driver, behind one connection type.

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use ::redis::{
    Client, Cmd, Pipeline, RedisError, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager},
    cluster::{ClusterClient, ClusterClientBuilder},
    cluster_async::ClusterConnection,
    cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
};
use tokio::sync::OnceCell;

/// Where the store's commands go.
#[derive(Clone)]
pub(super) enum Backend {
    /// One server, through a manager made on first use with the store's timeout.
    Server {
        client: Client,
        manager: Arc<OnceCell<ConnectionManager>>,
    },
    Cluster(Arc<Cluster>),
}

/// A Redis Cluster, connected on first use (and again after a failed first connection), and
/// connected afresh from the seeds when its connection keeps failing.
pub(super) struct Cluster {
    pub(super) seeds: Vec<::redis::ConnectionInfo>,
    connection: Mutex<Arc<OnceCell<ClusterConnection>>>,
    failing: Mutex<Failing>,
}

/// How long calls must keep failing (no pause longer than [`CALM`] between two failures)
/// before the cluster's connection is replaced by a fresh one, and at most how often it is.
/// The cluster driver follows failovers and moved slots on its own; this is for a connection
/// that never recovers (a node map or a reconnection stuck on what the cluster was), which
/// otherwise answers every call for its slots with an error until the process restarts.
const REBUILD_AFTER: Duration = Duration::from_secs(3);
/// A pause without failures that ends a run of them.
const CALM: Duration = Duration::from_secs(1);

/// A run of failed calls: since when, and the last one.
#[derive(Debug, Default)]
struct Failing {
    since: Option<Instant>,
    last: Option<Instant>,
}

impl Failing {
    /// Notes a failure at `now`; whether the run has lasted [`REBUILD_AFTER`] (then it starts
    /// again, so a connection is replaced at most once per [`REBUILD_AFTER`]).
    fn failed(&mut self, now: Instant) -> bool {
        let calm = self.last.is_none_or(|last| now - last > CALM);
        self.last = Some(now);
        let since = match self.since {
            Some(since) if !calm => since,
            _ => *self.since.insert(now),
        };
        let lasted = now - since >= REBUILD_AFTER;
        if lasted {
            self.since = Some(now);
        }
        lasted
    }
}

impl Cluster {
    pub(super) fn new(seeds: Vec<::redis::ConnectionInfo>) -> Self {
        Self {
            seeds,
            connection: Mutex::default(),
            failing: Mutex::default(),
        }
    }

    pub(super) fn client(&self, timeout: Duration) -> Result<ClusterClient, RedisError> {
        ClusterClientBuilder::new(self.seeds.clone())
            .connection_timeout(timeout.max(Duration::from_secs(1)))
            .response_timeout(timeout)
            .build()
    }

    /// The cluster's connection, made on first use (and on the first use after it was
    /// replaced).
    pub(super) async fn connection(
        &self,
        timeout: Duration,
    ) -> Result<ClusterConnection, RedisError> {
        let cell = Arc::clone(&lock(&self.connection));
        let connect = async || self.client(timeout)?.get_async_connection().await;
        cell.get_or_try_init(connect).await.cloned()
    }

    /// The cluster's connection, if it is made.
    pub(super) fn connected(&self) -> Option<ClusterConnection> {
        lock(&self.connection).get().cloned()
    }

    /// Notes a call that failed for want of the cluster (a connection, a node, a slot: not an
    /// error the server answered), and replaces the connection when they have kept failing
    /// for [`REBUILD_AFTER`]: the next call connects afresh from the seeds.
    pub(super) fn failed(&self) {
        if lock(&self.failing).failed(Instant::now()) {
            tracing::warn!(
                after = ?REBUILD_AFTER,
                "calls to the Redis Cluster kept failing; connecting to it afresh"
            );
            *lock(&self.connection) = Arc::default();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A connection to the one server or to the cluster.
#[derive(Clone)]
pub(super) enum Connection {
    Server(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Server(connection) => connection.req_packed_command(cmd),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Server(connection) => connection.req_packed_commands(pipeline, offset, count),
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Server(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

/// A master of the cluster, by address (`None`: the one server).
pub(super) type Node = Option<(String, u16)>;

impl Connection {
    /// The masters whose keyspaces together hold every record.
    pub(super) async fn masters(&mut self) -> Result<Vec<Node>, RedisError> {
        let Self::Cluster(connection) = self else {
            return Ok(vec![None]);
        };
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
        let slots = connection
            .route_command(::redis::cmd("CLUSTER").arg("SLOTS").clone(), routing)
            .await?;
        let slots = ::redis::from_redis_value(slots.extract_error()?)?;
        let mut masters: Vec<Node> = (slot_ranges(slots)?.into_iter())
            .map(|(_, master)| Some(master))
            .collect();
        masters.sort();
        masters.dedup();
        Ok(masters)
    }

    /// Sends `pipeline` to `node`: on a cluster, to that master whatever the keys' slots, or
    /// for `None` to any one node (a pipeline of server commands, whose arguments are not
    /// keys, would otherwise be routed by them, to slots that differ).
    pub(super) async fn pipeline_on(
        &mut self,
        node: &Node,
        pipeline: &Pipeline,
    ) -> Result<Vec<Value>, RedisError> {
        let Self::Cluster(connection) = self else {
            return pipeline.query_async(self).await;
        };
        let route = match node {
            Some((host, port)) => SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            },
            None => SingleNodeRoutingInfo::Random,
        };
        let count = pipeline.len();
        connection
            .route_pipeline(pipeline.clone(), 0, count, route)
            .await
    }
}

/// A range of slots, first and last, and its master's host and port.
pub(super) type SlotRange = ((u16, u16), (String, u16));

/// The entries of a `CLUSTER SLOTS` answer: each range's first and last slot and its master's
/// host (empty when the master announces none) and port. Each entry is the start slot, the end
/// slot, then the master as `[host, port, id, …]`, then its replicas (left out).
pub(super) fn slot_ranges(ranges: Vec<Vec<Value>>) -> Result<Vec<SlotRange>, RedisError> {
    fn from<T: ::redis::FromRedisValue>(value: Option<Value>) -> Result<T, RedisError> {
        ::redis::from_redis_value(value.unwrap_or(Value::Nil)).map_err(Into::into)
    }
    let mut entries = Vec::with_capacity(ranges.len());
    for range in ranges {
        let mut range = range.into_iter();
        let (start, end) = (from(range.next())?, from(range.next())?);
        let master: Vec<Value> = from(range.next())?;
        let mut master = master.into_iter();
        entries.push(((start, end), (from(master.next())?, from(master.next())?)));
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_replaced_only_after_failures_that_keep_coming() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut failing = Failing::default();
        // Failures 500 ms apart: the run lasts, and at 3 s the connection is replaced.
        assert!(!(0..6).any(|n| failing.failed(at(n * 500))));
        assert!(failing.failed(at(3000)));
        // A new run starts there: not again before another 3 s.
        assert!(!failing.failed(at(3500)));
        assert!(!failing.failed(at(5500)), "a calm of 2 s ended the run");
        assert!(!failing.failed(at(8000)), "and another");
        // Occasional failures (a failover's few) never add up to a run.
        let mut occasional = Failing::default();
        assert!(!(0..20).any(|n| occasional.failed(at(n * 1500))));
    }
}
