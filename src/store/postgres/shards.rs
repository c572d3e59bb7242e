//! Citus: which worker holds a key's shard, so that each of a request's statements goes
//! straight to it instead of through the coordinator.
//!
//! The map comes from Citus's metadata, which the coordinator and (with metadata synced, the
//! default since Citus 11) every worker have: the table's distribution column, each shard's
//! hash range and the primary node of its placement. A key is hashed here exactly as Citus hashes
//! it ([`hashtext`]), so its statements go to the worker that runs them locally. They always
//! name the distributed table, never a shard: a worker that no longer holds the shard (a map
//! made before a move) forwards the statement to the one that does, so a stale map costs a hop,
//! never a wrong write. The map is read again every [`REFRESH`], and soon after a statement
//! fails on a route; until the first map is read (or when there is none to read) statements go
//! to the coordinator. While the coordinator is down the map is read from a worker: one of the
//! last map's, or one the store was told of, for a store that has read none yet.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, PoisonError, RwLock,
        atomic::{AtomicBool, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

use sqlx::{PgPool, postgres::PgConnectOptions};

use super::connections::{Connections, Plans};

/// How often the map is read again, in case placements changed.
pub(super) const REFRESH: Duration = Duration::from_secs(10);

/// How soon a map is read again after a statement failed on a route, or a read failed.
const RETRY: Duration = Duration::from_secs(1);

/// A node as Citus's metadata names it (`pg_dist_node`).
pub(super) type Address = (String, u16);

/// The shard map: each shard's hash range, and the node its statements go to.
const MAP: &str = r"
SELECT DISTINCT ON (s.shardid)
       column_to_column_name(p.logicalrelid, p.partkey) AS column_name,
       s.shardminvalue::int4 AS low, s.shardmaxvalue::int4 AS high,
       n.nodename::text AS host, n.nodeport AS port
FROM pg_dist_partition p
JOIN pg_dist_shard s ON s.logicalrelid = p.logicalrelid
JOIN pg_dist_placement pl ON pl.shardid = s.shardid
JOIN pg_dist_node n ON n.groupid = pl.groupid AND n.noderole = 'primary' AND n.isactive
WHERE p.logicalrelid = 'idempotency_keys'::regclass AND p.partmethod = 'h'
ORDER BY s.shardid, n.nodeid
";

/// Where each shard's statements go.
#[derive(Debug)]
struct ShardMap {
    /// Distributed by scope (else by key).
    by_scope: bool,
    /// (low, high, node), sorted by `low`: ranges of the hash space, as `pg_dist_shard` has them.
    shards: Vec<(i32, i32, usize)>,
    nodes: Vec<Address>,
}

impl ShardMap {
    /// The shard of (`scope`, `key`): its place in `shards`.
    fn shard(&self, scope: &str, key: &str) -> Option<usize> {
        let value = if self.by_scope { scope } else { key };
        let hash = hashtext(value.as_bytes());
        let at = self.shards.partition_point(|(low, _, _)| *low <= hash);
        let shard = at.checked_sub(1)?;
        (hash <= self.shards.get(shard)?.1).then_some(shard)
    }

    fn find(&self, scope: &str, key: &str) -> Option<&Address> {
        let (_, _, node) = self.shards[self.shard(scope, key)?];
        Some(&self.nodes[node])
    }
}

/// The map, shared by a store's clones and the store detached from it for renewals.
#[derive(Debug)]
struct Shared {
    map: RwLock<Option<Arc<ShardMap>>>,
    /// When the map is next due to be read.
    due: Mutex<Instant>,
    reading: AtomicBool,
}

/// The routes of a store on Citus: the map, and connections of the store's own to each node it
/// names (kept across maps, so that a refresh reconnects nothing).
#[derive(Debug)]
pub(super) struct Routes {
    /// The coordinator's connect options (the pool's), without the store's session settings.
    options: PgConnectOptions,
    max: usize,
    timeout: Duration,
    /// Connect options for nodes the metadata names by an address the application cannot use.
    overrides: Arc<[(Address, PgConnectOptions)]>,
    shared: Arc<Shared>,
    /// Each node's connections: planning once, and on every execution ([`Plans`]). Both made
    /// with the node, connecting only when first lent.
    nodes: Mutex<HashMap<Address, [Arc<Connections>; 2]>>,
    /// Pools for the handlers' transactions on each node (`PostgresStore::pool_for`).
    pools: Mutex<HashMap<Address, PgPool>>,
}

impl Routes {
    pub(super) fn new(
        options: PgConnectOptions,
        max: usize,
        timeout: Duration,
        overrides: Arc<[(Address, PgConnectOptions)]>,
    ) -> Self {
        let shared = Arc::new(Shared {
            map: RwLock::new(None),
            due: Mutex::new(Instant::now()),
            reading: AtomicBool::new(false),
        });
        Self::sharing(options, max, timeout, overrides, shared)
    }

    fn sharing(
        options: PgConnectOptions,
        max: usize,
        timeout: Duration,
        overrides: Arc<[(Address, PgConnectOptions)]>,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            options,
            max,
            timeout,
            overrides,
            shared,
            nodes: Mutex::new(HashMap::new()),
            pools: Mutex::new(HashMap::new()),
        }
    }

    /// Routes on the same map, with up to `max` connections of their own to each node.
    pub(super) fn detached(&self, max: usize) -> Self {
        let (options, overrides) = (self.options.clone(), self.overrides.clone());
        Self::sharing(options, max, self.timeout, overrides, self.shared.clone())
    }

    /// The node that holds the shard of (`scope`, `key`), or `None` (the coordinator) while
    /// there is no map. Reads the map again when it is due, in the background, from
    /// `coordinator` (or a node it names, when the coordinator fails).
    pub(super) fn address(
        self: &Arc<Self>,
        coordinator: &Arc<Connections>,
        scope: &str,
        key: &str,
    ) -> Option<Address> {
        self.read_when_due(coordinator);
        let map = self.map()?;
        map.find(scope, key).cloned()
    }

    /// The store's connections to the node that holds the shard of (`scope`, `key`), as
    /// [`address`](Self::address) finds it, planning as `plans` says.
    pub(super) fn route(
        self: &Arc<Self>,
        coordinator: &Arc<Connections>,
        (scope, key): (&str, &str),
        plans: Plans,
    ) -> Option<Arc<Connections>> {
        self.read_when_due(coordinator);
        let map = self.map()?;
        Some(self.connections(map.find(scope, key)?, plans))
    }

    /// `items` in groups that may share a statement: of one shard on the current map, equal in
    /// what else `key` reads besides the scope and key, at most `max` each, the groups in the
    /// order of their first item. While there is no map, each item is a group of its own.
    pub(super) fn by_shard<Q>(
        &self,
        items: Vec<Q>,
        max: usize,
        key: impl Fn(&Q) -> (&str, &str, u64),
    ) -> Vec<Vec<Q>> {
        let map = self.map();
        // Each group's shard and kin (none: no map, a group of its own), and its items.
        let mut tags = Vec::new();
        let mut groups: Vec<Vec<Q>> = Vec::new();
        for item in items {
            let (scope, key, kin) = key(&item);
            let tag = map
                .as_ref()
                .and_then(|map| map.shard(scope, key))
                .map(|s| (s, kin));
            let open = (0..groups.len())
                .find(|&g| tag.is_some() && tags[g] == tag && groups[g].len() < max.max(1));
            match open {
                Some(g) => groups[g].push(item),
                None => {
                    tags.push(tag);
                    groups.push(vec![item]);
                }
            }
        }
        groups
    }

    fn map(&self) -> Option<Arc<ShardMap>> {
        let map = self.shared.map.read();
        map.unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// A statement failed on a route: the map is read again soon, in case a shard moved or a
    /// node went.
    pub(super) fn suspect(&self) {
        let soon = Instant::now() + RETRY;
        let mut due = self
            .shared
            .due
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *due = (*due).min(soon);
    }

    /// Reads the map, in the background, if it is due. Outside a Tokio runtime (a store built
    /// before it, or `pool_for` called from a thread of its own) the map is left to the next
    /// call inside one. Routes dropped before the read starts (each step of a store's builder
    /// makes new ones, and only the last step's are kept) read nothing.
    pub(super) fn read_when_due(self: &Arc<Self>, coordinator: &Arc<Connections>) {
        let shared = &self.shared;
        let due = *shared.due.lock().unwrap_or_else(PoisonError::into_inner);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if Instant::now() < due || shared.reading.swap(true, SeqCst) {
            return;
        }
        let (routes, coordinator) = (Arc::downgrade(self), coordinator.clone());
        runtime.spawn(async move {
            let Some(routes) = routes.upgrade() else {
                return;
            };
            let next = match routes.read(&coordinator).await {
                Ok(()) => REFRESH,
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "could not read the Citus shard map: statements follow the last map \
                         read, or go to the coordinator"
                    );
                    RETRY
                }
            };
            let shared = &routes.shared;
            *shared.due.lock().unwrap_or_else(PoisonError::into_inner) = Instant::now() + next;
            shared.reading.store(false, SeqCst);
        });
    }

    /// Reads the map from the coordinator or, when the coordinator fails, from another node
    /// (every node has the metadata): the nodes of the last map, then the nodes the store was
    /// told of (`with_citus_node`), which is how a store that has read no map yet finds one.
    async fn read(&self, coordinator: &Connections) -> Result<(), sqlx::Error> {
        let mut result = self.read_from(coordinator).await;
        if result.is_err() {
            let last = self.map();
            let mut others: Vec<&Address> = last.iter().flat_map(|map| &map.nodes).collect();
            for (address, _) in self.overrides.iter() {
                if !others.contains(&address) {
                    others.push(address);
                }
            }
            for address in others {
                result = self
                    .read_from(&self.connections(address, Plans::Custom))
                    .await;
                if result.is_ok() {
                    break;
                }
            }
        }
        let map = result?;
        *self
            .shared
            .map
            .write()
            .unwrap_or_else(PoisonError::into_inner) = map.map(Arc::new);
        Ok(())
    }

    /// The map as `node` has it; `None` when the table is not distributed by hash there.
    async fn read_from(&self, node: &Connections) -> Result<Option<ShardMap>, sqlx::Error> {
        let read = tokio::time::timeout(self.timeout, async {
            let mut connection = node.lend().await?;
            let rows = sqlx::query_as::<_, (String, i32, i32, String, i32)>(MAP)
                .fetch_all(&mut *connection)
                .await;
            connection.give_back(&rows);
            rows
        });
        let rows = read.await.map_err(|_| sqlx::Error::PoolTimedOut)??;
        let Some((column, ..)) = rows.first() else {
            return Ok(None);
        };
        let by_scope = column == "scope";
        let mut nodes: Vec<Address> = Vec::new();
        let mut shards = Vec::with_capacity(rows.len());
        for (_, low, high, host, port) in &rows {
            let address = (host.clone(), u16::try_from(*port).unwrap_or_default());
            let node = match nodes.iter().position(|a| *a == address) {
                Some(at) => at,
                None => {
                    nodes.push(address);
                    nodes.len() - 1
                }
            };
            shards.push((*low, *high, node));
        }
        shards.sort_unstable_by_key(|(low, _, _)| *low);
        Ok(Some(ShardMap {
            by_scope,
            shards,
            nodes,
        }))
    }

    /// The store's connections to the node at `address` that plan as `plans` says. Looked up
    /// for every statement, without an allocation; made with the node's first statement.
    fn connections(&self, address: &Address, plans: Plans) -> Arc<Connections> {
        let at = match plans {
            Plans::Generic => 0,
            Plans::Custom => 1,
        };
        let mut nodes = self.nodes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(node) = nodes.get(address) {
            return node[at].clone();
        }
        let options = self.options_for(address);
        let node = [Plans::Generic, Plans::Custom]
            .map(|plans| Arc::new(Connections::new(&options, self.max, self.timeout, plans)));
        let connections = node[at].clone();
        nodes.insert(address.clone(), node);
        connections
    }

    /// How to connect to the node at `address`: as the override says, or as to the
    /// coordinator, at that address.
    fn options_for(&self, address: &Address) -> PgConnectOptions {
        let overridden = self.overrides.iter().find(|(a, _)| a == address);
        match overridden {
            Some((_, options)) => options.clone(),
            None => self.options.clone().host(&address.0).port(address.1),
        }
    }

    /// A pool for the handlers' transactions on the node at `address`: `pool`'s options,
    /// connecting there (made on first use, connecting lazily).
    pub(super) fn pool(&self, pool: &PgPool, address: &Address) -> PgPool {
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(made) = pools.get(address) {
            return made.clone();
        }
        let options = self.options_for(address);
        let made = pool.options().clone().connect_lazy_with(options);
        pools.insert(address.clone(), made.clone());
        made
    }
}

/// PostgreSQL's `hashtext` (`hash_bytes` in `src/common/hashfn.c`, Bob Jenkins's lookup3), which
/// Citus hashes a text distribution value with (`worker_hash`), for a deterministic collation:
/// its bytes, as the server has them (UTF-8).
pub(super) fn hashtext(bytes: &[u8]) -> i32 {
    let mut a: u32 = 0x9e37_79b9_u32
        .wrapping_add(bytes.len() as u32)
        .wrapping_add(3_923_095);
    let (mut b, mut c) = (a, a);
    let word = |k: &[u8]| u32::from_le_bytes([k[0], k[1], k[2], k[3]]);
    let mut k = bytes;
    while k.len() >= 12 {
        a = a.wrapping_add(word(&k[0..4]));
        b = b.wrapping_add(word(&k[4..8]));
        c = c.wrapping_add(word(&k[8..12]));
        mix(&mut a, &mut b, &mut c);
        k = &k[12..];
    }
    // The last 11 bytes at most; the lowest byte of `c` is not added to (it was the length's).
    let byte = |i: usize| u32::from(k[i]);
    let tail = k.len();
    if tail > 8 {
        c = c.wrapping_add(
            (8..tail)
                .map(|i| byte(i) << (8 * (i - 7)))
                .fold(0, u32::wrapping_add),
        );
    }
    if tail > 4 {
        b = b.wrapping_add(
            (4..tail.min(8))
                .map(|i| byte(i) << (8 * (i - 4)))
                .fold(0, u32::wrapping_add),
        );
    }
    a = a.wrapping_add(
        (0..tail.min(4))
            .map(|i| byte(i) << (8 * i))
            .fold(0, u32::wrapping_add),
    );
    finish(&mut a, &mut b, &mut c);
    c as i32
}

/// lookup3's `mix`, as `hashfn.c` has it.
fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    for (x, y, z, r) in [
        (0, 1, 2, 4),
        (1, 2, 0, 6),
        (2, 0, 1, 8),
        (0, 1, 2, 16),
        (1, 2, 0, 19),
        (2, 0, 1, 4),
    ] {
        // `x -= z; x ^= rot(z, r); z += y`, over (a, b, c).
        let mut v = [*a, *b, *c];
        v[x] = v[x].wrapping_sub(v[z]) ^ v[z].rotate_left(r);
        v[z] = v[z].wrapping_add(v[y]);
        [*a, *b, *c] = v;
    }
}

/// lookup3's `final`, as `hashfn.c` has it.
fn finish(a: &mut u32, b: &mut u32, c: &mut u32) {
    for (x, y, r) in [
        (2, 1, 14),
        (0, 2, 11),
        (1, 0, 25),
        (2, 1, 16),
        (0, 2, 4),
        (1, 0, 14),
        (2, 1, 24),
    ] {
        // `x ^= y; x -= rot(y, r)`, over (a, b, c).
        let mut v = [*a, *b, *c];
        v[x] = (v[x] ^ v[y]).wrapping_sub(v[y].rotate_left(r));
        [*a, *b, *c] = v;
    }
}

#[cfg(test)]
mod tests {
    use super::hashtext;

    #[test]
    fn hashtext_is_postgres_own() {
        // `SELECT hashtext('abc')`, PostgreSQL 15.
        assert_eq!(hashtext(b"abc"), -785_388_649);
    }

    /// The port against the server's own `hashtext` on 10,000 keys: empty, ASCII of every length
    /// a tail can have, UTF-8 of two, three and four bytes a character, and as long as keys get.
    /// `tests/citus.rs` shows that Citus's `worker_hash` is `hashtext`.
    #[tokio::test]
    async fn hashtext_matches_the_server_on_10000_keys() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let pieces = ["", "k", "é", "€", "🦀", "order-", "0123456789ab"];
        let keys: Vec<String> = (0..10_000_usize)
            .map(|i| {
                let piece = pieces[i % pieces.len()];
                let mut key = piece.repeat(i % 23);
                key.push_str(&format!("{i:x}")[..(i % 5).min(format!("{i:x}").len())]);
                key
            })
            .collect();
        assert!(keys.iter().any(String::is_empty));
        assert!(keys.iter().any(|k| k.len() > 255));
        let theirs: Vec<i32> = sqlx::query_scalar("SELECT hashtext(k) FROM unnest($1::text[]) k")
            .bind(&keys)
            .fetch_all(&pool)
            .await
            .unwrap();
        for (key, theirs) in keys.iter().zip(theirs) {
            assert_eq!(hashtext(key.as_bytes()), theirs, "key {key:?}");
        }
    }
}
