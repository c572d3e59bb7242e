//! The optional hash-partitioned table: the store's statements work on it unchanged, within fast-path locks.

use super::*;

/// A statement's generic plan (the store's connections force them) locks every partition
/// before it prunes to one: the migration's partitions keep a key lookup within the locks a
/// session takes without the shared lock manager (its fast-path locks; 16 partitions took 34
/// others, and cost up to 0.75x the plain table's throughput). Measured as the store runs its
/// statements: planned once on a connection (which also locks every index of every partition,
/// once), then executed from the connection's cache, taking the partitions and the index the
/// lookup uses.
///
/// Two checks. The lookup takes no more relation locks than a backend has fast-path slots (16
/// before PostgreSQL 18): a plan that locks more fails every time. And the locks did go the
/// fast path, in one of a few transactions: PostgreSQL moves a lock to the shared table while
/// any session holds a strong lock on a relation of the same lock partition, and the other
/// tests' schemas are created and dropped beside this one.
pub(crate) async fn a_key_lookup_on_the_partitioned_table_takes_only_fast_path_locks() {
    const FAST_PATH_SLOTS: i64 = 16;
    let schema = TestSchema::new().await;
    partition(&schema.pool).await;
    let mut connection = schema.pool.acquire().await.unwrap();
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut *connection)
        .await
        .unwrap();
    // Planned, and cached on the connection.
    look_up(&mut connection).await;
    let mut missed = Vec::new();
    for _ in 0..5 {
        let (slow, all) = relation_locks_of_a_lookup(&mut connection).await;
        assert!(
            all > 4,
            "the lookup locked {all} relations: not the partitioned table?"
        );
        assert!(
            all <= FAST_PATH_SLOTS,
            "the lookup locked {all} relations, more than a backend's {FAST_PATH_SLOTS} fast-path slots"
        );
        if slow == 0 {
            return;
        }
        missed.push(format!("{slow} of {all}"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "relation locks missed the fast path in every transaction: {}",
        missed.join(", ")
    );
}

async fn look_up(connection: &mut sqlx::PgConnection) {
    let found: Option<String> =
        sqlx::query_scalar("SELECT state FROM idempotency_keys WHERE scope = $1 AND key = $2")
            .bind("tenant")
            .bind("k-locks")
            .fetch_optional(connection)
            .await
            .unwrap();
    assert_eq!(found, None);
}

/// In a transaction of its own, a cached lookup's relation locks: how many missed the fast
/// path, and how many there were.
async fn relation_locks_of_a_lookup(connection: &mut sqlx::PgConnection) -> (i64, i64) {
    let mut tx = sqlx::Connection::begin(connection).await.unwrap();
    look_up(&mut tx).await;
    let locks: Vec<(bool, i64)> = sqlx::query_as(
        "SELECT fastpath, count(*) FROM pg_locks
         WHERE pid = pg_backend_pid() AND locktype = 'relation' GROUP BY fastpath",
    )
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let slow = locks.iter().filter(|(fast, _)| !fast).map(|(_, n)| n).sum();
    (slow, locks.iter().map(|(_, n)| n).sum())
}

/// On the partitioned table: rows spread over the partitions, the fence commits and stores its
/// response, the sweeper deletes expired rows in every partition, the admin operations find
/// keys; and the table is partitioned (the test would pass on a plain one otherwise).
pub(crate) async fn the_fence_the_sweeper_and_the_admin_work_on_the_partitioned_table() {
    let schema = TestSchema::new().await;
    partition(&schema.pool).await;
    partition(&schema.pool).await;
    let partitioned: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'idempotency_keys'::regclass)",
    )
    .fetch_one(&schema.pool)
    .await
    .unwrap();
    assert!(partitioned);
    let store = PostgresStore::new(schema.pool.clone());
    let short = Duration::from_millis(100);
    for k in 0..64 {
        let request = claim_request(&format!("k-{k}"), short);
        let lease = acquire(&store, &request).await;
        if k % 2 == 0 {
            let mut tx = schema.pool.begin().await.unwrap();
            let answer = http::Response::builder()
                .status(StatusCode::CREATED)
                .body(bytes::Bytes::from_static(b"{}"))
                .unwrap();
            // The layer gives the fence and the completion the same retention.
            IdempotencyClaim::new(lease.clone(), short)
                .commit_with_response(&mut tx, &answer)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
        store
            .complete(&lease, &response(StatusCode::CREATED), short)
            .await
            .unwrap();
    }
    acquire(&store, &claim_request("live", LONG)).await;
    let partitions: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT tableoid) FROM idempotency_keys")
            .fetch_one(&schema.pool)
            .await
            .unwrap();
    assert_eq!(partitions, 4, "65 keys in {partitions} partitions");
    let live = claim_request("live", LONG).record().clone();
    let info = store.inspect(&live).await.unwrap().unwrap();
    assert_eq!(info.state, tower_idempotency::store::RecordState::InFlight);
    assert_eq!(store.stuck(Duration::ZERO, 10).await.unwrap().len(), 1);

    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.sweep().await.unwrap(), 64);
    assert!(store.forget(&live).await.unwrap());
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&schema.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    schema.drop().await;
}
