#!/usr/bin/env python3
"""What each of the Redis store's operations costs the server, as a script and as the commands
that could replace it, side by side on one server.

    python3 benches/server_cpu.py [SERVER] [N]

SERVER is a `redis-server` or `valkey-server` binary (default: `redis-server` on the PATH); N
the operations of each kind (default 100000). The script starts the server on a free port,
sends each kind's N operations through `redis-cli --pipe` (one connection, pipelined, so the
network's share is the same for every kind and small), and prints the server's CPU per
operation (`INFO cpu`, user and system, before and after) and what `INFO commandstats` counts
in its own time (the outermost command's: a script's and a transaction's hold the commands run
inside them). Each kind that writes keys starts on an emptied server. Kinds the server refuses (an unknown command, an unknown argument) are
reported as such. Every kind writes keys of its own; records are the store's layout (claim.lua).
"""

import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SERVER = sys.argv[1] if len(sys.argv) > 1 else "redis-server"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
LEASE = "30000"


def resp(*args):
    out = b"*%d\r\n" % len(args)
    for arg in args:
        arg = arg.encode() if isinstance(arg, str) else arg
        out += b"$%d\r\n%s\r\n" % (len(arg), arg)
    return out


def lua(name):
    with open(os.path.join(ROOT, "lua", name)) as f:
        text = f.read()
    return text, hashlib.sha1(text.encode()).hexdigest()


def owner(i):
    return b"%016d" % i


def head(i):
    # layout, state, fingerprint (32), owner (16): what the claim sends.
    return bytes([2]) + b"i" + b"f" * 32 + owner(i)


def in_flight(i):
    # What claim.lua writes: the head and a 16-digit fence.
    return head(i) + b"1733370000000000"


def completed(i):
    # What complete.lua makes of it: state "c", the response after the fence.
    return in_flight(i)[:1] + b"c" + in_flight(i)[2:] + RESPONSE


RESPONSE = b"r" * 200


def kinds():
    claim, claim_sha = lua("claim.lua")
    complete, complete_sha = lua("complete.lua")
    release, release_sha = lua("release.lua")
    renew, renew_sha = lua("renew.lua")
    load = b"".join(resp("SCRIPT", "LOAD", s) for s in (claim, complete, release, renew))
    # name, the records it needs first (None: none), the operations
    yield "claim: claim.lua, a fresh key", load, None, lambda i: resp(
        "EVALSHA", claim_sha, "1", "a:%d" % i, head(i), LEASE)
    # The held keys are those the kind before claimed.
    yield "claim: claim.lua, a held key (a replay)", None, None, lambda i: resp(
        "EVALSHA", claim_sha, "1", "a:%d" % i, head(i), LEASE)
    yield "claim: SET NX GET PX, a fresh key", None, None, lambda i: resp(
        "SET", "b:%d" % i, in_flight(i), "NX", "GET", "PX", LEASE)
    # The claim of a store in front of an authority (`Store::claim_in_front`): no fence drawn
    # on the server, the remaining lifetime read in the same transaction.
    yield "claim in front: MULTI, SET NX GET PX, PTTL, EXEC, a fresh key", None, None, lambda i: (
        resp("MULTI") + resp("SET", "k:%d" % i, in_flight(i), "NX", "GET", "PX", LEASE)
        + resp("PTTL", "k:%d" % i) + resp("EXEC"))
    yield "claim in front: the same, a held key (a replay)", None, None, lambda i: (
        resp("MULTI") + resp("SET", "k:%d" % i, in_flight(i), "NX", "GET", "PX", LEASE)
        + resp("PTTL", "k:%d" % i) + resp("EXEC"))
    yield "claim in front, pipelined without MULTI, a fresh key", None, None, lambda i: (
        resp("SET", "m:%d" % i, in_flight(i), "NX", "GET", "PX", LEASE) + resp("PTTL", "m:%d" % i))
    yield "claim in front, pipelined without MULTI, a held key", None, None, lambda i: (
        resp("SET", "m:%d" % i, in_flight(i), "NX", "GET", "PX", LEASE) + resp("PTTL", "m:%d" % i))
    yield "claim: MULTI, TIME, SET NX GET PX, PTTL, EXEC, a fresh key", None, None, lambda i: (
        resp("MULTI") + resp("TIME")
        + resp("SET", "c:%d" % i, in_flight(i), "NX", "GET", "PX", LEASE)
        + resp("PTTL", "c:%d" % i) + resp("EXEC"))
    yield "claim: the same MULTI, a held key", None, None, lambda i: (
        resp("MULTI") + resp("TIME")
        + resp("SET", "c:%d" % i, in_flight(i), "NX", "GET", "PX", LEASE)
        + resp("PTTL", "c:%d" % i) + resp("EXEC"))
    yield "renew: renew.lua", None, "d", lambda i: resp(
        "EVALSHA", renew_sha, "1", "d:%d" % i, owner(i), LEASE)
    yield "renew: SET IFEQ PX", None, "e", lambda i: resp(
        "SET", "e:%d" % i, in_flight(i), "IFEQ", in_flight(i), "PX", LEASE)
    yield "complete: complete.lua", None, "f", lambda i: resp(
        "EVALSHA", complete_sha, "1", "f:%d" % i, owner(i), RESPONSE, "86400000")
    yield "complete: SET IFEQ PX", None, "g", lambda i: resp(
        "SET", "g:%d" % i, completed(i),
        "IFEQ", in_flight(i), "PX", "86400000")
    # What any script pays on a server without SET IFEQ: complete.lua's comparison and write
    # at their plainest (the whole record compared, the whole new one sent), and no work at all.
    cas = "if redis.call('GET', KEYS[1]) == ARGV[1] then " \
          "redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end return 0"
    cas_sha = hashlib.sha1(cas.encode()).hexdigest()
    yield "complete: SET IFEQ's work in Lua (GET, compare, SET)", resp("SCRIPT", "LOAD", cas), \
        "l", lambda i: resp("EVALSHA", cas_sha, "1", "l:%d" % i, in_flight(i),
                            completed(i), "86400000")
    yield "complete: a plain SET, unchecked (the naive guard's)", None, "p", lambda i: resp(
        "SET", "p:%d" % i, completed(i),
        "PX", "86400000")
    nothing = "return 1"
    nothing_sha = hashlib.sha1(nothing.encode()).hexdigest()
    yield "a script that does nothing (return 1)", resp("SCRIPT", "LOAD", nothing), None, \
        lambda i: resp("EVALSHA", nothing_sha, "1", "n:%d" % i)
    yield "release: release.lua", None, "h", lambda i: resp(
        "EVALSHA", release_sha, "1", "h:%d" % i, owner(i))
    yield "release: DELIFEQ", None, "j", lambda i: resp("DELIFEQ", "j:%d" % i, in_flight(i))


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp()
    server = subprocess.Popen(
        [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", work], stdout=subprocess.DEVNULL)
    cli = ["redis-cli", "-p", str(port)]
    try:
        for _ in range(100):
            if subprocess.run(cli + ["ping"], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        version = subprocess.run(cli + ["info", "server"], capture_output=True, text=True).stdout
        fields = dict(l.split(":", 1) for l in version.splitlines() if ":" in l)
        name = "Valkey " + fields["valkey_version"] if "valkey_version" in fields \
            else "Redis " + fields.get("redis_version", "?")
        print(f"{name} ({SERVER}); {N} operations of each kind")
        print("| operation | server CPU µs/op | commandstats µs/op | refused |")
        print("|---|---|---|---|")
        for kind, prelude, records, operation in kinds():
            # Every kind that writes keys of its own starts on an empty server, so none pays
            # for the growth of the keys the kinds before it wrote.
            if "fresh key" in kind or records:
                subprocess.run(cli + ["flushall"], capture_output=True, check=True)
            feed = prelude or b""
            if records:
                feed += b"".join(resp("SET", f"{records}:{i}", in_flight(i), "PX", LEASE)
                                 for i in range(N))
            if feed:
                subprocess.run(cli + ["--pipe"], input=feed, capture_output=True, check=True)
            subprocess.run(cli + ["config", "resetstat"], capture_output=True, check=True)
            before = cpu(cli)
            out = subprocess.run(cli + ["--pipe"], input=b"".join(operation(i) for i in range(N)),
                                 capture_output=True)
            after = cpu(cli)
            errors = [l for l in out.stdout.decode().splitlines() if l.startswith("errors:")]
            refused = errors[0].split(",")[0].split(":")[1].strip() if errors else "?"
            stats = subprocess.run(cli + ["info", "commandstats"], capture_output=True,
                                   text=True).stdout
            usec = {line.split(":")[0][len("cmdstat_"):]: float(field.split("=")[1])
                    for line in stats.splitlines() if line.startswith("cmdstat_")
                    for field in line.split(":", 1)[1].split(",") if field.startswith("usec=")}
            # A script's and a transaction's own time holds the commands run inside them,
            # which are counted on their own too: only the outermost count.
            if "evalsha" in usec:
                own = usec["evalsha"]
            elif "exec" in usec:
                own = usec["exec"] + usec.get("multi", 0)
            else:
                own = sum(usec.values())
            print(f"| {kind} | {(after - before) * 1e6 / N:.2f} | {own / N:.2f} | {refused} |")
    finally:
        server.terminate()
        server.wait()


def cpu(cli):
    info = subprocess.run(cli + ["info", "cpu"], capture_output=True, text=True).stdout
    fields = dict(l.split(":", 1) for l in info.splitlines() if ":" in l)
    return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


if __name__ == "__main__":
    main()
