#!/usr/bin/env python3
"""The payments example driven by a client nobody here wrote: the official Stripe Python SDK.

The SDK puts an `Idempotency-Key` on every POST and retries timeouts, connection errors, 409s and
5xx with that key. This script runs a fleet of the payments example (Redis in front of Postgres,
an HTTP payment provider that deduplicates on the key it is given) behind a round-robin TCP load
balancer, drives it with the SDK's own HTTP client at its default settings (80 s timeout, 2
retries), kills one instance with SIGKILL every few seconds (and starts it again), then waits for
the completers and counts at the destination:

- payment rows per key (at most one), and rows left `pending` (none, once the lease and a
  completer period have passed: the completer finishes what the SDK gave up on);
- charges per payment at the provider (at most one charge key per payment);
- every call the SDK saw succeed answered with the payment `GET /payments/{id}` returns.

Run by hand (it needs the SDK, which CI does not install):

    pip install --target /tmp/stripe-sdk stripe      # or into a virtualenv
    cargo build --all-features --example payments
    PYTHONPATH=/tmp/stripe-sdk python3 tests/clients/stripe_sdk.py --calls 500 --kill-every 8

It reads DATABASE_URL (the machine's Postgres; a schema of its own, dropped at the end) and starts
its own redis-server. Exits 1 when a payment is left pending or charged twice.
"""
import argparse
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import stripe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATABASE_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def psql(sql, schema=None):
    if schema:
        sql = f"SET search_path TO {schema}; {sql}"
    out = subprocess.run(["psql", DATABASE_URL, "-Atqc", sql], check=True, capture_output=True)
    return out.stdout.decode().strip()


class Provider(http.server.ThreadingHTTPServer):
    """A payment provider that deduplicates on the key it is given: one charge per key."""

    def __init__(self):
        self.lock = threading.Lock()
        self.charges = {}  # charge key -> (charge id, payment key)
        self.calls = 0
        super().__init__(("127.0.0.1", free_port()), ProviderHandler)

    def charge_keys_per_payment(self):
        per = {}
        with self.lock:
            for _, reference in self.charges.values():
                per[reference] = per.get(reference, 0) + 1
        return per


class ProviderHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        key = self.headers["idempotency-key"]
        with self.server.lock:
            self.server.calls += 1
            if key not in self.server.charges:
                self.server.charges[key] = (f"ch_{uuid.uuid4().hex}", body["reference"])
            charge = self.server.charges[key][0]
        answer = json.dumps({"id": charge}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


class Balancer:
    """Round-robin TCP load balancer over the instances that accept connections."""

    def __init__(self, ports):
        self.ports, self.next = ports, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            client, _ = self.server.accept()
            threading.Thread(target=self.serve, args=(client,), daemon=True).start()

    def serve(self, client):
        for _ in range(len(self.ports)):
            port = self.ports[self.next % len(self.ports)]
            self.next += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=1)
                upstream.settimeout(None)
                break
            except OSError:
                continue
        else:
            client.close()
            return
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self.pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def pipe(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def start_instance(port, env):
    binary = os.path.join(ROOT, "target", "debug", "examples", "payments")
    log = open(f"/tmp/stripe-sdk-payments-{port}.log", "ab")
    process = subprocess.Popen([binary], env={**os.environ, **env, "PORT": str(port)},
                               stdout=log, stderr=log)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"instance on {port} never listened")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=8.0, help="seconds")
    parser.add_argument("--lease-ms", type=int, default=5000)
    parser.add_argument("--completer-period-ms", type=int, default=5000,
                        help="0: no completer (what the fleet did before it)")
    parser.add_argument("--pause-after-charge-ms", type=int, default=300,
                        help="widens the window between the charge and the last step")
    args = parser.parse_args()

    schema = f"stripe_sdk_{uuid.uuid4().hex[:12]}"
    psql(f"CREATE SCHEMA {schema}")
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL)
    provider = Provider()
    threading.Thread(target=provider.serve_forever, daemon=True).start()
    env = {
        "DATABASE_URL": f"{DATABASE_URL}?options[search_path]={schema}",
        "REDIS_URL": f"redis://127.0.0.1:{redis_port}",
        "PROVIDER_URL": f"http://127.0.0.1:{provider.server_address[1]}",
        "IDEMPOTENCY_LEASE_MS": str(args.lease_ms),
        "PAYMENTS_COMPLETER_PERIOD_MS": str(args.completer_period_ms),
        "PAYMENTS_PAUSE_AFTER_CHARGE_MS": str(args.pause_after_charge_ms),
        "RUST_LOG": "warn",
    }
    time.sleep(0.3)
    ports = [free_port() for _ in range(args.instances)]
    instances = [start_instance(port, env) for port in ports]
    balancer = Balancer(ports)
    base = f"http://127.0.0.1:{balancer.port}"

    done = threading.Event()
    kills = 0

    def killer():
        nonlocal kills
        n = 0
        while not done.wait(args.kill_every):
            i = n % len(instances)
            instances[i].send_signal(signal.SIGKILL)
            instances[i].wait()
            kills += 1
            instances[i] = start_instance(ports[i], env)
            n += 1

    # The SDK's own HTTP client, as StripeClient builds it: 80 s timeout, 2 retries.
    client = stripe.RequestsClient(timeout=80)

    def call(n):
        key = str(uuid.uuid4())
        body = json.dumps({"amount_cents": 100 + n, "currency": "usd", "customer": f"cus_{n}"})
        headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
        try:
            text, status, _ = client.request_with_retries(
                "post", f"{base}/payments", headers, body, max_network_retries=2)
        except stripe.APIConnectionError as error:
            return key, None, f"connection: {type(error).__name__}"
        if status != 201:
            return key, None, f"status {status}"
        return key, json.loads(text)["id"], None

    threading.Thread(target=killer, daemon=True).start()
    started = time.time()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(call, range(args.calls)))
    done.set()
    took = time.time() - started
    failures = {}
    for _, _, failure in results:
        if failure:
            failures[failure] = failures.get(failure, 0) + 1
    succeeded = [(key, id) for key, id, failure in results if not failure]

    # The completers' turn: a lease for the dead owners' claims, two periods, and a margin.
    wait = (args.lease_ms + 2 * max(args.completer_period_ms, 1000)) / 1000 + 5
    deadline = time.time() + wait
    while time.time() < deadline:
        if psql("SELECT count(*) FROM payments WHERE status = 'pending'", schema) == "0":
            break
        time.sleep(0.5)
    pending = int(psql("SELECT count(*) FROM payments WHERE status = 'pending'", schema))
    rows = int(psql("SELECT count(*) FROM payments", schema))
    duplicate_rows = int(psql("SELECT count(*) - count(DISTINCT idempotency_key) FROM payments", schema))
    charges = provider.charge_keys_per_payment()
    double_charges = sum(n - 1 for n in charges.values() if n > 1)
    mismatched = 0
    for key, id in succeeded:
        stored = psql(f"SELECT idempotency_key FROM payments WHERE id = '{id}'", schema)
        mismatched += stored != key

    print(f"calls {args.calls} in {took:.1f}s, {kills} kills (every {args.kill_every}s), "
          f"{len(succeeded)} succeeded, failed {failures or 0}")
    print(f"payment rows {rows}, duplicate rows {duplicate_rows}, left pending {pending} "
          f"(completer period {args.completer_period_ms} ms, lease {args.lease_ms} ms), "
          f"charged payments {len(charges)}, double charges {double_charges}, "
          f"provider calls {provider.calls}, success ids not the key's payment {mismatched}")

    for process in instances:
        process.send_signal(signal.SIGKILL)
    redis.send_signal(signal.SIGKILL)
    psql(f"DROP SCHEMA {schema} CASCADE")
    bad = pending or double_charges or duplicate_rows or mismatched
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
