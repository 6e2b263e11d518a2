#!/usr/bin/python3
"""sse_clients.py - many SSE subscribers of one running job, and the daemon's memory (run by
bench/sse.sh; Python's standard library only, one thread).

Reads the daemon's VmRSS (/proc/PID/status) before; opens N connections to
GET /v1/jobs/ID/stream (each from the job's first message, so each catches up on the whole
history, as a dashboard opened late does); reads from all of them until each has received at
least --min-bytes; reads VmRSS while they are all open (the peak of --hold seconds of
sampling); closes them and reads VmRSS again after --settle seconds. Prints one JSON line.
"""
import argparse
import json
import selectors
import socket
import time


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--min-bytes", type=int, default=65536)
    ap.add_argument("--hold", type=float, default=5.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--from-step", type=int, default=-1)
    a = ap.parse_args()

    before = rss_kb(a.pid)
    sel = selectors.DefaultSelector()
    got = {}
    q = f"?from_step={a.from_step}" if a.from_step >= 0 else ""
    req = (f"GET /v1/jobs/{a.job}/stream{q} HTTP/1.1\r\nHost: 127.0.0.1:{a.port}\r\n"
           "Accept: text/event-stream\r\n\r\n").encode()
    for _ in range(a.clients):
        s = socket.create_connection(("127.0.0.1", a.port))
        s.sendall(req)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        got[s] = 0
    peak = rss_kb(a.pid)
    deadline = time.time() + 120
    while time.time() < deadline and min(got.values()) < a.min_bytes:
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(1 << 16)
            except BlockingIOError:
                continue
            got[key.fileobj] += len(data)
        peak = max(peak, rss_kb(a.pid))
    caught_up = sum(1 for v in got.values() if v >= a.min_bytes)
    end = time.time() + a.hold
    while time.time() < end:  # keep reading: live messages
        for key, _ in sel.select(timeout=0.2):
            try:
                got[key.fileobj] += len(key.fileobj.recv(1 << 16))
            except BlockingIOError:
                pass
        peak = max(peak, rss_kb(a.pid))
    for s in list(got):
        sel.unregister(s)
        s.close()
    time.sleep(a.settle)
    after = rss_kb(a.pid)
    print(json.dumps({"clients": a.clients, "caught_up": caught_up,
                      "bytes_min": min(got.values()), "rss_mb_before": round(before / 1024, 1),
                      "rss_mb_peak": round(peak / 1024, 1), "rss_mb_after": round(after / 1024, 1)}))


main()
