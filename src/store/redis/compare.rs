//! Compare-and-set where the server has it: completion and renewal by `SET … IFEQ`, release
//! by `DELIFEQ`, each on the exact record the lease's claim wrote; `None` sends the caller to
//! its script.

use std::sync::atomic::{AtomicBool, Ordering};

use ::redis::{ErrorKind, ServerErrorKind, Value};

use super::{RedisStore, STORE, record};
use crate::store::{Lease, Ownership, StoreError};

impl RedisStore {
    /// Runs `command`, made from the lease's Redis key and the exact record its claim wrote, and
    /// returns the server's reply. `None`: the lease does not know its record (no receipt), or
    /// the server refuses the command, now or before (`refused`: it answered an error, so
    /// nothing was written): the caller runs its script.
    async fn on_claimed_record(
        &self,
        lease: &Lease,
        refused: &AtomicBool,
        command: impl FnOnce(String, Vec<u8>) -> ::redis::Cmd,
    ) -> Result<Option<Value>, StoreError> {
        if refused.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let Some(current) = lease.receipt().and_then(|receipt| {
            record::in_flight(receipt.fingerprint, lease.owner(), receipt.fence)
        }) else {
            return Ok(None);
        };
        let command = command(self.record_key(lease.record()), current);
        let reply = self
            .call(async |connection| match command.query_async(connection).await {
                Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::ResponseError) => {
                    tracing::debug!(%error, "Redis refused a compare-and-set command: scripts do its work");
                    Ok(None)
                }
                reply => reply.map(Some),
            })
            .await?;
        if reply.is_none() {
            refused.store(true, Ordering::Relaxed);
        }
        Ok(reply)
    }

    /// Writes `next` (made from the record the lease's claim wrote) over that exact record, for
    /// `millis`, with one `SET … IFEQ`; `None` where the caller runs its script (see
    /// [`on_claimed_record`](Self::on_claimed_record)).
    pub(super) async fn compare_and_set(
        &self,
        lease: &Lease,
        next: impl FnOnce(&[u8]) -> Vec<u8>,
        millis: u64,
    ) -> Result<Option<Ownership>, StoreError> {
        let reply = self
            .on_claimed_record(lease, &self.refused.set_ifeq, |key, current| {
                let mut set = ::redis::cmd("SET");
                set.arg(key)
                    .arg(next(&current))
                    .arg("IFEQ")
                    .arg(&current)
                    .arg("PX")
                    .arg(millis);
                set
            })
            .await?;
        reply
            .map(|reply| match reply {
                Value::Okay => Ok(Ownership::Held),
                Value::Nil => Ok(Ownership::Lost),
                other => Err(unexpected(lease, "SET … IFEQ", &other)),
            })
            .transpose()
    }

    /// Deletes the exact record the lease's claim wrote with one `DELIFEQ`; `None` where the
    /// caller runs its script (see [`on_claimed_record`](Self::on_claimed_record)).
    pub(super) async fn delete_if_equal(
        &self,
        lease: &Lease,
    ) -> Result<Option<Ownership>, StoreError> {
        if !self.refused.delifeq_asked.load(Ordering::Relaxed) && !self.ask_for_delifeq().await {
            return Ok(None);
        }
        let reply = self
            .on_claimed_record(lease, &self.refused.delifeq, |key, current| {
                let mut delete = ::redis::cmd("DELIFEQ");
                delete.arg(key).arg(current);
                delete
            })
            .await?;
        reply
            .map(|reply| match reply {
                Value::Int(1) => Ok(Ownership::Held),
                Value::Int(0) => Ok(Ownership::Lost),
                other => Err(unexpected(lease, "DELIFEQ", &other)),
            })
            .transpose()
    }

    /// Asks the server whether it has `DELIFEQ` (`COMMAND INFO`, see [`known`]) and remembers
    /// the answer; `false` when it could not be asked, to ask
    /// again next time. The command itself is not the probe: a server's error for an unknown
    /// command echoes its arguments, and a record's bytes make that error unreadable.
    async fn ask_for_delifeq(&self) -> bool {
        let mut info = ::redis::cmd("COMMAND");
        info.arg("INFO").arg("DELIFEQ");
        let reply = self
            .call(async |connection| info.query_async::<Value>(connection).await)
            .await;
        let Ok(reply) = reply else {
            return false;
        };
        if known(&reply, &["DELIFEQ"]).is_empty() {
            self.refused.delifeq.store(true, Ordering::Relaxed);
        }
        self.refused.delifeq_asked.store(true, Ordering::Relaxed);
        true
    }
}

/// The compare-and-set commands a server refused (it answered an error and wrote nothing): the
/// scripts do their work from then on, for the life of the store.
#[derive(Debug, Default)]
pub(super) struct Refused {
    /// `SET … IFEQ` (Valkey 8.1, Redis 8.4): completion and renewal.
    set_ifeq: AtomicBool,
    /// `DELIFEQ` (Valkey 9.0): release.
    delifeq: AtomicBool,
    /// Whether the server was asked for `DELIFEQ` (see `ask_for_delifeq`).
    delifeq_asked: AtomicBool,
}

/// Which of `names` a `COMMAND INFO` of them, in that order, says the server knows: it answers
/// nil for a command it does not.
pub(super) fn known<'n>(reply: &Value, names: &[&'n str]) -> Vec<&'n str> {
    let Value::Array(infos) = reply else {
        return Vec::new();
    };
    let answers = names.iter().zip(infos);
    answers
        .filter(|(_, info)| **info != Value::Nil)
        .map(|(name, _)| *name)
        .collect()
}

/// A reply a compare-and-set `command` never gives.
fn unexpected(lease: &Lease, command: &str, reply: &Value) -> StoreError {
    StoreError::corrupt(
        STORE,
        lease.record(),
        format!("unexpected {command} reply {reply:?}"),
    )
}
