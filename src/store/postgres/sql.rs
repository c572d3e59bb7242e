//! The statements of the Postgres store.

use std::sync::OnceLock;

/// A claim's verdict on the row there is (`idempotency_keys`' columns, or [`CLAIM_MANY`]'s
/// `cur`), and what it answers with: `verdict`, `fence`, `response`, `lease_ms`, `expires_ms`,
/// `status`, `ran_ms` (how long ago it completed). The arguments say how the statement reads
/// whether the row's fingerprint is the claim's (`same`), whether the claim's owner holds it
/// (`mine`), whether its lease and its record are current (`leased`, `live`), whether it has a
/// recovery point (`resumable`), and whether it is a tombstone (`buried`: its answer past its
/// retention, within the store's horizon; see `buried!`).
macro_rules! claim_verdict {
    ($same:literal, $mine:literal, $leased:literal, $live:literal, $resumable:literal, $buried:expr) => {
        concat!(
            "CASE
           WHEN ",
            $mine,
            " AND state = 'in_flight' AND ",
            $live,
            " THEN 'acquired'
           WHEN state = 'in_flight' AND NOT ",
            $leased,
            " AND ",
            $resumable,
            " AND NOT ",
            $same,
            " THEN 'mismatch'
           WHEN ",
            $buried,
            " THEN CASE WHEN ",
            $same,
            " THEN 'answer_expired' ELSE 'mismatch' END
           WHEN NOT ",
            $live,
            " OR (state = 'in_flight' AND NOT ",
            $leased,
            ") THEN 'expired'
           WHEN NOT ",
            $same,
            " THEN 'mismatch'
           WHEN state = 'completed' OR response IS NOT NULL THEN 'completed'
           WHEN ",
            $leased,
            " THEN 'in_flight'
           WHEN suspect THEN 'orphaned'
           ELSE 'lapsed'
       END AS verdict,
       fence, CASE WHEN ",
            $same,
            " THEN response END AS response,
       ceil(extract(epoch FROM lease_until - now()) * 1000)::int8 AS lease_ms,
       ceil(extract(epoch FROM expires_at - now()) * 1000)::int8 AS expires_ms,
       status, ceil(extract(epoch FROM now() - updated_at) * 1000)::int8 AS ran_ms"
        )
    };
}

/// The rows the completer finishes (migration `20261205000000`, whose partial index holds
/// them): a recovery point in flight, or a fence committed without an answer, the lease run
/// out, within the retention.
macro_rules! abandoned {
    () => {
        "((state = 'in_flight' AND recovery_point IS NOT NULL)
       OR (state = 'committed' AND response IS NULL))
  AND lease_until <= now() AND expires_at > now()"
    };
}

/// Whether a row is a tombstone, `$h` the store's horizon in ms (`PostgresStore::with_tombstones`):
/// one the sweeper buried (its answer dropped, kept until the horizon after its completion), or
/// a completed one past its retention that the sweeper has not reached yet, within the horizon
/// after its completion (`updated_at`, which completing sets and burying keeps). Never for a
/// store without tombstones (`$h` 0), which reads a buried row as an expired one (it is not
/// `live` in the claims' verdicts).
macro_rules! buried {
    ($h:literal) => {
        concat!(
            "(",
            $h,
            "::float8 > 0 AND ((state = 'tombstone' AND expires_at > now())
             OR (state <> 'tombstone' AND expires_at <= now()
                 AND (state = 'completed' OR response IS NOT NULL)
                 AND updated_at + ",
            $h,
            "::float8 * interval '1 millisecond' > now())))"
        )
    };
}

/// The claim's common path, one round trip for every claim of a batch (`batch.rs`; a lone
/// claim is a batch of one): insert the key if there is no row, or say what the row there is
/// ($7 the store's tombstone horizon, ms: 0 when it keeps none).
/// Rows that need more (an expired row to take over, a committed key whose lease lapsed) are
/// settled by `PostgresStore::settle` under a row lock.
///
/// $1 scopes, $2 keys, $3 fingerprints, $4 owners, $5 leases (ms), $6 what is left of each
/// caller's time (ms), one element per claim: an insert happens only within its caller's time,
/// measured on the server's clock from the start of the statement's transaction (`now()`, taken
/// before any lock wait), so a claim the caller gave up on (say it waited on a lock) never
/// acquires later. A row per claim that has one, by its ordinal `n` (from 1); a claim without a
/// row (a competing claim committed after the statement's snapshot, or the statement ran past
/// its caller's time) is read again. Two claims of one key in a batch: one inserts, and the
/// other, without a row, reads the key again.
pub(super) const CLAIM_MANY: &str = concat!(
    r"
WITH r AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::uuid[], $5::float8[],
                         $6::float8[])
        WITH ORDINALITY AS r(scope, key, fingerprint, owner, lease_ms, left_ms, n)
),
cur AS (
    SELECT r.n, k.fingerprint = r.fingerprint AS same, k.owner = r.owner AS mine,
           k.lease_until > now() AS leased,
           k.expires_at > now() AND k.state <> 'tombstone' AS live,
           k.recovery_point IS NOT NULL AS resumable,
           k.state, k.response, k.suspect, k.fence, k.lease_until, k.expires_at, k.status,
           k.updated_at
    FROM r JOIN idempotency_keys k ON k.scope = r.scope AND k.key = r.key
),
claimed AS (
    INSERT INTO idempotency_keys
        (scope, key, fingerprint, state, owner, fence, lease_until, expires_at)
    SELECT r.scope, r.key, r.fingerprint, 'in_flight', r.owner, nextval('idempotency_fence'),
           now() + r.lease_ms * interval '1 millisecond',
           now() + r.lease_ms * interval '1 millisecond'
    FROM r
    WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.n = r.n)
      AND clock_timestamp() < now() + r.left_ms * interval '1 millisecond'
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING scope, key, owner, fence
)
SELECT r.n, 'acquired' AS verdict, c.fence, NULL::bytea AS response,
       NULL::int8 AS lease_ms, NULL::int8 AS expires_ms, NULL::int2 AS status,
       NULL::int8 AS ran_ms
FROM claimed c JOIN r ON r.scope = c.scope AND r.key = c.key AND r.owner = c.owner
UNION ALL
SELECT n, ",
    claim_verdict!("same", "mine", "leased", "live", "resumable", buried!("$7")),
    "
FROM cur
"
);

/// How many claims of one shard one statement carries at most on Citus (`claim.rs`): each
/// count is a statement of its own text, prepared on every connection that sends one.
pub(super) const CLAIMS_ON_A_SHARD: usize = 16;

/// A claim on a distributed table (`PostgresStore::on_citus`), first statement, for `claims`
/// claims of one shard (at most [`CLAIMS_ON_A_SHARD`]): inserts each key that has no row, as
/// [`CLAIM_MANY`] does, routed to the shard. Five parameters a claim: scope, key, fingerprint,
/// owner, lease (ms). A row for each it inserted (its fence), named by its `owner` (every
/// claim's is its own); none for a key that has a row, which [`CLAIM_READ`] reads. Two claims
/// of one key: the first inserts, the second finds its row.
///
/// The fence is the clock of the node that runs it, in microseconds, as [`CLOCK_FENCE`] reads
/// it: no sequence lives on every worker. `now()`, the statement's start, not
/// `clock_timestamp()`: Citus caches the shard's plan of a prepared statement only without a
/// volatile function (measured with pgbench on a worker: 141 µs of server CPU a lone claim with
/// `now()`, 1.3x that without the cache). A lone claim is the statement Citus takes on its fast
/// path; 16 together cost it about 51 µs each.
pub(super) fn claims_insert(claims: usize) -> &'static str {
    static TEXTS: [OnceLock<String>; CLAIMS_ON_A_SHARD] =
        [const { OnceLock::new() }; CLAIMS_ON_A_SHARD];
    TEXTS[claims - 1].get_or_init(|| {
        let rows: Vec<String> = (0..claims)
            .map(|claim| {
                let p = claim * 5;
                format!(
                    "(${}, ${}, ${}, 'in_flight', ${}, (extract(epoch FROM now()) * 1000000)::int8, \
                     now() + ${lease}::float8 * interval '1 millisecond', \
                     now() + ${lease}::float8 * interval '1 millisecond')",
                    p + 1,
                    p + 2,
                    p + 3,
                    p + 4,
                    lease = p + 5,
                )
            })
            .collect();
        format!(
            "INSERT INTO idempotency_keys \
             (scope, key, fingerprint, state, owner, fence, lease_until, expires_at) \
             VALUES {} ON CONFLICT (scope, key) DO NOTHING \
             RETURNING owner, 'acquired' AS verdict, fence, NULL::bytea AS response, \
             NULL::int8 AS lease_ms, NULL::int8 AS expires_ms, NULL::int2 AS status, \
             NULL::int8 AS ran_ms",
            rows.join(", ")
        )
    })
}

/// A claim on a distributed table, second statement: [`CLAIM_MANY`]'s verdict on the row
/// [`claims_insert`] found, routed to the key's shard. $1 scope, $2 key, $3 fingerprint, $4
/// owner, $5 the claim's ordinal, answered as `n`, $6 the tombstone horizon (ms), $7 the clock
/// skew (ms) past its expiry a row is still live for (`PostgresStore::with_clock_skew`). No row when
/// the row is gone meanwhile: the claim reads again. One table and no subquery, which Citus plans on its fast path (the same
/// read through a CTE cost it 1.8 times the CPU, measured with pgbench).
pub(super) const CLAIM_READ: &str = concat!(
    "SELECT $5::int8 AS n, ",
    claim_verdict!(
        "(fingerprint = $3)",
        "(owner = $4)",
        "(lease_until > now())",
        "(expires_at > now() - $7::float8 * interval '1 millisecond' AND state <> 'tombstone')",
        "(recovery_point IS NOT NULL)",
        buried!("$6")
    ),
    "
FROM idempotency_keys WHERE scope = $1 AND key = $2"
);

/// Locks a row that needs settling, unless another transaction holds it. $4: the clock skew
/// (ms) past its expiry a row is still live for (zero on one Postgres).
pub(super) const LOCK: &str = r"
SELECT fingerprint = $3 AS same, state, response IS NOT NULL AS answered, suspect,
       lease_until > now() AS leased, recovery_point IS NOT NULL AS resumable,
       expires_at > now() - $4::float8 * interval '1 millisecond' AND state <> 'tombstone'
           AND NOT (state = 'in_flight' AND lease_until <= now()) AS live
FROM idempotency_keys
WHERE scope = $1 AND key = $2
FOR UPDATE SKIP LOCKED
";

/// Whether the row still needs settling, seen without a lock: then a transaction holds it. $3:
/// the clock skew (ms), as for [`LOCK`].
pub(super) const UNSETTLED: &str = r"
SELECT EXISTS (
    SELECT 1 FROM idempotency_keys
    WHERE scope = $1 AND key = $2
      AND (expires_at <= now() - $3::float8 * interval '1 millisecond' OR state = 'tombstone'
           OR (state = 'in_flight' AND lease_until <= now())
           OR (state = 'committed' AND response IS NULL AND lease_until <= now()))
)
";

/// The next fence, for [`TAKE_OVER`]: a statement of its own, as Citus evaluates no volatile
/// function in an `UPDATE` of a distributed table.
pub(super) const NEXT_FENCE: &str = "SELECT nextval('idempotency_fence')";

/// The next fence on Citus, for [`TAKE_OVER`] as [`NEXT_FENCE`] is on one Postgres: the clock of
/// the node that runs it, in microseconds (the sequence lives on the coordinator only).
pub(super) const CLOCK_FENCE: &str =
    "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8";

/// Takes over an expired row, as a fresh claim would have created it, with the fence $6 (from
/// [`NEXT_FENCE`] or [`CLOCK_FENCE`]), or one more than the row's when that is higher (a clock
/// behind the one that drew it); a row in flight with progress for this same request keeps its recovery
/// point (and its retention), to resume from. No `now()` inside a `CASE`, which Citus refuses
/// in an `UPDATE` of a distributed table.
pub(super) const TAKE_OVER: &str = r"
UPDATE idempotency_keys
SET fingerprint = $3, state = 'in_flight', owner = $4, fence = greatest(fence + 1, $6),
    lease_until = now() + $5::float8 * interval '1 millisecond',
    -- Every expression below reads the row as it was (the old state, fingerprint, progress).
    expires_at = greatest(
        CASE WHEN state = 'in_flight' AND fingerprint = $3 AND recovery_point IS NOT NULL
             THEN expires_at ELSE '-infinity' END,
        now() + $5::float8 * interval '1 millisecond'),
    recovery_point = CASE
        WHEN state = 'in_flight' AND fingerprint = $3 THEN recovery_point END,
    recovery_payload = CASE
        WHEN state = 'in_flight' AND fingerprint = $3 THEN recovery_payload END,
    request = CASE WHEN state = 'in_flight' AND fingerprint = $3 THEN request END,
    status = NULL, response = NULL, suspect = false, created_at = now(), updated_at = now(),
    -- Duplicates waiting for a key in flight go on waiting for its new owner.
    waited = (state = 'in_flight' AND waited)
WHERE scope = $1 AND key = $2
RETURNING fence
";

/// Gives the owner of a committed key whose lease lapsed a grace to show it is alive.
pub(super) const SUSPECT: &str = r"
UPDATE idempotency_keys
SET suspect = true, lease_until = now() + $3::float8 * interval '1 millisecond'
WHERE scope = $1 AND key = $2
";

/// Renews one lease without waiting on a row lock, as [`RENEW_MANY`] does for many, in a form
/// Citus routes to the key's shard: $1 scope, $2 key, $3 owner, $4 lease (ms).
pub(super) const RENEW: &str = r"
WITH target AS (
    SELECT scope, key FROM idempotency_keys
    WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
    FOR NO KEY UPDATE SKIP LOCKED
),
renewed AS (
    UPDATE idempotency_keys k
    SET lease_until = now() + $4::float8 * interval '1 millisecond',
        expires_at = greatest(CASE WHEN k.state = 'in_flight' AND k.recovery_point IS NULL
                                   THEN '-infinity' ELSE k.expires_at END,
                              now() + $4::float8 * interval '1 millisecond'),
        suspect = false, updated_at = now()
    WHERE k.scope = $1 AND k.key = $2 AND k.owner = $3 AND EXISTS (SELECT 1 FROM target)
    RETURNING 1
)
SELECT 1::int8 AS n, EXISTS (SELECT 1 FROM renewed) AS renewed,
       EXISTS (SELECT 1 FROM idempotency_keys
               WHERE scope = $1 AND key = $2 AND owner = $3
                 AND state IN ('in_flight', 'committed')) AS owned
";

/// Renews leases without waiting on a row lock, one or many at once (`batch.rs`): $1 scopes,
/// $2 keys, $3 owners, $4 leases (ms), one element per renewal. A row per renewal, by its
/// ordinal `n` (from 1): `renewed`, or `owned` without being renewed when another transaction
/// held its row (skipped, not waited for), or neither when the owner lost it.
pub(super) const RENEW_MANY: &str = r"
WITH r AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], $4::float8[])
        WITH ORDINALITY AS r(scope, key, owner, lease_ms, n)
),
target AS (
    SELECT k.scope, k.key, r.n
    FROM idempotency_keys k JOIN r ON k.scope = r.scope AND k.key = r.key AND k.owner = r.owner
    WHERE k.state IN ('in_flight', 'committed')
    FOR NO KEY UPDATE OF k SKIP LOCKED
),
renewed AS (
    UPDATE idempotency_keys k
    SET lease_until = now() + r.lease_ms * interval '1 millisecond',
        expires_at = CASE WHEN k.state = 'in_flight' AND k.recovery_point IS NULL
                          THEN now() + r.lease_ms * interval '1 millisecond'
                          ELSE greatest(k.expires_at, now() + r.lease_ms * interval '1 millisecond')
                     END,
        suspect = false, updated_at = now()
    FROM target t JOIN r ON r.n = t.n
    WHERE k.scope = t.scope AND k.key = t.key
    RETURNING t.n
)
SELECT r.n,
       EXISTS (SELECT 1 FROM renewed WHERE renewed.n = r.n) AS renewed,
       EXISTS (SELECT 1 FROM idempotency_keys k
               WHERE k.scope = r.scope AND k.key = r.key AND k.owner = r.owner
                 AND k.state IN ('in_flight', 'committed')) AS owned
FROM r
";

/// Completes the key; a response the handler stored with the fence (`commit_with_response`) is
/// kept: one key, one stored answer, whichever path stored it. A row if it did, and whether a
/// duplicate waits for the key (`waited`: [`TELL`] it).
pub(super) const COMPLETE: &str = r"
UPDATE idempotency_keys
SET state = 'completed',
    status = CASE WHEN state = 'committed' AND response IS NOT NULL THEN status ELSE $4 END,
    response = CASE WHEN state = 'committed' AND response IS NOT NULL THEN response ELSE $5 END,
    lease_until = now(), request = NULL,
    expires_at = now() + $6::float8 * interval '1 millisecond', updated_at = now()
WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
RETURNING waited
";

/// [`COMPLETE`] for many keys at once, or one (`batch.rs`): $1 scopes, $2 keys, $3 owners, $4
/// statuses, $5 responses, $6 retentions (ms), one element per completion. A row per
/// completion, by its ordinal `n` (from 1): `completed`, or `owned` without being completed when
/// another transaction held its row (skipped, not waited for), or neither when the owner lost
/// it; and `waited` when a duplicate waits for a key completed ([`TELL`] it). A key its owner
/// committed with its answer (`commit_with_response`, `commit_with_outcome`) is complete
/// already: every claim answers it with that answer, and its retention ran from the fence. It
/// is answered `completed` without a write: no lock, no row version, no WAL, no transaction id.
pub(super) const COMPLETE_MANY: &str = r"
WITH r AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], $4::int2[], $5::bytea[], $6::float8[])
        WITH ORDINALITY AS r(scope, key, owner, status, response, retention_ms, n)
),
mine AS (
    SELECT r.n, k.state, k.response IS NOT NULL AS answered, k.waited
    FROM idempotency_keys k JOIN r ON k.scope = r.scope AND k.key = r.key AND k.owner = r.owner
    WHERE k.state IN ('in_flight', 'committed')
),
target AS (
    SELECT k.scope, k.key, r.n
    FROM idempotency_keys k JOIN r ON k.scope = r.scope AND k.key = r.key AND k.owner = r.owner
    WHERE k.state = 'in_flight' OR (k.state = 'committed' AND k.response IS NULL)
    FOR UPDATE OF k SKIP LOCKED
),
done AS (
    UPDATE idempotency_keys k
    SET state = 'completed', status = r.status, response = r.response, lease_until = now(),
        request = NULL, expires_at = now() + r.retention_ms * interval '1 millisecond', updated_at = now()
    FROM target t JOIN r ON r.n = t.n
    WHERE k.scope = t.scope AND k.key = t.key
    RETURNING t.n, k.waited
)
SELECT r.n,
       EXISTS (SELECT 1 FROM done WHERE done.n = r.n)
           OR EXISTS (SELECT 1 FROM mine WHERE mine.n = r.n AND mine.state = 'committed'
                                               AND mine.answered) AS completed,
       EXISTS (SELECT 1 FROM mine WHERE mine.n = r.n) AS owned,
       EXISTS (SELECT 1 FROM done WHERE done.n = r.n AND done.waited)
           OR EXISTS (SELECT 1 FROM mine WHERE mine.n = r.n AND mine.state = 'committed'
                                               AND mine.answered AND mine.waited) AS waited
FROM r
";

/// [`COMPLETE`] for many keys of one shard on Citus (`batch.rs`): $1 scopes, $2 keys (no two
/// alike), $3 owners, $4 statuses, $5 responses, one element per completion, and $6 the
/// retention (ms) of them all. A row, by its ordinal `n` (from 1), for each completion it wrote;
/// none for one this owner no longer holds. It waits for a row another transaction holds
/// locked, as [`COMPLETE`] does. The `= ANY` conditions are what Citus prunes to the one shard
/// by (planned with the arrays: it cannot prune a generic plan of them); a row of one
/// completion's scope and another's key is never written, its owner being neither's. One table
/// and no join: with pgbench on a worker, 16 completions cost about 40 µs each this way, 70
/// joined with `unnest`. The retention is one, because Citus refuses an `UPDATE` that adds a
/// column to `now()`.
pub(super) const COMPLETE_ON_SHARD: &str = r"
UPDATE idempotency_keys
SET state = 'completed',
    status = CASE WHEN state = 'committed' AND response IS NOT NULL THEN status
                  ELSE ($4::int2[])[array_position($2::text[], key)] END,
    response = CASE WHEN state = 'committed' AND response IS NOT NULL THEN response
                    ELSE ($5::bytea[])[array_position($2::text[], key)] END,
    lease_until = now(), request = NULL,
    expires_at = now() + $6::float8 * interval '1 millisecond', updated_at = now()
WHERE scope = ANY($1::text[]) AND key = ANY($2::text[])
  AND owner = ($3::uuid[])[array_position($2::text[], key)]
  AND state IN ('in_flight', 'committed')
RETURNING array_position($2::text[], key)::int8 AS n, waited
";

/// Releases the key, waiting for its row lock if another transaction holds it; `waited` when a
/// duplicate waits for it ([`TELL`] it).
pub(super) const RELEASE: &str = r"
WITH released AS (
    DELETE FROM idempotency_keys
    WHERE scope = $1 AND key = $2 AND owner = $3 AND state = 'in_flight'
      AND recovery_point IS NULL
    RETURNING waited
),
-- A key with progress is not deleted: its lease ends, and the next attempt resumes it.
paused AS (
    UPDATE idempotency_keys SET lease_until = now(), updated_at = now()
    WHERE scope = $1 AND key = $2 AND owner = $3 AND state = 'in_flight'
      AND recovery_point IS NOT NULL
    RETURNING waited
)
SELECT EXISTS (SELECT 1 FROM released) OR EXISTS (SELECT 1 FROM paused) AS released,
       EXISTS (SELECT 1 FROM idempotency_keys
               WHERE scope = $1 AND key = $2 AND owner = $3 AND state = 'committed') AS committed,
       EXISTS (SELECT 1 FROM released WHERE waited)
           OR EXISTS (SELECT 1 FROM paused WHERE waited) AS waited
";

/// A release on Citus: the lease ends and the row stays, in flight, for the next claim to take
/// over with a fence grown from this one's (fences come from the nodes' clocks there, and a row
/// deleted would leave the next fence to a clock that may be behind). Flat, for Citus's fast
/// path: $1 scope, $2 key, $3 owner.
pub(super) const END_LEASE: &str = r"
UPDATE idempotency_keys SET lease_until = now(), updated_at = now()
WHERE scope = $1 AND key = $2 AND owner = $3 AND state = 'in_flight'
RETURNING waited
";

/// A row if the key is $3's and committed (a release that found no row of its in flight).
/// Flat, for Citus's fast path.
pub(super) const COMMITTED: &str = r"
SELECT 1 FROM idempotency_keys
WHERE scope = $1 AND key = $2 AND owner = $3 AND state = 'committed'
";

/// A renewal on Citus, in a transaction of its own after [`LOCK_WAIT`]: [`RENEW`]'s effect as
/// one flat statement, which Citus plans once (`RENEW` it plans on every execution, about five
/// times the cost). $1 scope, $2 key, $3 owner, $4 lease (ms).
pub(super) const RENEW_FLAT: &str = r"
UPDATE idempotency_keys
SET lease_until = now() + $4::float8 * interval '1 millisecond',
    expires_at = greatest(CASE WHEN state = 'in_flight' AND recovery_point IS NULL
                               THEN '-infinity' ELSE expires_at END,
                          now() + $4::float8 * interval '1 millisecond'),
    suspect = false, updated_at = now()
WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
";

/// How long [`RENEW_FLAT`] waits for a row another transaction holds (the handler's own, after
/// the fence) before the renewal answers busy instead: [`RENEW`] skips such a row at once.
pub(super) const LOCK_WAIT: &str = "SET LOCAL lock_timeout = '10ms'";

/// A row if the key is $3's, in flight or committed: a renewal on Citus that found its row
/// locked. Flat, for Citus's fast path.
pub(super) const OWNED: &str = r"
SELECT 1 FROM idempotency_keys
WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
";

/// [`RELEASE`] for many keys at once (`batch.rs`): $1 scopes, $2 keys, $3 owners, one element
/// per release. A row per release, by its ordinal `n` (from 1): `released`; or `committed`
/// (the key is this owner's and committed: never released); or `owned`, in flight, when another
/// transaction held its row (skipped, not waited for); or none of them when the owner lost it;
/// and `waited` when a duplicate waits for a key released ([`TELL`] it).
pub(super) const RELEASE_MANY: &str = r"
WITH r AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[])
        WITH ORDINALITY AS r(scope, key, owner, n)
),
target AS (
    SELECT k.scope, k.key, r.n, k.recovery_point IS NULL AS fresh
    FROM idempotency_keys k JOIN r ON k.scope = r.scope AND k.key = r.key AND k.owner = r.owner
    WHERE k.state = 'in_flight'
    FOR UPDATE OF k SKIP LOCKED
),
released AS (
    DELETE FROM idempotency_keys k
    USING target t
    WHERE k.scope = t.scope AND k.key = t.key AND t.fresh
    RETURNING t.n, k.waited
),
-- A key with progress is not deleted: its lease ends, and the next attempt resumes it.
paused AS (
    UPDATE idempotency_keys k SET lease_until = now(), updated_at = now()
    FROM target t
    WHERE k.scope = t.scope AND k.key = t.key AND NOT t.fresh
    RETURNING t.n, k.waited
)
SELECT r.n,
       EXISTS (SELECT 1 FROM released WHERE released.n = r.n)
           OR EXISTS (SELECT 1 FROM paused WHERE paused.n = r.n) AS released,
       EXISTS (SELECT 1 FROM idempotency_keys k
               WHERE k.scope = r.scope AND k.key = r.key AND k.owner = r.owner
                 AND k.state = 'committed') AS committed,
       EXISTS (SELECT 1 FROM idempotency_keys k
               WHERE k.scope = r.scope AND k.key = r.key AND k.owner = r.owner
                 AND k.state = 'in_flight') AS owned,
       EXISTS (SELECT 1 FROM released WHERE released.n = r.n AND released.waited)
           OR EXISTS (SELECT 1 FROM paused WHERE paused.n = r.n AND paused.waited) AS waited
FROM r
";

/// Marks a key held (in flight, or committed without an answer, its lease alive) as waited
/// for, without waiting on its row lock: `marked` when it is (a row another transaction holds,
/// the owner's fence about to commit, is skipped), `held` when it is held at all. A key marked
/// already is not written again. $1 scope, $2 key.
pub(super) const MARK: &str = r"
WITH target AS (
    SELECT scope, key, waited FROM idempotency_keys
    WHERE scope = $1 AND key = $2 AND lease_until > now()
      AND (state = 'in_flight' OR (state = 'committed' AND response IS NULL))
    FOR NO KEY UPDATE SKIP LOCKED
),
marked AS (
    UPDATE idempotency_keys k SET waited = true
    WHERE k.scope = $1 AND k.key = $2 AND EXISTS (SELECT 1 FROM target WHERE NOT waited)
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM target) AS marked,
       EXISTS (SELECT 1 FROM idempotency_keys
               WHERE scope = $1 AND key = $2 AND lease_until > now()
                 AND (state = 'in_flight' OR (state = 'committed' AND response IS NULL))) AS held
";

/// Tells the instances that listen (`LISTEN tower_idempotency`) that keys a duplicate waits for
/// ended: $1 their ids (`hashtext(scope):hashtext(key)`), a notification each.
pub(super) const TELL: &str =
    "SELECT count(pg_notify('tower_idempotency', id)) FROM unnest($1::text[]) AS id";

/// A recovery point, advanced by the handler inside its own transaction (see
/// `migrations/20261201000000_recovery_points.sql`).
pub(super) const ADVANCE: &str = "SELECT idempotency_advance($1, $2, $3, $4, $5::jsonb, $6, $7)";

/// Keeps the request $4 a key in flight was claimed for, for the completer, in the step's
/// transaction after [`ADVANCE`], once: a row that keeps one already is not written again
/// (migration `20261205000000`).
pub(super) const KEEP_REQUEST: &str = r"
UPDATE idempotency_keys SET request = $4
WHERE scope = $1 AND key = $2 AND owner = $3 AND state = 'in_flight' AND request IS NULL
";

/// Keys whose lease ran out with work recorded (a recovery point in flight, or a fence
/// committed without an answer) and not expired, longest lapsed first, at most $1: the
/// completer's scan, on its partial index.
pub(super) const ABANDONED: &str = concat!(
    r"
SELECT scope, key, fingerprint, state, recovery_point, request,
       ceil(extract(epoch FROM now() - lease_until) * 1000)::int8 AS lapsed_ms
FROM idempotency_keys
WHERE ",
    abandoned!(),
    r"
ORDER BY lease_until
LIMIT $1
"
);

/// The doctor's view of [`ABANDONED`]'s rows: how many, how long ago the oldest lease ran out
/// (seconds), and how many the completer noted it could not finish.
pub(super) const ABANDONED_SUMMARY: &str = concat!(
    r"
SELECT count(*), extract(epoch FROM now() - min(lease_until))::float8, count(unfinished)
FROM idempotency_keys
WHERE ",
    abandoned!()
);

/// Notes on a key why the completer could not finish it ($3).
pub(super) const NOTE_UNFINISHED: &str =
    "UPDATE idempotency_keys SET unfinished = $3 WHERE scope = $1 AND key = $2";

/// The recovery point of a key `$3` holds: (point, payload as text), no row when it does not.
pub(super) const RECOVERY: &str = r"
SELECT recovery_point, recovery_payload::text AS payload FROM idempotency_keys
WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
";

/// Whether there is a row for a key at all.
pub(super) const RECORD_EXISTS: &str =
    "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE scope = $1 AND key = $2)";

/// Completes a committed key whose owner died without an answer, with one the application
/// rebuilt from its own rows: only once its owner's lease and grace have run out.
pub(super) const ADOPT: &str = r"
UPDATE idempotency_keys
SET state = 'completed', status = $4, response = $5, lease_until = now(), request = NULL,
    expires_at = now() + $6::float8 * interval '1 millisecond', updated_at = now()
WHERE scope = $1 AND key = $2 AND fingerprint = $3 AND state = 'committed'
  AND response IS NULL AND suspect AND lease_until <= now()
";

/// The fence: run by the handler inside its own transaction, through a function that plans
/// its statement on every call (see `migrations/20261129000002_fence_function.sql`).
pub(super) const COMMIT: &str = "SELECT idempotency_commit($1, $2, $3, $4, $5, $6, $7)";

/// Sweeps up to $1 expired rows, oldest first, skipping rows another transaction holds: a
/// completed one within $2 ms (the tombstone horizon) of its completion is buried (its answer
/// dropped, kept as a tombstone until then); the others, tombstones past the horizon among
/// them, are deleted. How many of each.
pub(super) const SWEEP: &str = r"
WITH doomed AS (
    SELECT scope, key,
           state <> 'tombstone' AND (state = 'completed' OR response IS NOT NULL)
           AND updated_at + $2::float8 * interval '1 millisecond' > now() AS buried
    FROM idempotency_keys
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
buried AS (
    UPDATE idempotency_keys k
    SET state = 'tombstone', response = NULL, request = NULL,
        expires_at = k.updated_at + $2::float8 * interval '1 millisecond'
    FROM doomed
    WHERE doomed.buried AND k.scope = doomed.scope AND k.key = doomed.key
    RETURNING 1
),
deleted AS (
    DELETE FROM idempotency_keys k
    USING doomed
    WHERE NOT doomed.buried AND k.scope = doomed.scope AND k.key = doomed.key
    RETURNING 1
)
SELECT (SELECT count(*) FROM buried) AS buried, (SELECT count(*) FROM deleted) AS deleted
";

/// [`SWEEP`] on a distributed table, shard by shard (each shard's statement runs on its worker,
/// up to $1 rows a shard, $2 the tombstone horizon in ms, $3 the clock skew in ms a row is
/// kept for past its expiry, as claims keep it live): a row per shard, whether it ran, and
/// what it answered (`DELETE n`, the rows deleted; those buried are not counted).
pub(super) const SWEEP_SHARDS: &str = r"
SELECT success, result FROM run_command_on_shards('idempotency_keys', format(
    'WITH doomed AS (
         SELECT ctid, state <> ''tombstone'' AND (state = ''completed'' OR response IS NOT NULL)
                      AND updated_at + %2$s * interval ''1 millisecond'' > now() AS buried
         FROM %%1$s WHERE expires_at <= now() - %3$s * interval ''1 millisecond''
         ORDER BY expires_at LIMIT %1$s FOR UPDATE SKIP LOCKED),
     buried AS (
         UPDATE %%1$s k SET state = ''tombstone'', response = NULL, request = NULL,
                          expires_at = k.updated_at + %2$s * interval ''1 millisecond''
         FROM doomed WHERE doomed.buried AND k.ctid = doomed.ctid RETURNING 1)
     DELETE FROM %%1$s k USING doomed WHERE NOT doomed.buried AND k.ctid = doomed.ctid',
    $1::int8, $2::float8, $3::float8))
";

/// What an operator sees of one key (a live row only, or a tombstone: $3 the horizon, ms). A
/// key committed with its answer is complete (see [`COMPLETE_MANY`]).
pub(super) const INSPECT: &str = concat!(
    r"
SELECT scope, key,
       CASE WHEN buried THEN 'tombstone'
            WHEN state = 'committed' AND response IS NOT NULL THEN 'completed' ELSE state END
           AS state,
       fence, owner, status, unfinished,
       ceil(extract(epoch FROM lease_until - now()) * 1000)::int8 AS lease_ms,
       ceil(extract(epoch FROM now() - created_at) * 1000)::int8 AS age_ms,
       ceil(extract(epoch FROM greatest(expires_at,
                                        CASE WHEN buried
                                             THEN updated_at + $3::float8 * interval '1 millisecond'
                                        END)
                            - now()) * 1000)::int8 AS expires_ms
FROM (SELECT *, ",
    buried!("$3"),
    r" AS buried
      FROM idempotency_keys WHERE scope = $1 AND key = $2) k
WHERE (expires_at > now() AND state <> 'tombstone') OR buried
"
);

/// Forgets one key, whoever holds it.
pub(super) const FORGET: &str = "DELETE FROM idempotency_keys WHERE scope = $1 AND key = $2";

/// Keys claimed at least $1 ms ago and still unfinished, oldest first, at most $2.
pub(super) const STUCK: &str = r"
SELECT scope, key, state, fence, owner, status,
       ceil(extract(epoch FROM lease_until - now()) * 1000)::int8 AS lease_ms,
       ceil(extract(epoch FROM now() - created_at) * 1000)::int8 AS age_ms,
       ceil(extract(epoch FROM expires_at - now()) * 1000)::int8 AS expires_ms, unfinished
FROM idempotency_keys
WHERE state IN ('in_flight', 'committed') AND response IS NULL AND expires_at > now()
  AND created_at <= now() - $1::float8 * interval '1 millisecond'
ORDER BY created_at
LIMIT $2
";

/// A unit in its own transaction, first: the key's lock if it is free (`locked`), the
/// transaction's pauses bounded by $3 ms, and the key's row (`state` null: none; `buried`: a
/// tombstone within the horizon of $4 ms), one row always (migrations `20261202000001`,
/// `20261202000002`).
pub(super) const UNIT_BEGIN: &str = "SELECT * FROM idempotency_unit_begin($1, $2, $3, $4)";

/// A unit in its own transaction, last, when it found no row: the row, completed with the
/// outcome ($6 status, $7 the encoded answer) and kept for $5 ms, under a new fence. A plain
/// insert (no `ON CONFLICT`, whose speculative insertion costs a WAL record more): another
/// delivery's row, which the key's lock makes rare, is a unique violation.
pub(super) const UNIT_INSERT: &str = r"
INSERT INTO idempotency_keys
    (scope, key, fingerprint, state, owner, fence, lease_until, expires_at, status, response)
VALUES ($1, $2, $3, 'completed', $4, nextval('idempotency_fence'), clock_timestamp(),
        clock_timestamp() + $5::float8 * interval '1 millisecond', $6, $7)
";

/// Units in one transaction, first: the transaction's pauses bounded by $3 ms, and per unit
/// (scopes $1, keys $2) whether its key is free, its lock taken if so (migration
/// `20261203000000`).
pub(super) const UNITS_BEGIN_FREE: &str = "SELECT idempotency_units_begin_free($1, $2, $3)";

/// Units in one transaction, last: their rows, as [`UNIT_INSERT`] writes one, in one statement
/// (scopes $1, keys $2, fingerprints $3, owners $4, statuses $6, answers $7, all kept for
/// $5 ms). A key of the batch with a row already is a unique violation.
pub(super) const UNITS_INSERT: &str = r"
INSERT INTO idempotency_keys
    (scope, key, fingerprint, state, owner, fence, lease_until, expires_at, status, response)
SELECT u.scope, u.key, u.fingerprint, 'completed', u.owner, nextval('idempotency_fence'),
       clock_timestamp(), clock_timestamp() + $5::float8 * interval '1 millisecond', u.status,
       u.response
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::uuid[], $6::int2[], $7::bytea[])
    AS u(scope, key, fingerprint, owner, status, response)
";

/// A unit in its own transaction, last, in place of the expired row it read (fence $8): the
/// same, never over another row.
pub(super) const UNIT_REPLACE: &str = r"
UPDATE idempotency_keys
SET fingerprint = $3, state = 'completed', owner = $4, fence = nextval('idempotency_fence'),
    lease_until = clock_timestamp(),
    expires_at = clock_timestamp() + $5::float8 * interval '1 millisecond', status = $6,
    response = $7, suspect = false, recovery_point = NULL, recovery_payload = NULL,
    request = NULL, created_at = now(), updated_at = now()
WHERE scope = $1 AND key = $2 AND fence = $8
";
