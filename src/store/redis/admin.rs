//! What an operator sees of the Redis store's records: one key inspected or forgotten, and
//! the keys stuck in flight, found by scanning every master.

use std::time::Duration;

use ::redis::Value;

use super::{Node, Record, RedisStore, STORE, Tombstone, from_value, since};
use crate::store::{
    Admin, BoxFuture, Diagnosis, RecordInfo, RecordKey, RecordState, Severity, StoreError,
};

impl Admin for RedisStore {
    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        Box::pin(self.inspect_record(record))
    }

    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.forget_record(record))
    }

    /// Scans the keys under the store's prefix: an operator's tool, which costs Redis a pass over
    /// its keyspace (in batches of 1000, never blocking it); on a cluster, every master's.
    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>> {
        Box::pin(self.stuck_records(older_than, limit))
    }

    fn diagnose(&self) -> BoxFuture<'_, Diagnosis> {
        Box::pin(async move {
            let mut diagnosis = self.diagnosis().await;
            let policy = format!(
                "while Redis cannot be reached or is slower than the store's timeout ({:?}), \
                 guarded requests answer 503 with Retry-After and no handler runs",
                self.timeout
            );
            diagnosis.push(Severity::Ok, STORE, "failure-policy", policy);
            diagnosis
        })
    }
}

impl RedisStore {
    /// What an operator sees of `record`: its record, or its tombstone.
    async fn inspect_record(&self, record: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        let key = self.record_key(record);
        let info = match self.read(&key).await? {
            (Some(value), pttl, now) => Some(record_info(record.clone(), &value, pttl, now)),
            (None, ..) => match self.tombstone_key(&key) {
                Some(tombstone) => match self.read(&tombstone).await? {
                    (Some(value), pttl, now) => {
                        Some(tombstone_info(record.clone(), &value, pttl, now))
                    }
                    (None, ..) => None,
                },
                None => None,
            },
        };
        info.transpose()
            .map_err(|reason| StoreError::corrupt(STORE, record, reason))
    }

    /// Deletes `record` and its tombstone; whether there was either.
    async fn forget_record(&self, record: &RecordKey) -> Result<bool, StoreError> {
        let key = self.record_key(record);
        let mut del = ::redis::cmd("DEL");
        // The tombstone's name is in the record's slot: one command.
        del.arg(self.tombstone_key(&key)).arg(key);
        let deleted: i64 = self
            .call(async |connection| del.query_async(connection).await)
            .await?;
        Ok(deleted > 0)
    }

    /// The records in flight for longer than `older_than`, oldest first, up to `limit`, from
    /// every master.
    async fn stuck_records(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<Vec<RecordInfo>, StoreError> {
        let masters = self
            .call(async |connection| connection.masters().await)
            .await?;
        let mut stuck = Vec::new();
        for master in &masters {
            self.stuck_on(master, older_than, &mut stuck).await?;
        }
        stuck.sort_by_key(|info| std::cmp::Reverse(info.age));
        stuck.truncate(limit);
        Ok(stuck)
    }

    /// `key`'s value, what is left of its expiry (ms) and the server's clock (µs), in one round
    /// trip: on a cluster, all three go to the key's master.
    async fn read(&self, key: &str) -> Result<(Option<Vec<u8>>, i64, u128), StoreError> {
        let mut pipe = ::redis::pipe();
        pipe.cmd("GET").arg(key).cmd("PTTL").arg(key).cmd("TIME");
        let (value, pttl, now): (Option<Vec<u8>>, i64, (u64, u64)) = self
            .call(async |connection| pipe.query_async(connection).await)
            .await?;
        Ok((value, pttl, micros(now)))
    }

    /// The stuck records of one master (or of the one server), each call under the timeout.
    async fn stuck_on(
        &self,
        node: &Node,
        older_than: Duration,
        stuck: &mut Vec<RecordInfo>,
    ) -> Result<(), StoreError> {
        let pattern = format!("{}*", self.prefix);
        let mut cursor = 0u64;
        loop {
            let mut scan = ::redis::pipe();
            scan.cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000);
            let reply = self
                .call(async |connection| connection.pipeline_on(node, &scan).await)
                .await?;
            let ((next, keys),): ((u64, Vec<Vec<u8>>),) = from_value(Value::Array(reply))?;
            // Keys from one master's SCAN and its clock (a key migrating away answers with an
            // error in its place, and is skipped).
            let mut pipe = ::redis::pipe();
            for key in &keys {
                pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
            }
            pipe.cmd("TIME");
            let mut replies = self
                .call(async |connection| connection.pipeline_on(node, &pipe).await)
                .await?;
            let now: (u64, u64) = from_value(replies.pop().unwrap_or(Value::Nil))?;
            let now = micros(now);
            for (key, pair) in keys.iter().zip(replies.chunks(2)) {
                let (Some(record), [Value::BulkString(value), Value::Int(pttl)]) =
                    (self.parse_record_key(key), pair)
                else {
                    continue;
                };
                if let Ok(info) = record_info(record, value, *pttl, now)
                    && info.state == RecordState::InFlight
                    && info.age.is_some_and(|age| age >= older_than)
                {
                    stuck.push(info);
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(());
            }
        }
    }
}

/// What a tombstone says, for an operator: no owner or fence (it keeps neither), its age from
/// the key's completion, its expiry the horizon's end. `now` is the server's clock in
/// microseconds.
fn tombstone_info(
    record: RecordKey,
    value: &[u8],
    pttl: i64,
    now: u128,
) -> Result<RecordInfo, String> {
    let tombstone = Tombstone::parse(value)?;
    Ok(RecordInfo {
        record,
        state: RecordState::AnswerExpired,
        fence: 0,
        owner: uuid::Uuid::nil(),
        lease_left: None,
        age: Some(since(u128::from(tombstone.completed), now)),
        expires_in: Duration::from_millis(u64::try_from(pttl).unwrap_or(0)),
        status: Some(tombstone.status),
        unfinished: None,
    })
}

/// What a record says, for an operator: `now` is the Redis server's clock in microseconds, and
/// so is the fence (the claim's time), or the claiming machine's on a record claimed without a
/// script.
fn record_info(
    record: RecordKey,
    value: &[u8],
    pttl: i64,
    now: u128,
) -> Result<RecordInfo, String> {
    let parsed = Record::parse(value)?;
    let left = Duration::from_millis(u64::try_from(pttl).unwrap_or(0));
    let (state, lease_left, status) = match parsed.response()? {
        None => (RecordState::InFlight, Some(left), None),
        Some(response) => (RecordState::Completed, None, Some(response.status())),
    };
    let (owner, fence) = (parsed.owner, parsed.fence);
    Ok(RecordInfo {
        record,
        state,
        fence,
        owner,
        lease_left,
        age: Some(since(u128::from(fence), now)),
        expires_in: left,
        status,
        unfinished: None,
    })
}

/// `TIME`'s answer (seconds, microseconds) in microseconds.
pub(super) fn micros((seconds, micros): (u64, u64)) -> u128 {
    u128::from(seconds) * 1_000_000 + u128::from(micros)
}
