#!/usr/bin/env python3
"""What one operation of each workload of benches/counts.rs costs this process, counted:
instructions (valgrind's callgrind) and heap allocations and bytes (valgrind's DHAT) an
operation: allocations the same from run to run on one build, instructions within 0.5 %,
whatever else the machine does.

    python3 benches/counts.py [WORKLOAD ...] [--n N] [--record FILE | --check FILE]

WORKLOADs: bare, layer, cached, replay, naive, redis (all by default; see benches/counts.rs). Each runs at N and
at 6N operations (N = 500 by default), and the figures are the difference over the 5N extra
ones, so start-up, connecting and a script's first load are left out. naive and redis need the
Redis of REDIS_URL (default redis://127.0.0.1:6379/). Needs valgrind (Debian's package).

valgrind's CPU has no SHA extensions, so SHA-256 runs its portable code there, several times
what it costs on a CPU that has them: the layer's row is given with and without the `sha2`
crate's functions (the fingerprint's hashing).

--record FILE writes each workload's instructions and allocations an operation to FILE (JSON);
--check FILE compares with it and fails when a workload costs more than LIMIT (2 %) over what
FILE holds, in instructions or in allocations: a change that costs more records the new
figures in the same commit and says why (.ci/counts runs the check, on benches/counts.json).
"""

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WORKLOADS = ["bare", "layer", "cached", "replay", "naive", "redis"]

# What one workload costs over another: (what it is, the workload, the one it is over).
DIFFERENCES = [
    ("the layer's own, a fresh request", "layer", "bare"),
    ("the replay cache, a fresh request", "cached", "layer"),
    ("the layer's own, a replay from memory", "replay", "bare"),
]

# How much more than the recorded figures a workload may cost before --check fails.
LIMIT = 0.02


def build():
    """Builds the bench (release, as `cargo bench` does) and returns its executable."""
    out = subprocess.run(
        ["cargo", "bench", "--bench", "counts", "--no-run", "--message-format=json"],
        cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    for line in out.splitlines():
        message = json.loads(line)
        if message.get("reason") == "compiler-artifact" and message.get("executable") \
                and message["target"]["name"] == "counts":
            return message["executable"]
    sys.exit("cargo built no counts executable")


def callgrind(binary, workload, n, scratch):
    """Instructions in all, and those in the sha2 crate's functions."""
    out = os.path.join(scratch, "callgrind.%s.%d" % (workload, n))
    subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out,
                    binary, workload, str(n)], check=True, capture_output=True)
    annotated = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--threshold=100", "--inclusive=no", out],
        check=True, capture_output=True, text=True).stdout
    total = sha = 0
    for line in annotated.splitlines():
        m = re.match(r"^\s*([\d,]+) \([^)]*\)\s+(.*)$", line)
        if not m:
            continue
        count, name = int(m.group(1).replace(",", "")), m.group(2)
        if name.startswith("PROGRAM TOTALS"):
            total = count
        elif "sha2::" in name:
            sha += count
    return total, sha


def dhat(binary, workload, n, scratch):
    """Heap blocks and bytes allocated in all."""
    out = os.path.join(scratch, "dhat.%s.%d" % (workload, n))
    run = subprocess.run(["valgrind", "--tool=dhat", "--dhat-out-file=" + out,
                          binary, workload, str(n)], check=True, capture_output=True, text=True)
    m = re.search(r"Total:\s+([\d,]+) bytes in ([\d,]+) blocks", run.stderr)
    if not m:
        sys.exit("DHAT printed no total for %s:\n%s" % (workload, run.stderr))
    return int(m.group(2).replace(",", "")), int(m.group(1).replace(",", ""))


def measure(binary, workload, n, scratch):
    """Per extra operation: instructions, instructions without sha2, allocations, bytes."""
    small = callgrind(binary, workload, n, scratch) + dhat(binary, workload, n, scratch)
    large = callgrind(binary, workload, 6 * n, scratch) + dhat(binary, workload, 6 * n, scratch)
    extra = 5 * n
    total, sha, blocks, size = ((b - a) / extra for a, b in zip(small, large))
    return {"instructions": total, "without_sha": total - sha, "allocations": blocks,
            "bytes": size}


def option(args, name):
    """The value of `name` in args (removed from them), or None."""
    if name not in args:
        return None
    at = args.index(name)
    value = args[at + 1]
    del args[at:at + 2]
    return value


def check(rows, path):
    """Each workload against the figures recorded in `path`: False if any costs more than LIMIT
    over them."""
    with open(path) as f:
        recorded = json.load(f)
    ok = True
    print()
    for workload, row in rows.items():
        if workload not in recorded:
            print("%s: nothing recorded in %s" % (workload, path))
            ok = False
            continue
        for measure in ("instructions", "allocations"):
            was, now = recorded[workload][measure], row[measure]
            change = (now - was) / was
            verdict = "ok"
            if change > LIMIT:
                verdict, ok = "MORE THAN %d %% OVER" % round(LIMIT * 100), False
            elif change < -LIMIT:
                verdict = "less: record it (--record %s)" % path
            print("%s %s: %s recorded, %s now (%+.2f %%): %s" % (
                workload, measure, format(round(was), ","), format(round(now), ","),
                100 * change, verdict))
    if not ok:
        print("\na workload costs more than %s records: find why, or record the new figures "
              "(python3 benches/counts.py --record %s) in the commit that says why" % (path, path))
    return ok


def main():
    args = sys.argv[1:]
    n = int(option(args, "--n") or 500)
    record, against = option(args, "--record"), option(args, "--check")
    workloads = args or WORKLOADS
    for workload in workloads:
        if workload not in WORKLOADS:
            sys.exit("no workload %r (%s)" % (workload, ", ".join(WORKLOADS)))
    binary = build()
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for workload in workloads:
            rows[workload] = measure(binary, workload, n, scratch)
    print("%d and %d operations; per extra operation:\n" % (n, 6 * n))
    print("| workload | instructions | without SHA-256 | allocations | bytes allocated |")
    print("|---|---|---|---|---|")
    for workload, row in rows.items():
        print("| %s | %s | %s | %.1f | %s |" % (
            workload, format(round(row["instructions"]), ","), format(round(row["without_sha"]), ","),
            row["allocations"], format(round(row["bytes"]), ",")))
    print()
    for what, workload, under in DIFFERENCES:
        if workload in rows and under in rows:
            row, base = rows[workload], rows[under]
            print("%s (%s - %s): %s instructions without SHA-256, %.1f allocations" % (
                what, workload, under, format(round(row["without_sha"] - base["without_sha"]), ","),
                row["allocations"] - base["allocations"]))
    if "redis" in rows and "naive" in rows:
        redis, naive = rows["redis"], rows["naive"]
        print("the Redis store's claim and completion against the naive guard's two commands: "
              "%.2fx the instructions, %.2fx the allocations" % (
                  redis["without_sha"] / naive["without_sha"],
                  redis["allocations"] / naive["allocations"]))

    if record:
        figures = {workload: {"instructions": round(row["instructions"]),
                              "allocations": round(row["allocations"], 1)}
                   for workload, row in rows.items()}
        with open(record, "w") as f:
            json.dump(figures, f, indent=2, sort_keys=True)
            f.write("\n")
        print("\nrecorded in %s" % record)
    if against and not check(rows, against):
        sys.exit(1)


if __name__ == "__main__":
    main()
