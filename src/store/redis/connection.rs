//! Where the store's commands go: one server through a connection manager, or a Redis Cluster
//! through the cluster driver, behind one connection type.

use std::{sync::Arc, time::Duration};

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

/// A Redis Cluster, connected on first use (and again after a failed first connection).
pub(super) struct Cluster {
    pub(super) seeds: Vec<::redis::ConnectionInfo>,
    pub(super) connection: OnceCell<ClusterConnection>,
}

impl Cluster {
    pub(super) fn new(seeds: Vec<::redis::ConnectionInfo>) -> Self {
        Self {
            seeds,
            connection: OnceCell::new(),
        }
    }

    pub(super) fn client(&self, timeout: Duration) -> Result<ClusterClient, RedisError> {
        ClusterClientBuilder::new(self.seeds.clone())
            .connection_timeout(timeout.max(Duration::from_secs(1)))
            .response_timeout(timeout)
            .build()
    }
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

    /// Sends `pipeline` to `node` (on a cluster, to that master whatever the keys' slots).
    pub(super) async fn pipeline_on(
        &mut self,
        node: &Node,
        pipeline: &Pipeline,
    ) -> Result<Vec<Value>, RedisError> {
        match (self, node) {
            (Self::Cluster(connection), Some((host, port))) => {
                let route = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                let count = pipeline.len();
                connection
                    .route_pipeline(pipeline.clone(), 0, count, route)
                    .await
            }
            (connection, _) => pipeline.query_async(connection).await,
        }
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
