//! The programs a test may need beyond the Postgres and Redis servers the README's set-up gives
//! (Citus, the brokers, Redis and Postgres servers of the test's own), where each is found, and
//! the harness every test binary that starts one runs under: a test whose program is missing is
//! reported as not run (libtest's "ignored", with what it needs and how to get it), never as
//! passed. `IDEMPOTENCY_TEST_STRICT=1`, which `.ci/run` sets, makes it a failure instead.
//!
//! A test finds out it lacks a program when it asks for it ([`Need::path`], which the server
//! helpers call): the test stops there, and the harness reports it as not run. Cargo's own
//! harness cannot decide at run time that a test did not run, so those binaries are
//! `harness = false` in Cargo.toml and list their tests in a `main` through [`run`] (the
//! [`tests!`](crate::tests) macro). Such a binary must hold no `#[test]` or `#[tokio::test]`:
//! without the harness they are not compiled, so they would never run (`.ci/harness` checks).
//! [`run`] takes libtest's arguments, any number of filters included.

use std::{
    process::ExitCode,
    sync::{Mutex, PoisonError},
};

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use tower_idempotency::{conformance::Case, store::Store};

use super::*;

/// A program a test needs, beyond the Postgres and Redis servers every test uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// `redis-server`, for Redis servers of the test's own (`REDIS_SERVER`).
    RedisServer,
    /// `redis-cli`, to build a Redis Cluster (`REDIS_CLI`).
    RedisCli,
    /// PostgreSQL's `initdb` and `pg_ctl`, for Postgres clusters of the test's own
    /// (`PG_BINDIR`).
    PostgresServer,
    /// The Citus extension, installed in that PostgreSQL.
    Citus,
    /// `nats-server` (`NATS_SERVER`).
    NatsServer,
    /// `rabbitmq-server` (`RABBITMQ_SERVER`).
    RabbitMqServer,
}

impl Need {
    /// What the need is called in the run's report.
    pub fn name(self) -> &'static str {
        match self {
            Need::RedisServer => "redis-server",
            Need::RedisCli => "redis-cli",
            Need::PostgresServer => "PostgreSQL's initdb and pg_ctl",
            Need::Citus => "Citus",
            Need::NatsServer => "nats-server",
            Need::RabbitMqServer => "rabbitmq-server",
        }
    }

    /// Where the program is (for Citus: the PostgreSQL directory it is installed in), or why
    /// it is not there and how to get it.
    pub fn find(self) -> Result<PathBuf, String> {
        match self {
            Need::RedisServer => find_program(
                "redis-server",
                "REDIS_SERVER",
                &[],
                "install Redis (Debian: `apt install redis-server`; macOS: `brew install redis`)",
            ),
            Need::RedisCli => find_program(
                "redis-cli",
                "REDIS_CLI",
                &[],
                "install Redis (Debian: `apt install redis-tools`; macOS: `brew install redis`)",
            ),
            Need::PostgresServer => find_postgres_bindir(),
            Need::Citus => find_citus(),
            Need::NatsServer => find_program(
                "nats-server",
                "NATS_SERVER",
                &[PathBuf::from("/usr/sbin/nats-server")],
                "install the NATS server (Debian: `apt install nats-server`)",
            ),
            Need::RabbitMqServer => find_program(
                "rabbitmq-server",
                "RABBITMQ_SERVER",
                &[PathBuf::from("/usr/sbin/rabbitmq-server")],
                "install RabbitMQ (Debian: `apt install rabbitmq-server`)",
            ),
        }
    }

    /// [`find`](Self::find), for a test that runs only where it is: without it, the test stops
    /// here and the harness reports it as not run, with how to get it.
    pub fn path(self) -> PathBuf {
        self.find()
            .unwrap_or_else(|why| std::panic::panic_any(Missing { need: self, why }))
    }
}

/// The program `name`: the path in the environment variable `var` if it is set, else the
/// first `name` on `PATH`, else one of `fallbacks`. Otherwise what is missing, and how to
/// provide it.
pub fn find_program(
    name: &str,
    var: &str,
    fallbacks: &[PathBuf],
    install: &str,
) -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(var) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "{var}={} does not name a file: set it to the path of `{name}`",
                path.display()
            ))
        };
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .iter()
        .chain(fallbacks)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .ok_or_else(|| format!("`{name}` is not on PATH: {install}, or set {var} to its path"))
}

/// The directory of Postgres' server programs (`initdb`, `pg_ctl`): `PG_BINDIR`, else `initdb`
/// on `PATH`, else `pg_config --bindir`, else Debian's `/usr/lib/postgresql/<version>/bin`
/// (newest first).
fn find_postgres_bindir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("PG_BINDIR") {
        let dir = PathBuf::from(dir);
        return if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
            Ok(dir)
        } else {
            Err(format!(
                "PG_BINDIR={} holds no `initdb` and `pg_ctl`",
                dir.display()
            ))
        };
    }
    let pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(|entry| Some(entry.ok()?.path().join("bin")))
        .collect();
    debian.sort_by_key(|dir| std::cmp::Reverse(postgres_major(dir)));
    let fallbacks: Vec<PathBuf> = pg_config.into_iter().chain(debian).collect();
    let initdb = find_program(
        "initdb",
        "PG_BINDIR",
        &fallbacks,
        "install the PostgreSQL server (Debian: `apt install postgresql`; macOS: `brew install \
         postgresql`) and put its bin directory on PATH",
    )?;
    // The real directory: a link on PATH (`/usr/local/bin/initdb`) may have no `pg_basebackup`
    // beside it.
    let initdb = initdb.canonicalize().unwrap_or(initdb);
    Ok(initdb.parent().unwrap().to_owned())
}

/// The major version in a `/usr/lib/postgresql/<major>/bin` path (0 when there is none).
fn postgres_major(bin: &std::path::Path) -> u32 {
    bin.parent()
        .and_then(|dir| dir.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// The PostgreSQL directory whose server programs the tests run, if Citus is installed in it:
/// its library (`citus.so`) in that server's package library directory.
fn find_citus() -> Result<PathBuf, String> {
    let bindir = find_postgres_bindir()?;
    let pg_config = Command::new(bindir.join("pg_config"))
        .arg("--pkglibdir")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    // Debian's layout (`…/15/bin` beside `…/15/lib`), and a build's (`lib/postgresql`).
    let prefix = bindir.parent().unwrap_or(&bindir);
    let mut candidates: Vec<PathBuf> = Vec::new();
    for dir in pg_config
        .into_iter()
        .chain([prefix.join("lib"), prefix.join("lib/postgresql")])
    {
        if !candidates.contains(&dir) {
            candidates.push(dir);
        }
    }
    match candidates.iter().find(|dir| dir.join("citus.so").is_file()) {
        Some(_) => Ok(bindir),
        None => Err(format!(
            "Citus is not installed in the PostgreSQL of {} (no citus.so in {}): install it \
             from Citus's packages or build it from source, see docs/testing.md#citus",
            bindir.display(),
            candidates
                .iter()
                .map(|dir| dir.display().to_string())
                .collect::<Vec<_>>()
                .join(" or ")
        )),
    }
}

/// Whether `IDEMPOTENCY_TEST_STRICT` asks for every test to run.
fn strict() -> bool {
    std::env::var("IDEMPOTENCY_TEST_STRICT").is_ok_and(|value| !value.is_empty() && value != "0")
}

/// What a test that lacks a program stops with ([`Need::path`]): the harness reports the test
/// as not run.
#[derive(Debug)]
pub struct Missing {
    need: Need,
    why: String,
}

/// The tests that did not run, with why: reported once, after the run.
static NOT_RUN: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// How a test's body runs: as `#[test]`, `#[tokio::test]` (one thread) or
/// `#[tokio::test(flavor = "multi_thread", worker_threads = N)]`.
#[derive(Debug, Clone, Copy)]
pub enum Flavor {
    CurrentThread,
    MultiThread(usize),
}

impl Flavor {
    fn runtime(self) -> tokio::runtime::Runtime {
        match self {
            Flavor::CurrentThread => tokio::runtime::Builder::new_current_thread(),
            Flavor::MultiThread(workers) => {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                builder.worker_threads(workers);
                builder
            }
        }
        .enable_all()
        .build()
        .expect("a runtime")
    }
}

/// A test named `name` whose body runs `run` where every one of `needs` is found, and which
/// stops as not run when it asks for a program that is missing.
fn trial(name: String, needs: &[Need], run: impl FnOnce() + Send + 'static) -> Trial {
    let needs = needs.to_vec();
    Trial::ignorable_test(name.clone(), move || {
        let missing: Vec<(Need, String)> = needs
            .iter()
            .filter_map(|need| Some((*need, need.find().err()?)))
            .collect();
        if !missing.is_empty() {
            return not_run(name, missing);
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
            Ok(()) => Ok(Completion::Completed),
            Err(payload) => match payload.downcast::<Missing>() {
                Ok(missing) => not_run(name, vec![(missing.need, missing.why)]),
                // libtest-mimic reports it as the test's failure, with its message.
                Err(payload) => std::panic::resume_unwind(payload),
            },
        }
    })
}

/// A test that did not run for want of `missing`: ignored, and reported after the run; a
/// failure where every test must run.
fn not_run(name: String, missing: Vec<(Need, String)>) -> Result<Completion, Failed> {
    let (needs, whys): (Vec<Need>, Vec<String>) = missing.into_iter().unzip();
    let why = whys.join("; ");
    if strict() {
        return Err(Failed::from(format!(
            "not run, and IDEMPOTENCY_TEST_STRICT asks for every test: {why}"
        )));
    }
    NOT_RUN
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((name, why));
    let names: Vec<&str> = needs.iter().map(|need| need.name()).collect();
    Ok(Completion::ignored_with(format!(
        "not run: needs {}",
        names.join(", ")
    )))
}

/// A test named `name` that runs `body` on a runtime of `flavor`, where every one of `needs`
/// is found.
pub fn test_on<F>(
    name: impl Into<String>,
    needs: &[Need],
    flavor: Flavor,
    body: impl FnOnce() -> F + Send + 'static,
) -> Trial
where
    F: Future<Output = ()>,
{
    trial(name.into(), needs, move || {
        flavor.runtime().block_on(body())
    })
}

/// A test that runs `body` on a multi-threaded runtime of two workers (as
/// `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]` does), where every one of
/// `needs` is found.
pub fn test<F>(
    name: impl Into<String>,
    needs: &[Need],
    body: impl FnOnce() -> F + Send + 'static,
) -> Trial
where
    F: Future<Output = ()>,
{
    test_on(name, needs, Flavor::MultiThread(2), body)
}

/// A test of plain code (`#[test]`).
pub fn test_sync(name: impl Into<String>, body: impl FnOnce() + Send + 'static) -> Trial {
    trial(name.into(), &[], body)
}

/// A test per function, named by its path, as the attribute it replaces would run it:
///
/// ```ignore
/// support::run(tests![
///     current: a_test, fence::another;          // #[tokio::test]
///     multi(2): a_third;                        // #[tokio::test(flavor = "multi_thread", ...)]
///     sync: a_fourth;                           // #[test]
/// ])
/// ```
///
/// or, each on two workers where every one of `$needs` is found:
/// `tests![&[Need::Citus]; moved_shard, kills::mid_request]`.
#[macro_export]
macro_rules! tests {
    ($($flavor:ident $(($workers:expr))?: $($test:path),* $(,)?);+ $(;)?) => {{
        let mut tests = ::std::vec::Vec::new();
        $(tests.extend($crate::tests!(@group $flavor $(($workers))?; $($test),*));)+
        tests
    }};
    (@group current; $($test:path),*) => {
        ::std::vec![$($crate::support::test_on(
            ::std::stringify!($test), &[], $crate::support::Flavor::CurrentThread, $test,
        )),*]
    };
    (@group multi($workers:expr); $($test:path),*) => {
        ::std::vec![$($crate::support::test_on(
            ::std::stringify!($test), &[], $crate::support::Flavor::MultiThread($workers), $test,
        )),*]
    };
    (@group sync; $($test:path),*) => {
        ::std::vec![$($crate::support::test_sync(::std::stringify!($test), $test)),*]
    };
    ($needs:expr; $($test:path),* $(,)?) => {
        ::std::vec![$($crate::support::test(::std::stringify!($test), $needs, $test)),*]
    };
}

/// A test per conformance case (`tower_idempotency::conformance::cases` and the others), named
/// `{prefix}::{capability}::{case}`, each on a store from `make`, where every one of `needs` is
/// found.
pub fn conformance<S, F>(
    prefix: &str,
    needs: &[Need],
    cases: Vec<Case<S>>,
    make: fn() -> F,
) -> Vec<Trial>
where
    S: Store,
    F: Future<Output = S> + 'static,
{
    cases
        .into_iter()
        .map(|case| {
            let name = format!(
                "{prefix}::{}::{}",
                case.capability.replace(' ', "_"),
                case.name
            );
            test(name, needs, move || async move {
                let store = make().await;
                (case.run)(&store).await;
            })
        })
        .collect()
}

/// Runs `tests` as libtest does (its arguments: filters, `--skip`, `--exact`,
/// `--test-threads`, …), then says once which tests did not run and why.
pub fn run(tests: Vec<Trial>) -> ExitCode {
    let (arguments, tests) = arguments(tests);
    // A test that stops for want of a program is reported, not a crash to print.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<Missing>().is_none() {
            report(info);
        }
    }));
    let conclusion = libtest_mimic::run(&arguments, tests);
    let not_run = std::mem::take(&mut *NOT_RUN.lock().unwrap_or_else(PoisonError::into_inner));
    if !not_run.is_empty() {
        let mut reasons: Vec<&str> = not_run.iter().map(|(_, why)| why.as_str()).collect();
        reasons.sort_unstable();
        reasons.dedup();
        let tests = match not_run.len() {
            1 => "1 test".to_owned(),
            n => format!("{n} tests"),
        };
        println!(
            "\n{tests} did not run, for want of a program (IDEMPOTENCY_TEST_STRICT=1 makes \
             that a failure):"
        );
        for (name, _) in &not_run {
            println!("    {name}");
        }
        println!("what they need, and how to get it:");
        for why in reasons {
            println!("    {why}");
        }
    }
    conclusion.exit_code()
}

/// The command line as libtest reads it, and the tests its filters keep. libtest takes any
/// number of filters (`cargo test -- grpc tonic`: a test whose name holds either), and
/// libtest-mimic one: with more, the tests are filtered here.
fn arguments(tests: Vec<Trial>) -> (Arguments, Vec<Trial>) {
    // The options that take a value, which is no filter.
    const VALUED: [&str; 6] = [
        "--test-threads",
        "--logfile",
        "--skip",
        "--color",
        "--format",
        "-Z",
    ];
    let mut args = std::env::args();
    let mut options: Vec<String> = args.next().into_iter().collect();
    let mut filters = Vec::new();
    while let Some(arg) = args.next() {
        if VALUED.contains(&arg.as_str()) {
            options.push(arg);
            options.extend(args.next());
        } else if arg.starts_with('-') {
            options.push(arg);
        } else {
            filters.push(arg);
        }
    }
    let mut arguments = Arguments::from_iter(options);
    if filters.len() <= 1 {
        arguments.filter = filters.pop();
        return (arguments, tests);
    }
    let exact = arguments.exact;
    let kept = tests
        .into_iter()
        .filter(|test| {
            filters.iter().any(|filter| match exact {
                true => test.name() == filter,
                false => test.name().contains(filter.as_str()),
            })
        })
        .collect();
    (arguments, kept)
}
