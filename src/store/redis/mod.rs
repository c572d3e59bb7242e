//! The Redis store: every state change is one ownership-checked Lua script, or, where the
//! server compares and sets, one command on the exact record the claim wrote.

mod admin;
mod compare;
mod connection;
mod diagnose;
mod record;
mod script;
mod wakes;
mod watch;

use std::{sync::Arc, time::Duration};

use ::redis::{
    Client, Cmd, IntoConnectionInfo, RedisError, RetryMethod, Value,
    aio::{ConnectionManager, ConnectionManagerConfig},
};

pub use self::watch::RedisWatcher;
use self::{
    connection::{Backend, Cluster, Connection, Node},
    record::{Record, Tombstone},
    script::{COMPLETE, RELEASE, RENEW},
};
use super::{
    claim::{ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey},
    contract::{BoxFuture, Front, Offers, Store},
    error::StoreError,
};
use crate::response::StoredResponse;

/// A store on Redis: fast, and the first line in front of Postgres.
///
/// Each idempotency key is one Redis string, `{prefix}{scope length}:{scope}:{key}`: a layout
/// byte, the state, the fingerprint, the owner token, the fence and, once completed, the
/// encoded response; about 70 bytes in flight. Each operation is one call that touches only
/// that key (and, [with tombstones](Self::with_tombstones), the one beside it, in its hash
/// slot), so it works on Redis Cluster too: a claim returns the record there, or creates one,
/// and completion, renewal and release check the owner token before any write, in a Lua script
/// (shipped in `lua/`) or a compare-and-set command. Leases and retention are Redis expiries
/// (`PX`, `PEXPIRE`, `PTTL`), measured on the server's clock.
///
/// # Commands where the server has them, scripts where it has not
///
/// On Redis 7.0 and newer (and Valkey) a claim is not a script but one `SET … NX GET PX`, a
/// `PTTL` and a `TIME`, pipelined: the `SET` creates the record or answers the one there, the
/// `PTTL` says what is left of its life, and the fence is the server's clock read just after
/// the `SET` took the key for a whole lease, so fences grow across claims, expiries and
/// releases as they did when claim.lua drew them, for every grant used within its lease (a
/// grant answered late is renewed before work starts under it: see the
/// [module's rules](crate::store)). The three cost the server less than the script, and less
/// than the same three in a transaction (see `BENCHMARKS.md`). The record is named by this
/// machine's clock (its fence field, which completion and release compare; the operator's
/// views read a record's age from it). A claim asked again by its owner (whose record may have
/// little of its lease left) is sent again in a transaction (`MULTI`), and granted with the
/// server's clock of a moment the record was still its own, a later fence than its first
/// answer's; claim.lua grants it so too, whichever way the record was written. A store
/// [with tombstones](Self::with_tombstones) claims with claim.lua, which reads the tombstone in
/// the same call, and so does a server without `SET … NX GET`. On a cluster, a claim whose
/// key's slot is moving between masters runs claim.lua (the client follows a redirection for
/// one command, not for a pipeline), and one node's answer says what every node has.
///
/// On a server with `SET … IFEQ` (Valkey 8.1 and newer, Redis 8.4 and newer) completion and
/// renewal are not scripts but one `SET` conditional on the whole in-flight record the claim
/// wrote (layout, fingerprint, owner token and fence: a reclaimed or completed key never
/// matches), which costs the server a fraction of a script (see `BENCHMARKS.md`); on a server
/// with `DELIFEQ` (Valkey 9.0 and newer) release is one `DELIFEQ` on that same record. A
/// command that finds another record there leaves the answer to the script, which compares the
/// owner token only (the owner's record may have been written again since the lease was made,
/// by a clone of its claim), so a lease finalizes the same on every server. In front
/// of an authority ([`TieredStore`](crate::store::TieredStore), see [`Front`](crate::store::Front))
/// the authority's fence is the handler's and its tombstones the ones that count, so the
/// claim is the pipeline above even with tombstones, less its `TIME`. `DELEX … IFEQ` (Redis 8.4) is not used
/// yet. The records are the same either way. The store asks the server which of these
/// commands it has, once, before its first claim (`COMMAND DOCS SET`, `COMMAND INFO`: from what
/// the server says, not from its version string; the doctor's version line asks the same); a
/// server that then refuses one with an error (and so writes nothing: one node of a cluster in
/// the middle of an upgrade) gets that command's script from then on, for the life of the store.
/// A lease made with [`Lease::new`] rather than from its claim, which does not know the
/// record's bytes, is finalized by the scripts.
///
/// The connection reconnects by itself after a Redis restart, and every call is bounded by a
/// timeout (250 ms by default), so a slow or stalled Redis surfaces as a [`StoreError::Timeout`]
/// instead of a hung request.
///
/// # Redis Cluster
///
/// [`RedisStore::cluster`] runs the same scripts on a Redis Cluster (or a managed one that
/// speaks its protocol): each record is one key, so each call goes to the master of its slot, and
/// follows `MOVED` and `ASK` while slots migrate. A failover is a few calls that fail or time out
/// (with [`TieredStore`](super::TieredStore), Postgres answers them); a coordinated one
/// (`CLUSTER FAILOVER`) loses nothing, a master that dies may lose the claims it had not yet
/// replicated, as a single server that dies does.
///
/// # Alone, Redis is a best effort
///
/// Redis may lose records: `FLUSHALL`, eviction under `maxmemory`, a restart without
/// persistence, or a failover to a replica that had not yet received the claim (replication is
/// asynchronous). Any of these lets a retry run a second time. Used alone, configure
/// `maxmemory-policy noeviction` and persistence, and accept that a failover can break the
/// guarantee. Put Postgres behind it for a guarantee that survives all of these.
///
/// Fences come from the Redis server clock in microseconds: they grow across reclaims for as
/// long as that clock does. Postgres fences come from a sequence and always grow.
///
/// Requires Redis 6.2 or newer (tested on Redis 7.0 and 8.2, Valkey 8.1 and 9.1).
#[derive(Clone)]
pub struct RedisStore {
    backend: Backend,
    prefix: Arc<str>,
    timeout: Duration,
    /// The compare-and-set commands the server has, asked once, less those it refused.
    known: Arc<compare::Known>,
    /// How long after its completion a key is kept as a tombstone (zero: not at all).
    horizon: Duration,
    /// Waking waiters: the keys this process's waiters listen for, and the task that listens,
    /// started with the first, shared by the store's clones.
    wakes: Arc<wakes::Wakes>,
}

/// The default bound on one Redis call.
pub const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_millis(250);

const STORE: &str = "redis";

impl RedisStore {
    /// A store on `client`'s server, under the prefix `idempotency:`.
    ///
    /// The connection is made on first use, so start-up does not wait for (or fail on) Redis.
    ///
    /// ```
    /// use tower_idempotency::{redis, store::RedisStore};
    ///
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let store = RedisStore::new(client).with_prefix("payments-api:");
    /// # Ok::<(), redis::RedisError>(())
    /// ```
    pub fn new(client: Client) -> Self {
        let manager = Arc::default();
        Self::on(Backend::Server { client, manager })
    }

    /// A store on the server at `url` (`redis://host:port/db`); `Err` for a URL that is not
    /// one. See [`new`](Self::new).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::store::RedisStore;
    ///
    /// let store = RedisStore::open("redis://127.0.0.1:6379/")?
    ///     .with_timeout(Duration::from_millis(100));
    /// # Ok::<(), tower_idempotency::redis::RedisError>(())
    /// ```
    pub fn open(url: &str) -> Result<Self, RedisError> {
        Ok(Self::new(Client::open(url)?))
    }

    /// A store on a Redis Cluster, found from any of its nodes (`redis://host:port`; the others
    /// are discovered), under the prefix `idempotency:`.
    ///
    /// As with [`new`](Self::new), the connection is made on first use, and made again by the
    /// next call if it failed. Each call goes to the master of its key's slot. `Err` for seeds
    /// that are not node addresses, or that do not make a cluster client.
    ///
    /// ```
    /// use tower_idempotency::store::RedisStore;
    ///
    /// let store = RedisStore::cluster(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])?;
    /// # Ok::<(), tower_idempotency::redis::RedisError>(())
    /// ```
    pub fn cluster<T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
    ) -> Result<Self, RedisError> {
        let seeds = nodes
            .into_iter()
            .map(IntoConnectionInfo::into_connection_info)
            .collect::<Result<Vec<_>, _>>()?;
        let cluster = Cluster::new(seeds);
        // Refused now rather than at the first call.
        cluster.client(DEFAULT_REDIS_TIMEOUT)?;
        Ok(Self::on(Backend::Cluster(Arc::new(cluster))))
    }

    fn on(backend: Backend) -> Self {
        Self {
            backend,
            prefix: Arc::from("idempotency:"),
            timeout: DEFAULT_REDIS_TIMEOUT,
            known: Arc::default(),
            horizon: Duration::ZERO,
            wakes: Arc::new(wakes::Wakes::new("idempotency:")),
        }
    }

    /// Keeps a completed key as a tombstone once its answer's retention ends, until `horizon`
    /// after its completion (off by default): a late retry of the same request is then
    /// [`ClaimOutcome::AnswerExpired`] (the layer answers 410 and never runs it), another
    /// request with the key a mismatch.
    ///
    /// The tombstone is a key of its own beside the record (` tombstone` after the record's
    /// name, a space no record's name holds), 51 bytes of value: the fingerprint, the status and
    /// when the key completed, written by the completion's script with the horizon as its
    /// expiry, and read by the claim's script when there is no record. Both keys must share a
    /// hash slot on a Redis Cluster: where the record's name has no hash tag, the tombstone's
    /// wraps the whole name in one (`{…} tombstone`), which a name holding a `}` cannot be; such
    /// keys (a scope or key with a `}` outside a hash tag) get no tombstone, anywhere. Completion
    /// is then a script, not `SET … IFEQ`.
    pub fn with_tombstones(mut self, horizon: Duration) -> Self {
        self.horizon = horizon;
        self
    }

    /// The Redis key of `record`'s tombstone, named from its record's `record_key`, in the same
    /// hash slot; `None` without tombstones, or for a name no key of the same slot can be made
    /// from (see [`with_tombstones`](Self::with_tombstones)).
    fn tombstone_key(&self, record_key: &str) -> Option<String> {
        if self.horizon.is_zero() {
            return None;
        }
        let tagged = record_key
            .split_once('{')
            .and_then(|(_, rest)| rest.find('}'))
            .is_some_and(|len| len > 0);
        if tagged {
            Some(format!("{record_key} tombstone"))
        } else if !record_key.contains('}') {
            Some(format!("{{{record_key}}} tombstone"))
        } else {
            None
        }
    }

    /// The prefix of every key this store writes (`idempotency:` by default): separates
    /// applications or environments sharing one Redis.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix: Arc<str> = Arc::from(prefix.into());
        self.wakes = Arc::new(wakes::Wakes::new(&prefix));
        self.prefix = prefix;
        self
    }

    /// The bound on each call (connecting included); past it the call fails with
    /// [`StoreError::Timeout`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        // Connections are made on first use with the timeout: none made with the old one stays.
        self.backend = match self.backend {
            Backend::Server { client, .. } => Backend::Server {
                client,
                manager: Arc::default(),
            },
            Backend::Cluster(cluster) => {
                Backend::Cluster(Arc::new(Cluster::new(cluster.seeds.clone())))
            }
        };
        self.timeout = timeout;
        self
    }

    fn manager(client: &Client, timeout: Duration) -> Result<ConnectionManager, RedisError> {
        // One attempt per connection: the store's timeout bounds each call, and retries inside
        // it would turn a refused connection or a refused password into "did not answer in
        // time". A call that meets a dead connection fails, and the next one connects afresh.
        // No response timeout of the connection's own: every call is under the store's
        // (`call`), and a second timer a command would only cost (BENCHMARKS.md).
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_response_timeout(None)
            .set_connection_timeout(Some(timeout.max(Duration::from_secs(1))))
            .set_max_delay(Duration::from_secs(2));
        ConnectionManager::new_lazy_with_config(client.clone(), config)
    }

    /// A connection: the one server's manager, or the cluster's connection (made on first use).
    async fn connection(&self) -> Result<Connection, RedisError> {
        let connected = match &self.backend {
            Backend::Server { manager, .. } => manager.get().cloned().map(Connection::Server),
            Backend::Cluster(cluster) => cluster.connected().map(Connection::Cluster),
        };
        match connected {
            Some(connection) => Ok(connection),
            // Boxed: connecting is kilobytes of state that every call's future would carry
            // (and copy) otherwise, for a first use.
            None => Box::pin(self.connect()).await,
        }
    }

    /// Connects (see [`connection`](Self::connection)).
    async fn connect(&self) -> Result<Connection, RedisError> {
        match &self.backend {
            Backend::Server { client, manager } => {
                let manager = manager
                    .get_or_try_init(async || Self::manager(client, self.timeout))
                    .await?;
                Ok(Connection::Server(manager.clone()))
            }
            Backend::Cluster(cluster) => {
                Ok(Connection::Cluster(cluster.connection(self.timeout).await?))
            }
        }
    }

    /// The record a Redis key of this store's names, if it is one.
    fn parse_record_key(&self, key: &[u8]) -> Option<RecordKey> {
        let rest = std::str::from_utf8(key).ok()?.strip_prefix(&*self.prefix)?;
        let (len, rest) = rest.split_once(':')?;
        let len: usize = len.parse().ok()?;
        let scope = rest.get(..len)?;
        let key = rest.get(len..)?.strip_prefix(':')?;
        Some(RecordKey::new(
            scope,
            crate::IdempotencyKey::try_from(key).ok()?,
        ))
    }

    /// The Redis key of a record. The scope is length-prefixed, so no (scope, key) pair can
    /// collide with another whatever characters they hold.
    pub fn record_key(&self, record: &RecordKey) -> String {
        let (scope, key) = (record.scope(), record.key().as_str());
        let mut digits = itoa::Buffer::new();
        let len = digits.format(scope.len());
        let mut name =
            String::with_capacity(self.prefix.len() + len.len() + scope.len() + key.len() + 2);
        for part in [&*self.prefix, len, ":", scope, ":", key] {
            name.push_str(part);
        }
        name
    }

    /// Runs `invoke` on a connection, connecting included, under the timeout.
    async fn call<T>(
        &self,
        invoke: impl AsyncFnOnce(&mut Connection) -> Result<T, RedisError>,
    ) -> Result<T, StoreError> {
        let work = async {
            let mut connection = self.connection().await?;
            invoke(&mut connection).await
        };
        let timeout = self.timeout;
        let mut cluster_failed = false;
        let result = super::error::bounded(STORE, timeout, work, |error| {
            cluster_failed = !matches!(error.retry_method(), RetryMethod::NoRetry);
            if error.is_timeout() {
                StoreError::timeout(STORE, timeout)
            } else {
                StoreError::backend(STORE, error)
            }
        })
        .await;
        if let Backend::Cluster(cluster) = &self.backend
            && (cluster_failed || matches!(result, Err(StoreError::Timeout { .. })))
        {
            cluster.failed();
        }
        result
    }
}

impl Store for RedisStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            // Tombstones are read by claim.lua, in the same call.
            if self.horizon.is_zero()
                && let Some(outcome) = self.claim_by_command(request, false).await?
            {
                return Ok(outcome);
            }
            self.claim_by_script(request).await
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let duration = millis(duration);
            let key = self.record_key(lease.record());
            if let Some(ownership) = self
                .compare_and_set((lease, &key), <[u8]>::to_vec, duration)
                .await?
            {
                return Ok(ownership);
            }
            self.owner_checked(&RENEW, (lease, &key, None), (duration, 0))
                .await
        })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let encoded = response.encode();
            let retention = millis(retention);
            let key = self.record_key(lease.record());
            // With a tombstone to write beside the record, complete.lua writes both.
            let tombstone = self.tombstone_key(&key);
            let completed = |in_flight: &[u8]| record::completed(in_flight, &encoded);
            if tombstone.is_none()
                && let Some(ownership) = self
                    .compare_and_set((lease, &key), completed, retention)
                    .await?
            {
                return Ok(ownership);
            }
            // A status is three digits (100 to 999).
            let status = response.status().as_u16();
            let (publish, channel) = self.wakes.publish(&key, &self.backend);
            let args = (
                &encoded[..],
                retention,
                publish,
                channel,
                millis(self.horizon),
                status,
            );
            let record = (lease, &*key, tombstone.as_deref());
            self.owner_checked(&COMPLETE, record, (args, encoded.len()))
                .await
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let key = self.record_key(lease.record());
            if let Some(ownership) = self.delete_if_equal((lease, &key)).await? {
                return Ok(ownership);
            }
            let publish = self.wakes.publish(&key, &self.backend);
            self.owner_checked(&RELEASE, (lease, &key, None), (publish, 0))
                .await
        })
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn tombstone_horizon(&self) -> Duration {
        self.horizon
    }

    /// A connection (or a cluster connection) of its own, made on first use.
    fn detached(&self) -> Option<Arc<dyn Store>> {
        Some(Arc::new(self.clone().with_timeout(self.timeout)))
    }

    fn offers(&self) -> Offers<'_> {
        Offers::none().with_admin(self).with_wakes(self)
    }
}

/// In front of an authority, a claim is the pipeline of `SET … NX GET` and `PTTL` (no script,
/// no `TIME`: the authority grants the fence) even with tombstones: the authority's are the
/// ones that count.
impl Front for RedisStore {
    fn claim_in_front<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            match self.claim_by_command(request, true).await? {
                Some(outcome) => Ok(outcome),
                None => self.claim_by_script(request).await,
            }
        })
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut f = f.debug_struct("RedisStore");
        match &self.backend {
            Backend::Server { client, .. } => {
                f.field("server", client.get_connection_info().addr())
            }
            Backend::Cluster(cluster) => f.field(
                "cluster",
                &cluster.seeds.iter().map(|s| s.addr()).collect::<Vec<_>>(),
            ),
        };
        f.field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// A command of `args` arguments (its name included) and about `bytes` bytes of them, built in
/// buffers of that size: `redis::cmd` starts with none and grows them as arguments come.
fn command(name: &str, args: usize, bytes: usize) -> Cmd {
    let mut command = Cmd::with_capacity(args, name.len() + bytes);
    command.arg(name);
    command
}

/// Redis expiries are whole milliseconds, and at least one: `PEXPIRE key 0` deletes the key.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A reply read as `T`, or the store's error.
fn from_value<T: ::redis::FromRedisValue>(value: Value) -> Result<T, StoreError> {
    ::redis::from_redis_value(value).map_err(|error| StoreError::backend(STORE, error))
}

/// The time between two instants of the server's clock (µs), or zero if the second came first.
fn since(earlier: u128, later: u128) -> Duration {
    Duration::from_micros(u64::try_from(later.saturating_sub(earlier)).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    #[tokio::test]
    async fn record_keys_cannot_collide() {
        let store = RedisStore::open("redis://127.0.0.1:1")
            .unwrap()
            .with_prefix("p:");
        let key = |scope: &str, key: &str| {
            store.record_key(&RecordKey::new(
                scope,
                IdempotencyKey::try_from(key).unwrap(),
            ))
        };
        assert_eq!(key("", "k"), "p:0::k");
        assert_ne!(key("a:b", "c"), key("a", "b:c"));
        assert_ne!(key("a:1", "x"), key("a", "1:x"));
    }
}
