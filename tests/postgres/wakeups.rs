//! A duplicate on another instance woken by Postgres (`LISTEN`/`NOTIFY`) the moment the first
//! completes, and a key nobody waits for never told.

use sqlx::postgres::PgListener;

use super::*;

/// A duplicate on another instance (another store object, with a listener of its own) is woken
/// the moment the first completes, without polling: the completion of the key it waits for is
/// told once on the channel, and one of a key nobody waits for never. Its listener terminated
/// while it waits (`pg_terminate_backend`), it listens again (and claims once more meanwhile),
/// and is answered all the same.
pub(crate) async fn a_duplicate_elsewhere_is_woken_by_postgres_and_a_key_nobody_waits_for_is_never_told()
 {
    let schema = TestSchema::new().await;
    let store = || PostgresStore::new(schema.pool.clone());
    let mut heard = PgListener::connect_with(&schema.pool).await.unwrap();
    heard.listen("tower_idempotency").await.unwrap();

    let alone = Router::new().route(
        "/pay",
        axum::routing::post(|| async { (StatusCode::CREATED, "paid") })
            .route_layer(IdempotencyLayer::new(store())),
    );
    let request = Request::post("/pay")
        .header("idempotency-key", "k-alone")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(
        support::call(&alone, request).await.status,
        StatusCode::CREATED
    );

    let woken = support::duplicate_elsewhere((store(), store()), "k-waited", async || {}).await;
    woken.assert_woken(1, "k-waited");

    let killed = support::duplicate_elsewhere((store(), store()), "k-killed", async || {
        // Every listener of the server (other tests' too: theirs listen again as well).
        let terminated: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'tower-idempotency listener'",
        )
        .fetch_all(&schema.pool)
        .await
        .unwrap();
        assert!(terminated.contains(&true), "no listener to terminate");
        tokio::time::sleep(Duration::from_millis(500)).await;
    })
    .await;
    // Woken when its listener was lost (it claimed, and marked, again), then by the word.
    killed.assert_woken(2, "k-killed");

    // What the channel said of this test's keys (other tests' keys have other ids).
    let mut told = std::collections::HashMap::<String, usize>::new();
    while let Ok(Ok(notification)) =
        tokio::time::timeout(Duration::from_millis(500), heard.recv()).await
    {
        *told.entry(notification.payload().to_owned()).or_default() += 1;
    }
    for (key, times) in [("k-alone", 0), ("k-waited", 1), ("k-killed", 1)] {
        let id: String =
            sqlx::query_scalar("SELECT hashtext($1)::text || ':' || hashtext($2)::text")
                .bind(tower_idempotency::scope::ANONYMOUS_SCOPE)
                .bind(key)
                .fetch_one(&schema.pool)
                .await
                .unwrap();
        assert_eq!(told.get(&id).copied().unwrap_or(0), times, "{key} told");
    }
    // Its connection goes back to the pool, which the schema's drop closes.
    drop(heard);
    schema.drop().await;
}
