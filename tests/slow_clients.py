#!/usr/bin/python3
"""slow_clients.py - slow clients against a running `ampd serve` on loopback (run by
tests/check_slow.sh; Python's standard library only, one thread, every wait bounded).

It opens --slow connections that each send a request head one byte a second and never
finish it (what a slow-loris client does), and while they are held checks that:
  - the daemon's thread count does not grow with them (/proc/PID/status);
  - GET /healthz and GET /v1/jobs each answer 200 within 1 s, five times each;
  - --sse clients of the running job --job, connected with ?from_step at the job's
    current step, each receive at least three live step messages, every step once and in
    order;
then that the daemon closes every slow connection between --head-timeout - 0.5 s and
--head-timeout + 2.5 s after it opened, while the SSE clients (whose heads were complete)
stream on; and with --stop, that SIGTERM ends every SSE stream and the daemon within
--stop-within seconds. Prints one PASS:/FAIL: line per check and "# figure:" lines with
what it measured; exits 1 when a check failed, 77 when the open-file limit is too low.
"""
import argparse
import json
import os
import re
import resource
import selectors
import signal
import socket
import sys
import time

TRICKLE_S = 1.0  # one byte of a slow head per connection per second
HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096
STEP_RE = re.compile(rb'^data: \{"type":"step","step":(\d+),', re.M)

results = {"pass": 0, "fail": 0}


def check(name, ok, detail=""):
    results["pass" if ok else "fail"] += 1
    print(("PASS: " if ok else "FAIL: ") + name + (f" ({detail})" if detail else ""), flush=True)
    return ok


def figure(text):
    print("# figure: " + text, flush=True)


def threads_of(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def proc_gone(pid):
    """True when pid has exited (gone, or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def request(port, path, timeout):
    """GET path on a fresh connection: (status, body, seconds), status 0 on failure (body
    then says why)."""
    t0 = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(max(0.01, timeout - (time.monotonic() - t0)))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                      "Connection: close\r\n\r\n".encode())
            data = b""
            while True:
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    raise socket.timeout()
                s.settimeout(left)
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except socket.timeout:
        return 0, b"no answer within the time", time.monotonic() - t0
    except OSError as e:
        return 0, str(e).encode(), time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    if not m:
        return 0, b"closed without an answer", time.monotonic() - t0
    return int(m.group(1)), body, time.monotonic() - t0


class Slow:
    """A connection that trickles a request head it never completes."""

    def __init__(self, sock, now):
        self.sock = sock
        self.opened = now
        self.sent = 0
        self.next_send = now
        self.closed = None  # when the server closed it

    def trickle(self, now):
        if self.closed is not None or now < self.next_send:
            return
        try:
            self.sock.send(HEAD[self.sent:self.sent + 1])
            self.sent += 1
        except BlockingIOError:
            pass
        except OSError:
            self.closed = now
        self.next_send = now + TRICKLE_S

    def readable(self, now):
        try:
            data = self.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data and self.closed is None:
            self.closed = now


class Sse:
    """An SSE client: decodes the chunked body and collects the step numbers it receives."""

    def __init__(self, sock):
        self.sock = sock
        self.raw = b""
        self.head = None
        self.chunked = False
        self.left = -1  # bytes left in the current chunk; -1: a size line is next
        self.body = b""
        self.steps = []
        self.eof = False
        self.ended = False  # the chunked body's last chunk arrived

    def readable(self, now):
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return
        self.raw += data
        if self.head is None:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = self.raw[:end].decode("latin-1")
            self.chunked = "transfer-encoding: chunked" in self.head.lower()
            self.raw = self.raw[end + 4:]
        if self.chunked:
            self.dechunk()
        else:
            self.body += self.raw
            self.raw = b""
        self.messages()

    def dechunk(self):
        while self.raw and not self.ended:
            if self.left < 0:
                nl = self.raw.find(b"\r\n")
                if nl < 0:
                    return
                self.left = int(self.raw[:nl].split(b";")[0], 16)
                self.raw = self.raw[nl + 2:]
                if self.left == 0:
                    self.ended = True
                    return
            take = min(self.left, len(self.raw))
            self.body += self.raw[:take]
            self.raw = self.raw[take:]
            self.left -= take
            if self.left == 0:
                if len(self.raw) < 2:
                    self.left = 0  # wait for the CRLF after the chunk
                    return
                self.raw = self.raw[2:]
                self.left = -1

    def messages(self):
        end = self.body.rfind(b"\n\n")
        if end < 0:
            return
        done, self.body = self.body[:end + 2], self.body[end + 2:]
        self.steps.extend(int(m) for m in STEP_RE.findall(done))

    def status(self):
        m = re.match(r"HTTP/1\.[01] (\d{3})", self.head or "")
        return int(m.group(1)) if m else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--slow", type=int, default=1500)
    ap.add_argument("--sse", type=int, default=100)
    ap.add_argument("--head-timeout", type=float, required=True)
    ap.add_argument("--stop", action="store_true")
    ap.add_argument("--stop-within", type=float, default=10.0)
    a = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = a.slow + a.sse + 64
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            print(f"SKIP: the open-file limit ({hard}) is below the {need} descriptors needed")
            return 77
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    sel = selectors.DefaultSelector()
    slows, sses = [], []

    def pump(seconds, done=None):
        """Serve every socket for up to seconds, or until done() is true."""
        until = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            if now >= until or (done and done()):
                return
            for key, _ in sel.select(timeout=min(0.05, until - now)):
                key.data.readable(time.monotonic())
                if getattr(key.data, "closed", None) is not None or \
                        getattr(key.data, "eof", False):
                    sel.unregister(key.fileobj)
            now = time.monotonic()
            for c in slows:
                c.trickle(now)

    port = a.port
    threads_before = threads_of(a.pid)

    # ---- the slow connections ----
    t_open = time.monotonic()
    for _ in range(a.slow):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError as e:
            check("a slow connection opens", False, str(e))
            break
        s.setblocking(False)
        c = Slow(s, time.monotonic())
        c.trickle(c.opened)
        slows.append(c)
        sel.register(s, selectors.EVENT_READ, c)
    check(f"{a.slow} slow connections open (each sends its head one byte a second)",
          len(slows) == a.slow, f"{len(slows)} in {time.monotonic() - t_open:.1f} s")
    last_open = slows[-1].opened if slows else t_open
    pump(1.5)
    threads_slow = threads_of(a.pid)
    figure(f"daemon threads: {threads_before} before, {threads_slow} with {len(slows)} "
           "slow connections")
    check("the daemon's threads do not grow with slow connections",
          0 < threads_slow <= threads_before + 2, f"{threads_before} -> {threads_slow}")

    # ---- the API answers while they are held ----
    tries = {"/healthz": [], "/v1/jobs": []}
    for _ in range(5):
        for path, got in tries.items():
            status, body, took = request(port, path, 1.0)
            got.append((status == 200 and took <= 1.0, took, body[:80].decode("latin-1")))
        pump(0.1)
    for path, got in tries.items():
        answered = [took for ok, took, _ in got if ok]
        why = sorted({b for ok, _, b in got if not ok})
        detail = (f"{len(answered)} of 5 answered within 1 s" +
                  (f", slowest {max(answered) * 1000:.0f} ms" if answered else "") +
                  (f"; the others: {', '.join(why)}" if why else ""))
        figure(f"GET {path} under {len(slows)} slow connections: {detail}")
        check(f"GET {path} answers 200 within 1 s, 5 times, while they are held",
              len(answered) == 5, detail)

    # ---- SSE clients of the running job stream live ----
    status, body, _ = request(port, f"/v1/jobs/{a.job}", 2.0)
    try:
        job = json.loads(body)
        at = int(job["progress"]["step"])
        running = job["status"] == "running"
    except (ValueError, KeyError, TypeError):
        at, running = -1, False
    check("the job is running", status == 200 and running, f"status {status}, step {at}")
    at = max(at, 0)
    req = (f"GET /v1/jobs/{a.job}/stream?from_step={at} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
           "Accept: text/event-stream\r\n\r\n").encode()
    t_sse = time.monotonic()
    for _ in range(a.sse):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(req)
        except OSError as e:
            check("an SSE client connects", False, str(e))
            break
        s.setblocking(False)
        c = Sse(s)
        sses.append(c)
        sel.register(s, selectors.EVENT_READ, c)
    def fresh(c):  # the steps after the one the job was at when the clients connected
        return sum(1 for x in c.steps if x > at)

    pump(20, lambda: all(fresh(c) >= 3 for c in sses))
    took = time.monotonic() - t_sse
    got = [fresh(c) for c in sses]
    live = len(sses) == a.sse and all(
        c.status() == 200 and fresh(c) >= 3 and c.steps[0] <= at + 1 and
        c.steps == list(range(c.steps[0], c.steps[0] + len(c.steps))) for c in sses)
    figure(f"SSE: {len(sses)} clients from step {at}: each got >= {min(got or [0])} live "
           f"steps within {took:.1f} s ({sum(got)} messages in all)")
    check(f"{a.sse} SSE clients each receive 3 or more live step messages, every step once "
          "and in order, while the slow connections are held", live,
          f"{min(got or [0])} to {max(got or [0])} steps each in {took:.1f} s")
    threads_all = threads_of(a.pid)
    figure(f"daemon threads with {len(slows)} slow and {len(sses)} SSE connections: "
           f"{threads_all}")
    check("the daemon's threads do not grow with SSE clients either",
          0 < threads_all <= threads_before + 2, f"{threads_before} -> {threads_all}")

    held = time.monotonic() - last_open
    early = [c for c in slows if c.closed is not None]
    check("every slow connection was held while the checks ran",
          not early and held < a.head_timeout - 0.5,
          f"{len(early)} closed, checks ended {held:.1f} s after the last opened")

    # ---- the head deadline closes them ----
    pump(a.head_timeout + 3.0 - (time.monotonic() - last_open),
         lambda: all(c.closed is not None for c in slows))
    after = [c.closed - c.opened for c in slows if c.closed is not None]
    lo, hi = (min(after), max(after)) if after else (0.0, 0.0)
    figure(f"slow connections closed by the server: {len(after)} of {len(slows)}, "
           f"{lo:.1f} to {hi:.1f} s after they opened (head deadline {a.head_timeout:g} s)")
    check("the daemon closes every slow connection once its head deadline has passed",
          len(after) == len(slows) and lo >= a.head_timeout - 0.5 and
          hi <= a.head_timeout + 2.5, f"{len(after)} closed, after {lo:.1f} to {hi:.1f} s")

    before = [len(c.steps) for c in sses]
    pump(10, lambda: all(len(c.steps) > n for c, n in zip(sses, before)))
    on = all(not c.eof and len(c.steps) > n for c, n in zip(sses, before))
    check("the SSE clients are not closed by the head deadline and keep streaming", on,
          f"{sum(1 for c in sses if c.eof)} closed")
    status, _, took = request(port, "/healthz", 1.0)
    check("GET /healthz answers after the slow connections are gone", status == 200,
          f"{took * 1000:.0f} ms")

    # ---- a clean stop ----
    if a.stop:
        t_stop = time.monotonic()
        os.kill(a.pid, signal.SIGTERM)
        pump(a.stop_within, lambda: all(c.eof for c in sses))
        ends = time.monotonic() - t_stop
        whole = all(c.eof and c.ended for c in sses)
        figure(f"SIGTERM: every SSE stream ended in {ends:.2f} s")
        check("SIGTERM ends every SSE stream cleanly (the last chunk sent)", whole,
              f"{sum(1 for c in sses if c.eof)} of {len(sses)} closed in {ends:.1f} s")
        while not proc_gone(a.pid) and time.monotonic() - t_stop < a.stop_within:
            time.sleep(0.05)
        gone = time.monotonic() - t_stop
        figure(f"SIGTERM: the daemon exited after {gone:.2f} s")
        check(f"the daemon exits within {a.stop_within:g} s of SIGTERM", proc_gone(a.pid),
              f"{gone:.1f} s")

    for c in slows + sses:
        c.sock.close()
    print(f"{results['pass']} passed, {results['fail']} failed", flush=True)
    return 1 if results["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
