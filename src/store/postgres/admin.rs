//! What an operator and the completer see of the Postgres store: one key inspected or
//! forgotten, the keys stuck in flight, the servers' checks, the keys abandoned mid-way, and
//! the answers the application rebuilt for keys committed without one.

use std::time::Duration;

use sqlx::{Row, postgres::PgRow};

use super::{
    PostgresStore, STORE, backend,
    claim::{column_millis, column_status},
    millis,
    sql::{ABANDONED, ADOPT, FORGET, INSPECT, NOTE_UNFINISHED, STUCK},
};
use crate::{
    response::StoredResponse,
    store::{
        Abandoned, Admin, BoxFuture, ClaimRequest, Diagnosis, RecordInfo, RecordKey, RecordState,
        Recovery, Severity, StoreError,
    },
};

impl Admin for PostgresStore {
    fn diagnose(&self) -> BoxFuture<'_, Diagnosis> {
        Box::pin(async move {
            let mut diagnosis = self.diagnosis().await;
            let policy = format!(
                "while Postgres cannot be reached, has no connection free or is slower than the \
                 store's timeout ({:?}), guarded requests answer 503 with Retry-After and no \
                 handler runs",
                self.timeout
            );
            diagnosis.push(Severity::Ok, STORE, "failure-policy", policy);
            diagnosis
        })
    }

    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        Box::pin(async move {
            let row = self
                .on_key(
                    (record.scope(), record.key().as_str()),
                    async |connection| {
                        sqlx::query(INSPECT)
                            .bind(record.scope())
                            .bind(record.key().as_str())
                            .bind(millis(self.horizon))
                            .fetch_optional(connection)
                            .await
                    },
                )
                .await?;
            row.map(|row| read_info(&row)).transpose()
        })
    }

    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let deleted = self
                .on_key(
                    (record.scope(), record.key().as_str()),
                    async |connection| {
                        sqlx::query(FORGET)
                            .bind(record.scope())
                            .bind(record.key().as_str())
                            .execute(connection)
                            .await
                    },
                )
                .await?;
            Ok(deleted.rows_affected() > 0)
        })
    }

    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>> {
        Box::pin(async move {
            let rows = self
                .on_connection(async |connection| {
                    sqlx::query(STUCK)
                        .bind(millis(older_than))
                        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                        .fetch_all(connection)
                        .await
                })
                .await?;
            rows.iter().map(read_info).collect()
        })
    }
}

impl Recovery for PostgresStore {
    fn abandoned<'a>(&'a self, limit: usize) -> BoxFuture<'a, Result<Vec<Abandoned>, StoreError>> {
        Box::pin(async move {
            let rows = self
                .on_connection(async |connection| {
                    sqlx::query(ABANDONED)
                        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                        .fetch_all(connection)
                        .await
                })
                .await?;
            rows.iter().map(read_abandoned).collect()
        })
    }

    fn note_unfinished<'a>(
        &'a self,
        record: &'a RecordKey,
        why: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.on_key(
                (record.scope(), record.key().as_str()),
                async |connection| {
                    sqlx::query(NOTE_UNFINISHED)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(why)
                        .execute(connection)
                        .await
                },
            )
            .await?;
            Ok(())
        })
    }

    fn adopt<'a>(
        &'a self,
        request: &'a ClaimRequest,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let record = request.record();
            let adopted = self
                .on_key(
                    (record.scope(), record.key().as_str()),
                    async |connection| {
                        sqlx::query(ADOPT)
                            .bind(record.scope())
                            .bind(record.key().as_str())
                            .bind(&request.fingerprint().as_bytes()[..])
                            .bind(response.status().as_u16() as i16)
                            .bind(response.encode().to_vec())
                            .bind(millis(retention))
                            .execute(connection)
                            .await
                    },
                )
                .await?;
            Ok(adopted.rows_affected() == 1)
        })
    }
}

/// A row of [`ABANDONED`].
fn read_abandoned(row: &PgRow) -> Result<Abandoned, StoreError> {
    let record = read_record(row)?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(backend)?;
    let Ok(fingerprint) = <[u8; 32]>::try_from(fingerprint) else {
        return Err(StoreError::corrupt(
            STORE,
            &record,
            "a fingerprint not of 32 bytes",
        ));
    };
    let state = match row.try_get::<String, _>("state").map_err(backend)?.as_str() {
        "committed" => RecordState::Committed,
        _ => RecordState::InFlight,
    };
    let request: Option<Vec<u8>> = row.try_get("request").map_err(backend)?;
    Ok(Abandoned {
        record,
        fingerprint: crate::fingerprint::Fingerprint::from_bytes(fingerprint),
        state,
        recovery_point: row.try_get("recovery_point").map_err(backend)?,
        request: request.map(bytes::Bytes::from),
        lapsed: column_millis(row, "lapsed_ms")?,
    })
}

/// The key and scope of a row.
fn read_record(row: &PgRow) -> Result<RecordKey, StoreError> {
    let scope: String = row.try_get("scope").map_err(backend)?;
    let key: String = row.try_get("key").map_err(backend)?;
    let key =
        crate::IdempotencyKey::try_from(key.as_str()).map_err(|e| StoreError::backend(STORE, e))?;
    Ok(RecordKey::new(scope, key))
}

/// An operator's view of a row of [`INSPECT`] or [`STUCK`].
fn read_info(row: &PgRow) -> Result<RecordInfo, StoreError> {
    let record = read_record(row)?;
    let state = match row.try_get::<String, _>("state").map_err(backend)?.as_str() {
        "in_flight" => RecordState::InFlight,
        "committed" => RecordState::Committed,
        "completed" => RecordState::Completed,
        "tombstone" => RecordState::AnswerExpired,
        other => {
            let unknown = format!("unknown state {other:?}");
            return Err(StoreError::corrupt(STORE, &record, unknown));
        }
    };
    let millis = |column| column_millis(row, column);
    let fence: i64 = row.try_get("fence").map_err(backend)?;
    Ok(RecordInfo {
        state,
        fence: u64::try_from(fence).unwrap_or_default(),
        owner: row.try_get("owner").map_err(backend)?,
        lease_left: matches!(state, RecordState::InFlight | RecordState::Committed)
            .then(|| millis("lease_ms"))
            .transpose()?,
        age: Some(millis("age_ms")?),
        expires_in: millis("expires_ms")?,
        status: column_status(row)?,
        unfinished: row.try_get("unfinished").map_err(backend)?,
        record,
    })
}
