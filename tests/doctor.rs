//! `Admin::diagnose` and the admin example's `doctor`, against servers misconfigured on purpose
//! (each finding must fire) and against a healthy setup (none may).

mod support;

use support::{RedisServer, TestSchema, database_url, free_port, schema_options, url_in_schema};
use tower_idempotency::{
    MemoryStore,
    store::{Admin, Diagnosis, PostgresStore, RedisStore, Severity, TieredStore},
};

fn main() -> std::process::ExitCode {
    support::run(crate::tests![
        current:
            a_healthy_setup_reports_every_check_and_nothing_to_fix,
            the_version_line_names_the_compare_and_set_commands_the_server_has,
            an_evicting_redis_without_persistence_puts_the_guarantee_at_risk,
            a_redis_without_config_is_a_warning_not_a_guessed_risk,
            snapshots_alone_are_a_warning_and_an_unreachable_redis_a_risk,
            an_unreachable_postgres_says_it_refused,
            an_unreachable_redis_says_whether_it_refused_wants_a_password_or_is_silent,
            postgres_flags_missing_migrations_missing_timeouts_and_a_sweeper_that_never_runs,
            an_authority_that_acknowledges_commits_it_can_lose_is_a_risk;
        multi(2):
            the_doctor_command_exits_non_zero_only_when_a_guarantee_is_at_risk,
            the_compose_files_servers_pass_the_doctor;
    ])
}

/// The severity of `check`'s finding (the worst, on a cluster); fails the test if it is absent.
fn severity(diagnosis: &Diagnosis, check: &str) -> Severity {
    diagnosis
        .of(check)
        .map(|finding| finding.severity)
        .max()
        .unwrap_or_else(|| panic!("no {check} finding in\n{diagnosis}"))
}

/// A Redis that keeps its records: never evicts, writes an append-only file.
async fn healthy_redis() -> RedisServer {
    RedisServer::start_with(&["--maxmemory-policy", "noeviction", "--appendonly", "yes"]).await
}

/// The session settings a healthy application pool has.
const HEALTHY_SESSION: [(&str, &str); 2] = [
    ("idle_in_transaction_session_timeout", "60s"),
    ("statement_timeout", "30s"),
];

async fn healthy_postgres(schema: &TestSchema) -> PostgresStore {
    let mut settings = vec![("search_path", schema.name.as_str())];
    settings.extend(HEALTHY_SESSION);
    let options = schema_options(&database_url(), &schema.name).options(settings);
    let pool = sqlx::PgPool::connect_with(options).await.unwrap();
    PostgresStore::new(pool)
}

async fn a_healthy_setup_reports_every_check_and_nothing_to_fix() {
    let redis = healthy_redis().await;
    let schema = TestSchema::new().await;
    let store = TieredStore::new(
        RedisStore::open(&redis.url()).unwrap(),
        healthy_postgres(&schema).await,
    );
    let diagnosis = store.diagnose().await;
    println!("{diagnosis}");
    assert_eq!(diagnosis.worst(), Severity::Ok, "{diagnosis}");
    let checks = [
        "version",
        "maxmemory-policy",
        "persistence",
        "migrations",
        "synchronous_commit",
        "idle_in_transaction",
        "statement_timeout",
        "sweeper",
        "size",
        "tombstones",
    ];
    for check in checks {
        severity(&diagnosis, check);
    }
    assert_eq!(diagnosis.of("version").count(), 2, "Redis and Postgres");
    schema.drop().await;
}

/// The version line says which compare-and-set commands the server has, as the server itself
/// answers them (not from its version string), and which of the store's changes use them: on
/// Redis 7 and 8.2 none, on Valkey 8.1 `SET … IFEQ`, on Valkey 9.1 `DELIFEQ` too; and how a
/// claim runs (every server CI runs has `SET … NX GET`): by command, or where the store keeps
/// tombstones by claim.lua alone and by command in front of an authority.
async fn the_version_line_names_the_compare_and_set_commands_the_server_has() {
    let redis = RedisServer::start().await;
    let (set_ifeq, delifeq) = (redis.has_set_ifeq().await, redis.has_delifeq().await);
    let uses = match (set_ifeq, delifeq) {
        (true, true) => "completion and renewal use SET IFEQ, release DELIFEQ",
        (true, false) => "completion and renewal use SET IFEQ",
        _ => "completion, renewal and release run scripts",
    };
    let plain = RedisStore::open(&redis.url()).unwrap();
    let with_tombstones = plain
        .clone()
        .with_tombstones(std::time::Duration::from_secs(60));
    for (store, claims) in [
        (plain, "a claim is one SET NX GET, pipelined"),
        (
            with_tombstones,
            "a claim runs claim.lua (it reads the tombstone), in front of an authority one SET \
             NX GET, pipelined",
        ),
    ] {
        let diagnosis = store.diagnose().await;
        let line = &diagnosis
            .of("version")
            .next()
            .expect("a version line")
            .message;
        assert_eq!(line.contains("SET IFEQ"), set_ifeq, "{line}");
        assert_eq!(line.contains("DELIFEQ"), delifeq, "{line}");
        assert!(line.ends_with(&format!("{uses}; {claims}")), "{line}");
    }
}

async fn an_evicting_redis_without_persistence_puts_the_guarantee_at_risk() {
    for policy in ["allkeys-lru", "volatile-ttl"] {
        // The test servers start with `--save "" --appendonly no`: no persistence at all.
        let redis = RedisServer::start_with(&["--maxmemory-policy", policy]).await;
        let store = RedisStore::open(&redis.url()).unwrap();
        let diagnosis = store.diagnose().await;
        assert_eq!(
            severity(&diagnosis, "maxmemory-policy"),
            Severity::Risk,
            "{policy}"
        );
        assert_eq!(severity(&diagnosis, "persistence"), Severity::Risk);
        assert_eq!(severity(&diagnosis, "version"), Severity::Ok);
        assert!(diagnosis.at_risk());

        // In front of an authority the same settings cost load, not the guarantee.
        let tiered = TieredStore::new(store, MemoryStore::new());
        let diagnosis = tiered.diagnose().await;
        assert_eq!(severity(&diagnosis, "maxmemory-policy"), Severity::Warning);
        assert_eq!(severity(&diagnosis, "persistence"), Severity::Warning);
        assert!(!diagnosis.at_risk(), "{diagnosis}");
    }
}

/// A Redis whose `CONFIG` command is renamed away (as managed Redis services do) with its
/// snapshots on: the doctor cannot tell whether snapshots are on, and says so as a warning. It
/// reported "snapshots off" as a risk, and the doctor exited 1.
async fn a_redis_without_config_is_a_warning_not_a_guessed_risk() {
    let redis =
        RedisServer::start_with(&["--save", "3600 1", "--rename-command", "CONFIG", ""]).await;
    let diagnosis = RedisStore::open(&redis.url()).unwrap().diagnose().await;
    assert_eq!(
        severity(&diagnosis, "persistence"),
        Severity::Warning,
        "{diagnosis}"
    );
    let finding = diagnosis.of("persistence").next().unwrap();
    assert!(finding.message.contains("unknown"), "{diagnosis}");
    assert!(!finding.message.contains("snapshots off"), "{diagnosis}");
}

async fn snapshots_alone_are_a_warning_and_an_unreachable_redis_a_risk() {
    let redis = RedisServer::start_with(&["--save", "3600 1"]).await;
    let diagnosis = RedisStore::open(&redis.url()).unwrap().diagnose().await;
    assert_eq!(
        severity(&diagnosis, "persistence"),
        Severity::Warning,
        "{diagnosis}"
    );

    let nobody = format!("redis://127.0.0.1:{}", free_port());
    let diagnosis = RedisStore::open(&nobody).unwrap().diagnose().await;
    assert_eq!(
        severity(&diagnosis, "reachable"),
        Severity::Risk,
        "{diagnosis}"
    );
}

/// A Postgres that refuses the connection (nothing listens on the port) is said to refuse it,
/// at once: it was "postgres store did not answer within 5s", after 5 s, which sends an operator
/// looking for a slow database instead of a wrong address.
async fn an_unreachable_postgres_says_it_refused() {
    let nobody = format!("postgres://postgres@127.0.0.1:{}/test", free_port());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy(&nobody)
        .unwrap();
    let started = std::time::Instant::now();
    let diagnosis = PostgresStore::new(pool).diagnose().await;
    let took = started.elapsed();
    let reachable = diagnosis.of("reachable").next().unwrap();
    assert_eq!(reachable.severity, Severity::Risk, "{diagnosis}");
    assert!(
        reachable.message.contains("Connection refused"),
        "{diagnosis}"
    );
    assert!(
        reachable.message.contains("is the server running"),
        "{diagnosis}"
    );
    let at_once = std::time::Duration::from_secs(2);
    assert!(took < at_once, "refused after {took:?}: {diagnosis}");
}

/// Why a Redis cannot be reached is said as it is: refused, wanting a password, or silent (it
/// was "did not answer within 250ms" for all three).
async fn an_unreachable_redis_says_whether_it_refused_wants_a_password_or_is_silent() {
    let reachable =
        |diagnosis: &Diagnosis| diagnosis.of("reachable").next().unwrap().message.clone();
    let nobody = format!("redis://127.0.0.1:{}", free_port());
    let refused = RedisStore::open(&nobody).unwrap().diagnose().await;
    assert!(
        reachable(&refused).contains("connection refused"),
        "{refused}"
    );

    let locked = RedisServer::start_with(&["--requirepass", "s3cret"]).await;
    let without = RedisStore::open(&locked.url()).unwrap().diagnose().await;
    assert!(
        reachable(&without).contains("authentication refused"),
        "{without}"
    );
    let wrong = locked.url().replace("redis://", "redis://:wrong@");
    let wrong = RedisStore::open(&wrong).unwrap().diagnose().await;
    assert!(
        reachable(&wrong).contains("authentication refused"),
        "{wrong}"
    );

    let mut frozen = RedisServer::start().await;
    frozen.pause();
    let silent = RedisStore::open(&frozen.url()).unwrap().diagnose().await;
    frozen.resume();
    assert!(reachable(&silent).contains("no answer in time"), "{silent}");
}

async fn postgres_flags_missing_migrations_missing_timeouts_and_a_sweeper_that_never_runs() {
    // A schema the migrations never ran in, and a pool without session timeouts.
    let empty = format!("doctor_empty_{}", uuid::Uuid::new_v4().simple());
    let admin = sqlx::PgPool::connect(&database_url()).await.unwrap();
    let create = format!(r#"CREATE SCHEMA "{empty}""#);
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(&admin)
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect_with(schema_options(&database_url(), &empty))
        .await
        .unwrap();
    let diagnosis = PostgresStore::new(pool).diagnose().await;
    println!("{diagnosis}");
    assert_eq!(severity(&diagnosis, "migrations"), Severity::Risk);
    assert_eq!(severity(&diagnosis, "idle_in_transaction"), Severity::Risk);
    assert_eq!(severity(&diagnosis, "statement_timeout"), Severity::Warning);
    let drop = format!(r#"DROP SCHEMA "{empty}" CASCADE"#);
    sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(&admin)
        .await
        .unwrap();

    // Migrated, but one migration short; and a row expired two hours ago.
    let schema = TestSchema::new().await;
    let store = healthy_postgres(&schema).await;
    sqlx::query(
        "DELETE FROM _tower_idempotency_migrations \
         WHERE version = (SELECT max(version) FROM _tower_idempotency_migrations)",
    )
    .execute(&schema.pool)
    .await
    .unwrap();
    let claim = support::claim_request("k-expired", std::time::Duration::from_secs(30));
    support::acquire(&store, &claim).await;
    sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '2 hours'")
        .execute(&schema.pool)
        .await
        .unwrap();
    let diagnosis = store.diagnose().await;
    println!("{diagnosis}");
    assert_eq!(severity(&diagnosis, "migrations"), Severity::Risk);
    let migrations = diagnosis.of("migrations").next().unwrap();
    let total = tower_idempotency::store::MIGRATOR.iter().count();
    let applied = format!("{} of {total}", total - 1);
    assert!(migrations.message.contains(&applied), "{migrations}");
    assert_eq!(severity(&diagnosis, "sweeper"), Severity::Warning);
    assert_eq!(severity(&diagnosis, "idle_in_transaction"), Severity::Ok);
    store.sweep().await.unwrap();
    assert_eq!(severity(&store.diagnose().await, "sweeper"), Severity::Ok);
    schema.drop().await;
}

/// `synchronous_commit = off` (for the application's role, or the whole server) lets Postgres
/// acknowledge a claim it can lose in a crash: a risk. The README asked for it on; the doctor
/// did not check it.
async fn an_authority_that_acknowledges_commits_it_can_lose_is_a_risk() {
    let schema = TestSchema::new().await;
    let mut settings = vec![("search_path", schema.name.as_str())];
    settings.extend(HEALTHY_SESSION);
    settings.push(("synchronous_commit", "off"));
    let options = schema_options(&database_url(), &schema.name).options(settings);
    let pool = sqlx::PgPool::connect_with(options).await.unwrap();
    let diagnosis = PostgresStore::new(pool).diagnose().await;
    assert_eq!(
        severity(&diagnosis, "synchronous_commit"),
        Severity::Risk,
        "{diagnosis}"
    );
    assert_eq!(diagnosis.worst(), Severity::Risk);
    schema.drop().await;
}

/// `url` with session `settings` (name, value), as the doctor's pool connects with them.
fn with_session<'a>(
    mut url: String,
    settings: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> String {
    for (name, value) in settings {
        url.push_str(&format!("&options[{name}]={value}"));
    }
    url
}

/// That a `doctor` report found everything as it should be.
fn assert_all_ok(report: &str) {
    assert!(
        report
            .lines()
            .all(|line| line.starts_with("ok ") || line == "worst: ok"),
        "{report}"
    );
}

/// The admin example's `doctor`: its output and exit code, as a deployment script sees them.
fn doctor(env: &[(&str, String)]) -> (bool, String) {
    let output = support::example_command("admin", env)
        .arg("doctor")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (output.status.success(), stdout)
}

async fn the_doctor_command_exits_non_zero_only_when_a_guarantee_is_at_risk() {
    let schema = TestSchema::new().await;
    let redis = healthy_redis().await;
    let healthy = with_session(
        url_in_schema(&database_url(), &schema.name),
        HEALTHY_SESSION,
    );
    let env = [("DATABASE_URL", healthy), ("REDIS_URL", redis.url())];
    let (passed, report) = doctor(&env);
    println!("healthy:\n{report}");
    assert!(passed, "{report}");
    assert_all_ok(&report);

    // The same Postgres without its session timeouts, in a schema never migrated.
    let bare = url_in_schema(&database_url(), "doctor_never_migrated");
    let (passed, report) = doctor(&[("DATABASE_URL", bare), ("REDIS_URL", redis.url())]);
    println!("broken:\n{report}");
    assert!(!passed, "{report}");
    assert!(
        report
            .lines()
            .any(|line| line.starts_with("risk ") && line.contains("migrations"))
    );
    assert!(report.contains("worst: risk"));
    schema.drop().await;
}

/// The `command` list of a service in `docker-compose.yml`, as written on one line.
fn compose_command(compose: &str, service: &str) -> Vec<String> {
    let section = compose
        .split(&format!("\n  {service}:\n"))
        .nth(1)
        .unwrap_or_else(|| panic!("no {service} service"));
    let after = section.split("command:").nth(1).expect("a command");
    let list = after.split('[').nth(1).unwrap().split(']').next().unwrap();
    list.split(',')
        .map(|word| word.trim().trim_matches('"').to_owned())
        .collect()
}

/// The servers `docker-compose.yml` starts for users pass the doctor, and its Postgres is the
/// major version CI tests. It had no session timeouts and Redis' defaults (two risks), and
/// Postgres 16 against CI's 15.
async fn the_compose_files_servers_pass_the_doctor() {
    let compose =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docker-compose.yml"))
            .unwrap();
    let redis_args = compose_command(&compose, "redis");
    assert_eq!(redis_args[0], "redis-server");
    let args: Vec<&str> = redis_args[1..].iter().map(String::as_str).collect();
    let redis = RedisServer::start_with(&args).await;
    // The compose file's server settings (`-c name=value`), here as the session's.
    let postgres_args = compose_command(&compose, "postgres");
    let schema = TestSchema::new().await;
    let settings = postgres_args
        .iter()
        .skip_while(|a| *a != "-c")
        .skip(1)
        .step_by(2);
    let settings = settings.map(|setting| setting.split_once('=').unwrap());
    let url = with_session(url_in_schema(&database_url(), &schema.name), settings);
    let migrated = PostgresStore::new(sqlx::PgPool::connect(&url).await.unwrap());
    migrated.migrate().await.unwrap();
    let (passed, report) = doctor(&[("DATABASE_URL", url), ("REDIS_URL", redis.url())]);
    println!("{report}");
    assert!(passed, "{report}");
    assert_all_ok(&report);
    let image = compose
        .split("image: postgres:")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .unwrap();
    let tested: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(migrated.pool())
        .await
        .unwrap();
    assert_eq!(
        image.trim(),
        (tested / 10000).to_string(),
        "Postgres in compose vs CI"
    );
    schema.drop().await;
}
