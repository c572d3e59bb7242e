//! Commands where the server has them: a claim by a pipelined `SET … NX GET`, and
//! compare-and-set, completion and renewal by `SET … IFEQ`, release by `DELIFEQ`, each on the
//! exact record the lease's claim wrote; `None` sends the caller to its script. What the server
//! has is asked once ([`RedisStore::offers`], which the doctor asks too), not read from its
//! version string.
//!
//! A command that finds another record there than the lease's does not settle the lease: it
//! compares every byte, the script only the owner, and the owner's record may have been written
//! again since this lease was made (its claim asked again by a clone of the request, after the
//! record expired). The script decides then, as it does on a server without the command: a
//! finalize that holds its key costs one command, one that lost it a command and a script.

use std::{
    sync::atomic::{AtomicU8, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use ::redis::{ErrorKind, Pipeline, RedisError, ServerErrorKind, Value};

use super::{Node, RedisStore, STORE, record};
use crate::store::{ClaimOutcome, ClaimRequest, Lease, Ownership, StoreError};

/// The compare-and-set commands a server has, as it says: a set of [`Offers::SET_IFEQ`],
/// [`Offers::DELIFEQ`] and [`Offers::DELEX`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Offers(u8);

impl Offers {
    /// `SET … IFEQ` (Valkey 8.1, Redis 8.4): completion and renewal.
    pub(super) const SET_IFEQ: Self = Self(1);
    /// `DELIFEQ` (Valkey 9.0): release.
    pub(super) const DELIFEQ: Self = Self(2);
    /// `DELEX` (Redis 8.4): named by the doctor, not used yet.
    pub(super) const DELEX: Self = Self(4);
    /// `SET … NX GET` (Redis 7.0, the release that brought `COMMAND DOCS`): the claim of a
    /// store without tombstones, or in front of an authority. Not a compare-and-set, so the
    /// doctor names it in its own words.
    pub(super) const SET_NX_GET: Self = Self(8);
    const NAMES: [(Self, &'static str); 3] = [
        (Self::SET_IFEQ, "SET IFEQ"),
        (Self::DELIFEQ, "DELIFEQ"),
        (Self::DELEX, "DELEX"),
    ];

    pub(super) fn has(self, command: Self) -> bool {
        self.0 & command.0 != 0
    }

    /// The commands' names, as the doctor prints them.
    pub(super) fn names(self) -> Vec<&'static str> {
        let offered = Self::NAMES.iter().filter(|(command, _)| self.has(*command));
        offered.map(|(_, name)| *name).collect()
    }

    /// What the probe's replies say; an error of the moment (`LOADING`, a cluster failing
    /// over) in either is the error, to ask again next time rather than take the server for
    /// one that has none of them.
    fn answered(replies: &[Value]) -> Result<Self, RedisError> {
        for reply in replies {
            if let Value::ServerError(error) = reply {
                let error = RedisError::from(error.clone());
                if !refusal(&error) {
                    return Err(error);
                }
            }
        }
        Ok(match replies {
            [docs, info] => Self::read(docs, info),
            _ => Self::default(),
        })
    }

    /// What `COMMAND DOCS SET` and `COMMAND INFO DELIFEQ DELEX` answered: `NX` with `GET`
    /// where the first answers at all (Redis 7.0 brought both), `IFEQ` where it names it, each
    /// delete the second does not answer nil for. A reply that is an error (a server older
    /// than `COMMAND DOCS`) offers nothing.
    fn read(docs: &Value, info: &Value) -> Self {
        let mut offers = Self::default();
        if matches!(docs, Value::Array(_) | Value::Map(_)) {
            offers.0 |= Self::SET_NX_GET.0;
        }
        if names(docs, "ifeq") {
            offers.0 |= Self::SET_IFEQ.0;
        }
        if let Value::Array(infos) = info {
            let deletes = [Self::DELIFEQ, Self::DELEX].into_iter().zip(infos);
            for (command, info) in deletes {
                if *info != Value::Nil {
                    offers.0 |= command.0;
                }
            }
        }
        offers
    }
}

/// Whether `value` (a `COMMAND DOCS` reply, nested) names `name`, in any case.
fn names(value: &Value, name: &str) -> bool {
    match value {
        Value::BulkString(bytes) => bytes.eq_ignore_ascii_case(name.as_bytes()),
        Value::SimpleString(text) => text.eq_ignore_ascii_case(name),
        Value::Array(items) | Value::Set(items) => items.iter().any(|item| names(item, name)),
        Value::Map(pairs) => pairs
            .iter()
            .any(|(key, value)| names(key, name) || names(value, name)),
        _ => false,
    }
}

/// What the store knows of its server's compare-and-set commands: nothing until it asked
/// once; then what the server offered, less what it refused since (an error reply writes
/// nothing: the script does that change's work from then on, for the life of the store).
#[derive(Debug, Default)]
pub(super) struct Known(AtomicU8);

/// The bit of [`Known`] that says the server was asked.
const ASKED: u8 = 0x80;

impl Known {
    fn get(&self) -> Option<Offers> {
        let known = self.0.load(Ordering::Relaxed);
        (known & ASKED != 0).then_some(Offers(known & !ASKED))
    }

    fn learn(&self, offers: Offers) {
        self.0.store(offers.0 | ASKED, Ordering::Relaxed);
    }

    fn refuse(&self, command: Offers) {
        self.0.fetch_and(!command.0, Ordering::Relaxed);
    }
}

impl RedisStore {
    /// The compare-and-set commands `node` has (the store's own connection for `None`), as it
    /// says, in one round trip: `COMMAND DOCS SET` for `IFEQ`, `COMMAND INFO` for `DELIFEQ`
    /// and `DELEX`. The commands themselves are not the probe: a server's error for an unknown
    /// command echoes its arguments, and a record's bytes make that error unreadable.
    pub(super) async fn offers(&self, node: &Node) -> Result<Offers, StoreError> {
        let mut probe = Pipeline::new();
        probe.ignore_errors();
        probe.cmd("COMMAND").arg("DOCS").arg("SET");
        probe.cmd("COMMAND").arg("INFO").arg("DELIFEQ").arg("DELEX");
        self.call(async |connection| {
            match connection.pipeline_on(node, &probe).await {
                Ok(replies) => Offers::answered(&replies),
                // A server that refuses the probe itself has none of them.
                Err(error) if refusal(&error) => Ok(Offers::default()),
                Err(error) => Err(error),
            }
        })
        .await
    }

    /// What the store's server offers, asked once (see [`offers`](Self::offers)); on a
    /// cluster, one node answers for all (a node that refuses a command later turns it off for
    /// the store). The error while it cannot be asked, to ask again next time.
    async fn known_offers(&self) -> Result<Offers, StoreError> {
        if let Some(known) = self.known.get() {
            return Ok(known);
        }
        // Boxed, as connecting is: asked once, carried by every call's future otherwise.
        let offers = Box::pin(self.offers(&None)).await?;
        self.known.learn(offers);
        Ok(offers)
    }

    /// Whether the store's server has `command` (see [`known_offers`](Self::known_offers));
    /// `false` while it cannot be asked.
    async fn offered(&self, command: Offers) -> bool {
        match self.known_offers().await {
            Ok(offers) => offers.has(command),
            Err(error) => {
                tracing::debug!(%error, "could not ask Redis for its compare-and-set commands: scripts do this change");
                false
            }
        }
    }

    /// A claim without a script: one `SET … NX GET PX`, a `PTTL` and a `TIME`, pipelined,
    /// instead of claim.lua. The record written is the one claim.lua writes, named by a fence
    /// from this machine's clock (completion and release compare the whole of it); the fence
    /// granted is the server's clock, read after the `SET` on the same connection.
    ///
    /// Why fences still grow without a transaction around the three: a `SET` that creates the
    /// record gives the key a whole lease, so only a server that stalled for a lease between
    /// the `SET` and the `TIME` could let another claimant in between, and the answer to such
    /// a claim comes more than a lease after it was sent: a grant is checked (renewed) before
    /// work starts under it when its answer came late (see [`ClaimOutcome::Acquired`]), and
    /// that renewal finds the key in other hands. A claim asked again by its owner finds its
    /// record with whatever is left of the lease, which may run out between the commands: that
    /// one is sent again as a transaction (`MULTI`), which grants it with the server's clock of
    /// a moment the record was still its own (later than every earlier claim's fence, and
    /// earlier than every later one's), or claims the key afresh if it expired. The time left
    /// on a key in flight is read after the `SET` too, so it is capped at this claim's lease
    /// (the owner may have completed it in between, giving it a retention).
    ///
    /// Tombstones are not read here (a store that keeps them claims with claim.lua, a store in
    /// front of an authority leaves them to it). `None` where the server has no
    /// `SET … NX GET` (Redis before 7.0), or refuses it, or where a cluster redirects the
    /// claim (the key's slot is moving): the caller runs claim.lua.
    ///
    /// In front of an authority (`in_front`) the fence granted only names the record (the
    /// handler gets the authority's): the claim is the `SET` and the `PTTL` alone, and a claim
    /// asked again by its owner is granted with its record's fence, not sent again.
    pub(super) async fn claim_by_command(
        &self,
        request: &ClaimRequest,
        in_front: bool,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        // A server that cannot be asked fails the claim now, as the script would, rather
        // than after the script's own wait.
        if !self.known_offers().await?.has(Offers::SET_NX_GET) {
            return Ok(None);
        }
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let name = u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX);
        let corrupt = |reason: String| StoreError::corrupt(STORE, request.record(), reason);
        let record = record::in_flight(request.fingerprint(), request.owner(), name)
            .ok_or_else(|| corrupt(format!("this machine's clock reads {name} µs")))?;
        let mut claim = self.claim_pipeline(request, record, !in_front);
        let (outcome, time) = loop {
            let Some((held, left, time)) = self.send_claim(&claim).await? else {
                return Ok(None);
            };
            let outcome = match &held {
                None => ClaimOutcome::Acquired { fence: name },
                Some(held) => {
                    let left = Duration::from_millis(u64::try_from(left).unwrap_or(0));
                    super::script::read_record(held, request, left).map_err(corrupt)?
                }
            };
            // Asked again by its owner: again, in a transaction (for a fence of the server's
            // clock of a moment the record was still its own).
            let asked_again = held.is_some() && matches!(outcome, ClaimOutcome::Acquired { .. });
            if asked_again && !in_front && !claim.is_transaction() {
                claim.atomic();
                continue;
            }
            break (outcome, time);
        };
        Ok(Some(match outcome {
            // The record this claim (or its owner's first) wrote is named by its fence; the
            // claim's fence is the server's clock.
            ClaimOutcome::Acquired { fence: written } => {
                request.note_written(written);
                let fence = time.map_or(Ok(written), |time| {
                    u64::try_from(super::admin::micros(time))
                });
                ClaimOutcome::Acquired {
                    fence: fence.unwrap_or(u64::MAX),
                }
            }
            ClaimOutcome::InFlight { retry_after } => ClaimOutcome::InFlight {
                retry_after: retry_after.min(request.lease()),
            },
            other => other,
        }))
    }

    /// Sends the claim of [`claim_by_command`](Self::claim_by_command): with the record there,
    /// its time left (ms), and the server's clock where it was asked; `None` where claim.lua
    /// claims instead.
    async fn send_claim(&self, claim: &Pipeline) -> Result<Option<ClaimReply>, StoreError> {
        let asks_time = claim.len() == 3;
        self.call(
            async |connection| match claim.query_async::<Vec<Value>>(connection).await {
                Err(error) if refusal(&error) => {
                    tracing::debug!(%error, "Redis refused SET … NX GET: claim.lua claims");
                    self.known.refuse(Offers::SET_NX_GET);
                    Ok(None)
                }
                // The client follows a cluster's redirections for one command, not for a
                // pipeline or a transaction, which the node did not run: the script claims this
                // once.
                Err(error) if redirected(&error) => {
                    tracing::debug!(%error, "the key's slot is moving: claim.lua claims");
                    Ok(None)
                }
                Err(error) => Err(error),
                Ok(reply) => claim_reply(reply, asks_time).map(Some),
            },
        )
        .await
    }

    /// The pipeline of [`claim_by_command`](Self::claim_by_command): `record` set where no
    /// record is, for the lease, with the record there, its time left and, `with_time`, the
    /// server's clock.
    fn claim_pipeline(&self, request: &ClaimRequest, record: Vec<u8>, with_time: bool) -> Pipeline {
        let key = self.record_key(request.record());
        // Each command built at its size (see `super::command`): `NX GET PX` and 20 digits.
        let mut set = super::command("SET", 7, key.len() + record.len() + 27);
        set.arg(&key).arg(record).arg("NX").arg("GET");
        set.arg("PX").arg(super::millis(request.lease()));
        let mut left = super::command("PTTL", 2, key.len());
        left.arg(&key);
        let mut claim = ::redis::Pipeline::with_capacity(3);
        claim.add_command(set);
        claim.add_command(left);
        if with_time {
            claim.add_command(super::command("TIME", 1, 0));
        }
        claim
    }

    /// Runs `command`, made from the lease's Redis key (`key`) and the exact record its claim
    /// wrote, and returns the server's reply. `None`: the lease does not know its record (no receipt), or
    /// the server does not offer the command, or refuses it now (an error reply: nothing was
    /// written, and the scripts do its work from then on): the caller runs its script.
    async fn on_claimed_record(
        &self,
        (lease, key): (&Lease, &str),
        offer: Offers,
        command: impl FnOnce(&str, Vec<u8>) -> ::redis::Cmd,
    ) -> Result<Option<Value>, StoreError> {
        let Some(current) = lease.receipt().and_then(|receipt| {
            record::in_flight(receipt.fingerprint, lease.owner(), receipt.fence)
        }) else {
            return Ok(None);
        };
        if !self.offered(offer).await {
            return Ok(None);
        }
        let command = command(key, current);
        let reply = self
            .call(async |connection| match command.query_async(connection).await {
                Err(error) if refusal(&error) => {
                    tracing::debug!(%error, "Redis refused a compare-and-set command: scripts do its work");
                    Ok(None)
                }
                reply => reply.map(Some),
            })
            .await?;
        if reply.is_none() {
            self.known.refuse(offer);
        }
        Ok(reply)
    }

    /// Writes `next` (made from the record the lease's claim wrote) over that exact record, at
    /// `key`, for `millis`, with one `SET … IFEQ`; `None` where the caller runs its script (see
    /// [`on_claimed_record`](Self::on_claimed_record)), and where the record there is another
    /// (the script decides: see the module's docs).
    pub(super) async fn compare_and_set(
        &self,
        (lease, key): (&Lease, &str),
        next: impl FnOnce(&[u8]) -> Vec<u8>,
        millis: u64,
    ) -> Result<Option<Ownership>, StoreError> {
        let reply = self
            .on_claimed_record((lease, key), Offers::SET_IFEQ, |key, current| {
                let next = next(&current);
                // `IFEQ`, `PX` and 20 digits.
                let bytes = key.len() + next.len() + current.len() + 26;
                let mut set = super::command("SET", 7, bytes);
                set.arg(key)
                    .arg(next)
                    .arg("IFEQ")
                    .arg(&current)
                    .arg("PX")
                    .arg(millis);
                set
            })
            .await?;
        reply
            .and_then(|reply| match reply {
                Value::Okay => Some(Ok(Ownership::Held)),
                Value::Nil => None,
                other => Some(Err(unexpected(lease, "SET … IFEQ", &other))),
            })
            .transpose()
    }

    /// Deletes the exact record the lease's claim wrote, at `key`, with one `DELIFEQ`; `None` where the
    /// caller runs its script (see [`on_claimed_record`](Self::on_claimed_record)), and where the
    /// record there is another (the script decides: see the module's docs).
    pub(super) async fn delete_if_equal(
        &self,
        (lease, key): (&Lease, &str),
    ) -> Result<Option<Ownership>, StoreError> {
        let reply = self
            .on_claimed_record((lease, key), Offers::DELIFEQ, |key, current| {
                let mut delete = super::command("DELIFEQ", 3, key.len() + current.len());
                delete.arg(key).arg(current);
                delete
            })
            .await?;
        reply
            .and_then(|reply| match reply {
                Value::Int(1) => Some(Ok(Ownership::Held)),
                Value::Int(0) => None,
                other => Some(Err(unexpected(lease, "DELIFEQ", &other))),
            })
            .transpose()
    }
}

/// A claim pipeline's replies: the record there (if any), its time left (ms), and the server's
/// clock (seconds, microseconds) where it was asked.
type ClaimReply = (Option<Vec<u8>>, i64, Option<(u64, u64)>);

/// Reads a claim pipeline's replies, the server's clock among them where it was asked
/// (`asks_time`).
fn claim_reply(reply: Vec<Value>, asks_time: bool) -> Result<ClaimReply, RedisError> {
    let mut replies = reply.into_iter();
    let mut next = || {
        let short = || RedisError::from((ErrorKind::Client, "a short claim reply"));
        replies.next().ok_or_else(short)
    };
    let held: Option<Vec<u8>> = ::redis::from_redis_value(next()?)?;
    let left: i64 = ::redis::from_redis_value(next()?)?;
    let time = match asks_time {
        true => Some(::redis::from_redis_value(next()?)?),
        false => None,
    };
    Ok((held, left, time))
}

/// Whether `error` says the server does not have what it was sent (`ERR`: an unknown command
/// or argument; it wrote nothing), as opposed to an error of the moment (`LOADING`, `MOVED`,
/// `CLUSTERDOWN`, …), which must not make the store give up a command for good.
fn refusal(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
}

/// Whether `error` says a cluster's node did not run a claim because the key's slot is
/// elsewhere, or on its way there (`MOVED`, `ASK`): as the pipeline's own error, or as the
/// error of a transaction the node discarded.
fn redirected(error: &RedisError) -> bool {
    let redirection = |kind| matches!(kind, ServerErrorKind::Moved | ServerErrorKind::Ask);
    match error.kind() {
        ErrorKind::Server(kind) if redirection(kind) => true,
        ErrorKind::Server(ServerErrorKind::ExecAbort) => (error.clone().into_server_errors())
            .is_some_and(|errors| {
                errors
                    .iter()
                    .any(|(_, error)| error.kind().is_some_and(redirection))
            }),
        _ => false,
    }
}

/// A reply a compare-and-set `command` never gives.
fn unexpected(lease: &Lease, command: &str, reply: &Value) -> StoreError {
    StoreError::corrupt(
        STORE,
        lease.record(),
        format!("unexpected {command} reply {reply:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(resp: &str) -> Value {
        ::redis::parse_redis_value(resp.as_bytes()).unwrap()
    }

    #[test]
    fn an_unknown_command_offers_nothing_and_an_error_of_the_moment_is_asked_again() {
        let docs = reply("*2\r\n$3\r\nset\r\n*2\r\n$4\r\nifeq\r\n$2\r\nnx\r\n");
        let info = reply("*2\r\n*1\r\n$7\r\ndelifeq\r\n_\r\n");
        let offers = Offers::answered(&[docs.clone(), info]).unwrap();
        assert_eq!(offers.names(), ["SET IFEQ", "DELIFEQ"]);
        assert!(offers.has(Offers::SET_NX_GET));

        // Redis 6.2: no `COMMAND DOCS`; `COMMAND INFO` answers nil for both deletes.
        let unknown = reply("-ERR unknown subcommand 'DOCS'\r\n");
        let none = reply("*2\r\n_\r\n_\r\n");
        let offers = Offers::answered(&[unknown, none.clone()]).unwrap();
        assert_eq!(offers, Offers::default());

        for busy in [
            "-LOADING loading the dataset\r\n",
            "-CLUSTERDOWN the cluster is down\r\n",
        ] {
            let answered = Offers::answered(&[reply(busy), none.clone()]);
            assert!(answered.is_err(), "{busy:?} was taken for an answer");
        }
    }

    #[test]
    fn only_an_err_reply_is_a_refusal() {
        let error = |resp: &str| match reply(resp) {
            Value::ServerError(error) => RedisError::from(error),
            other => panic!("{other:?}"),
        };
        assert!(refusal(&error("-ERR syntax error\r\n")));
        for moment in [
            "-MOVED 3999 127.0.0.1:6381\r\n",
            "-TRYAGAIN\r\n",
            "-READONLY\r\n",
        ] {
            assert!(!refusal(&error(moment)), "{moment:?}");
        }
    }
}
