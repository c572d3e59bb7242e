//! The report: medians of per-round ratios, as tables.

use super::*;

pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub(crate) fn print_report(options: &Options, runs: &Runs, floors: &BTreeMap<&str, Vec<f64>>) {
    let get = |setup: &str, workload: &str| runs.get(&(setup.to_owned(), workload.to_owned()));
    // Per-round ratio of `a` to `b` (req/s), median over rounds.
    let ratio =
        |a: &[Run], b: &[Run]| median(a.iter().zip(b).map(|(a, b)| a.rps / b.rps).collect());
    println!(
        "\n{} connections, {} s per run, {} interleaved rounds; medians over rounds\n",
        options.connections, options.seconds, options.rounds
    );
    println!(
        "| setup | workload | req/s | p50 µs | p99 µs | max ms | server CPU µs/req | Redis CPU µs/req | Postgres CPU µs/req | Postgres commits/req | WAL B/req | server peak RSS MiB | × bare |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for setup in SETUPS {
        for workload in ["fresh", "replay"] {
            let Some(list) = get(setup, workload) else {
                continue;
            };
            let m = |f: fn(&Run) -> f64| median(list.iter().map(f).collect());
            let vs_bare = get("bare", workload).map_or(String::from("–"), |bare| {
                format!("{:.2}", ratio(list, bare))
            });
            let redis = if list[0].redis_us_per_req.is_some() {
                format!("{:.1}", m(|r| r.redis_us_per_req.unwrap_or_default()))
            } else {
                "–".into()
            };
            let postgres = if list[0].postgres_us_per_req.is_some() {
                format!("{:.1}", m(|r| r.postgres_us_per_req.unwrap_or_default()))
            } else {
                "–".into()
            };
            let (commits, wal) = if list[0].postgres_written_per_req.is_some() {
                (
                    format!(
                        "{:.2}",
                        m(|r| r.postgres_written_per_req.unwrap_or_default().0)
                    ),
                    format!(
                        "{:.0}",
                        m(|r| r.postgres_written_per_req.unwrap_or_default().1)
                    ),
                )
            } else {
                ("–".into(), "–".into())
            };
            println!(
                "| {setup} | {workload} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {redis} | {postgres} | {commits} | {wal} | {:.0} | {vs_bare} |",
                m(|r| r.rps),
                m(|r| r.p50_us as f64),
                m(|r| r.p99_us as f64),
                m(|r| r.max_us as f64 / 1000.0),
                m(|r| r.cpu_us_per_req),
                m(|r| r.peak_rss_mib),
            );
        }
    }
    if !floors.is_empty() {
        println!(
            "\n| floor (claim + complete, {} tasks) | ops/s |",
            options.connections
        );
        println!("|---|---|");
    }
    for (name, values) in floors {
        println!("| {name} | {:.0} |", median(values.clone()));
    }
    println!("\nRatios (medians of per-round ratios):\n");
    let cpu = |setup: &str| {
        get(setup, "fresh").map(|l| median(l.iter().map(|r| r.cpu_us_per_req).collect()))
    };
    if let (Some(memory), Some(bare)) = (cpu("memory"), cpu("bare")) {
        println!(
            "- layer's own CPU per fresh request (memory − bare): {:.1} µs",
            memory - bare
        );
    }
    if let (Some(x), Some(y)) = (get("memory", "fresh"), get("bare", "fresh")) {
        println!(
            "- fresh keys, memory store vs bare handler: {:.2}×",
            ratio(x, y)
        );
    }
    if let (Some(memory), Some(naive)) = (cpu("memory"), cpu("naive-memory")) {
        println!(
            "- server CPU per fresh request, memory − naive-memory: {:.1} µs",
            memory - naive
        );
    }
    for (ours, naive, server) in [
        ("redis", "naive", "Redis"),
        ("valkey", "naive-valkey", "Valkey"),
    ] {
        for (workload, what) in [("fresh", "fresh keys"), ("replay", "replays")] {
            if let (Some(x), Some(y)) = (get(ours, workload), get(naive, workload)) {
                let ratio = ratio(x, y);
                println!(
                    "- {what}, Redis store vs naive SET NX EX guard, on {server}: {ratio:.2}×"
                );
            }
        }
    }
    // In process: the memory store against the naive guard in a moka cache, and what that
    // guard itself costs against no guard at all. Then replays from the process's memory: what
    // they save, and that a fresh key pays nothing.
    for (x, y, workload) in [
        ("memory", "naive-memory", "fresh"),
        ("memory", "naive-memory", "replay"),
        ("memory-cached", "naive-memory", "replay"),
        ("naive-memory", "bare", "fresh"),
        ("naive-memory", "bare", "replay"),
        ("redis-cached", "redis", "replay"),
        ("redis-cached", "naive", "replay"),
        ("redis-cached", "bare", "replay"),
        ("tiered-cached", "naive", "replay"),
        ("redis-watched", "naive", "replay"),
        ("redis-watched", "bare", "replay"),
        ("redis-watched", "redis-cached", "replay"),
        ("redis-cluster-watched", "redis-cluster", "replay"),
        ("redis-cluster-watched", "redis-watched", "replay"),
        ("redis-cluster-watched", "redis-cluster", "fresh"),
        ("memory-cached", "memory", "fresh"),
        ("redis-cached", "redis", "fresh"),
        ("redis-watched", "redis", "fresh"),
        ("tiered-cached", "tiered", "fresh"),
    ] {
        if let (Some(a), Some(b)) = (get(x, workload), get(y, workload)) {
            println!("- {workload}, {x} vs {y}: {:.2}×", ratio(a, b));
        }
    }
    for workload in ["fresh", "replay"] {
        let (Some(x), Some(y)) = (get("redis-cluster", workload), get("redis", workload)) else {
            continue;
        };
        let per_request = |list: &[Run]| {
            median(
                list.iter()
                    .map(|r| r.cpu_us_per_req + r.redis_us_per_req.unwrap_or_default())
                    .collect(),
            )
        };
        println!(
            "- {workload}, Redis Cluster (3 masters) vs one Redis: {:.2}× the requests, {:.2}× the \
             CPU per request (server and Redis together)",
            ratio(x, y),
            per_request(x) / per_request(y)
        );
    }
    for setup in [
        "postgres",
        "postgres-single",
        "postgres-partitioned",
        "tiered",
        "tiered-single",
        "redis",
        "redis-cluster",
        "valkey",
    ] {
        if let (Some(list), Some(floor)) = (get(setup, "fresh"), floors.get(setup)) {
            let per_round: Vec<f64> = list.iter().zip(floor).map(|(r, f)| r.rps / f).collect();
            println!(
                "- fresh keys, {setup} vs its floor: {:.2}×",
                median(per_round)
            );
        }
    }
    // Two setups side by side: their fresh keys, and their claim + complete floors.
    let side_by_side = |x: &str, y: &str, fresh: &str, floor: &str| {
        if let (Some(a), Some(b)) = (get(x, "fresh"), get(y, "fresh")) {
            println!("- fresh keys, {fresh}: {:.2}×", ratio(a, b));
        }
        if let (Some(a), Some(b)) = (floors.get(x), floors.get(y)) {
            let per_round = a.iter().zip(b).map(|(a, b)| a / b).collect();
            println!(
                "- claim + complete floor, {floor}: {:.2}×",
                median(per_round)
            );
        }
    };
    side_by_side(
        "postgres",
        "postgres-single",
        "claims and completions in batches vs each on its own",
        "in batches vs each on its own",
    );
    side_by_side(
        "tiered",
        "tiered-single",
        "Redis in front of Postgres, in batches vs each on its own",
        "Redis in front of Postgres, in batches vs each on its own",
    );
    side_by_side(
        "postgres-partitioned",
        "postgres",
        "partitioned vs plain idempotency_keys",
        "partitioned vs plain",
    );
    if let Some(cpu) = cpu("postgres") {
        println!("- application CPU per fresh request on Postgres: {cpu:.1} µs");
    }
    let redis_cpu = |setup: &str| {
        get(setup, "fresh").map(|l| {
            median(
                l.iter()
                    .map(|r| r.redis_us_per_req.unwrap_or_default())
                    .collect(),
            )
        })
    };
    for (ours, naive, server) in [
        ("redis", "naive", "Redis"),
        ("valkey", "naive-valkey", "Valkey"),
    ] {
        if let (Some(ours), Some(naive)) = (redis_cpu(ours), redis_cpu(naive)) {
            println!(
                "- {server} server CPU per fresh key: {ours:.1} µs vs naive {naive:.1} µs ({:.2}×)",
                ours / naive
            );
        }
    }
    let bytes = |setup: &str| {
        get(setup, "fresh").and_then(|l| l.iter().rev().find_map(|r| r.redis_bytes_per_key))
    };
    for (ours, naive, server) in [
        ("redis", "naive", "Redis"),
        ("valkey", "naive-valkey", "Valkey"),
    ] {
        if let (Some(ours), Some(naive)) = (bytes(ours), bytes(naive)) {
            println!("- {server} memory per completed key: {ours:.0} B vs naive {naive:.0} B");
        }
    }
}

/// The cluster's `SET`s through redis-rs's driver and straight to each key's master: what the
/// driver adds to a command.
pub(crate) fn print_routes(routes: &BTreeMap<&str, Vec<(f64, f64)>>) {
    if routes.is_empty() {
        return;
    }
    println!("\n| cluster SET, fresh keys | ops/s | bench CPU µs/op |");
    println!("|---|---|---|");
    let medians = |name: &str| {
        let list = routes.get(name)?;
        let rate = median(list.iter().map(|(rate, _)| *rate).collect());
        Some((rate, median(list.iter().map(|(_, cpu)| *cpu).collect())))
    };
    for name in routes.keys() {
        if let Some((rate, cpu)) = medians(name) {
            println!("| {name} | {rate:.0} | {cpu:.1} |");
        }
    }
    let compare = |what: &str, (a, b): ((f64, f64), (f64, f64))| {
        let more = a.1 - b.1;
        let (cpu, rate) = (a.1 / b.1, a.0 / b.0);
        println!(
            "- {what}: {more:.1} µs of client CPU more ({cpu:.2}×), {rate:.2}× the operations"
        );
    };
    if let (Some(driver), Some(direct)) = (medians("driver"), medians("direct")) {
        compare(
            "the cluster driver per command, vs straight to the masters",
            (driver, direct),
        );
    }
    if let (Some(direct), Some(single)) = (medians("direct"), medians("one server")) {
        compare(
            "three masters without a driver, vs one server",
            (direct, single),
        );
    }
}

/// Where a Citus setup's Postgres CPU goes: the coordinator, which plans and routes every
/// statement, and the workers, which run them.
pub(crate) fn print_citus(runs: &Runs) {
    let split: Vec<_> = runs
        .iter()
        .filter(|(_, list)| list[0].citus_us_per_req.is_some())
        .collect();
    if split.is_empty() {
        return;
    }
    println!("\n| Citus setup | workload | coordinator CPU µs/req | workers CPU µs/req |");
    println!("|---|---|---|---|");
    for ((setup, workload), list) in split {
        let m = |f: fn(&(f64, f64)) -> f64| {
            median(
                list.iter()
                    .filter_map(|r| r.citus_us_per_req.as_ref())
                    .map(f)
                    .collect(),
            )
        };
        println!(
            "| {setup} | {workload} | {:.1} | {:.1} |",
            m(|s| s.0),
            m(|s| s.1)
        );
    }
}

/// The consumer rows: each kind's messages per second and what a message cost, and `Once`
/// against bare.
pub(crate) fn print_consumers(consumed: &BTreeMap<&str, Vec<Consumed>>) {
    if consumed.is_empty() {
        return;
    }
    println!(
        "\n| consumers (3, RabbitMQ, prefetch 10) | msg/s | app CPU µs/msg | Postgres CPU µs/msg | RabbitMQ CPU µs/msg | write transactions/msg | WAL B/msg |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, _, _) in CONSUMER_KINDS {
        let Some(runs) = consumed.get(name) else {
            continue;
        };
        let m = |f: fn(&Consumed) -> f64| median(runs.iter().map(f).collect());
        println!(
            "| {name} | {:.0} | {:.1} | {:.1} | {:.1} | {:.2} | {:.0} |",
            m(|r| r.rate),
            m(|r| r.app_us),
            m(|r| r.postgres_us),
            m(|r| r.rabbitmq_us),
            m(|r| r.transactions),
            m(|r| r.wal_bytes),
        );
    }
    let ratio = |a: &str, b: &str| {
        let (a, b) = (consumed.get(a)?, consumed.get(b)?);
        Some(median(
            a.iter().zip(b).map(|(a, b)| a.rate / b.rate).collect(),
        ))
    };
    for (a, b, what) in [
        ("once", "bare", "through Once vs bare, the window at once"),
        (
            "once, in its transaction",
            "bare",
            "through Once in the shipment's transaction vs bare, the window at once",
        ),
        (
            "once, one at a time",
            "bare, one at a time",
            "through Once vs bare, one at a time",
        ),
        (
            "once",
            "once, one at a time",
            "through Once, the window at once vs one at a time",
        ),
        (
            "once, in batches",
            "bare, in batches",
            "through Once in batches vs bare in batches",
        ),
        (
            "once, in batches",
            "bare",
            "through Once in batches vs bare, a transaction per message",
        ),
    ] {
        if let Some(ratio) = ratio(a, b) {
            println!("- consumers {what}: {ratio:.2}×");
        }
    }
}
