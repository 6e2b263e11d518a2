#!/bin/bash
# walkthrough.sh - the console session of docs/api.md's walk-through, run for real: a daemon on
# localhost:8080 with a fresh database, the commands the walk-through shows, each printed
# after "$ " with what it answered. Run from the build directory after make:
#   docs/walkthrough.sh > /tmp/walkthrough.txt
# and paste the answers into docs/api.md (its GPT part comes from a second session).
set -u
T=$(mktemp -d)
AMPD=${AMPD:-./ampd}
"$AMPD" serve --listen 127.0.0.1:8080 --data-dir "$T/data" --db "$T/ampd.db" >"$T/daemon.log" 2>&1 &
D=$!; trap 'kill "$D"; wait; rm -rf "$T"' EXIT
sleep 1
run() { echo "\$ $*"; eval "$@"; echo; }
J1='{"name": "fmnist-fp16", "model": {"layers": [784, 256, 10]}, "precision": {"dtype": "fp16"}, "batch_size": 128, "steps": 600, "eval_every": 200, "checkpoint_every": 200, "diagnostics_every": 100}'
run "curl -s localhost:8080/healthz"
run "curl -s -H 'Content-Type: application/json' -H 'Idempotency-Key: demo-1' -d '$J1' localhost:8080/v1/jobs"
run "curl -s -H 'Content-Type: application/json' -H 'Idempotency-Key: demo-1' -d '$J1' localhost:8080/v1/jobs | head -c 120"
while ! curl -s localhost:8080/v1/jobs/1 | grep -q '"status":"succeeded"'; do sleep 0.5; done
run "curl -s localhost:8080/v1/jobs/1"
for dt in bf16 fp32; do
  curl -s -H 'Content-Type: application/json' -d "${J1//fp16/$dt}" localhost:8080/v1/jobs >/dev/null
done
run "curl -s 'localhost:8080/v1/jobs?status=queued&limit=1'"
SID=$(curl -sN localhost:8080/v1/jobs/1/stream | grep -B2 '"step":199,' | head -1 | cut -d' ' -f2)
run "curl -sN -H 'Last-Event-ID: $SID' localhost:8080/v1/jobs/1/stream | head -n 17"
run "curl -sN localhost:8080/v1/jobs/1/stream | tail -n 4"
LID=$(curl -sN localhost:8080/v1/jobs/1/stream | grep '^id:' | tail -1 | cut -d' ' -f2)
run "curl -s -o /dev/null -w '%{http_code}\n' -H 'Last-Event-ID: $LID' localhost:8080/v1/jobs/1/stream"
run "curl -s 'localhost:8080/v1/jobs/1/metrics?fields=loss,loss_scale&points=3'"
run "curl -s 'localhost:8080/v1/jobs/1/metrics?fields=loss,loss_scale,grad_norm&from=1&to=4&format=csv'"
run "curl -s 'localhost:8080/v1/jobs/1/events?limit=3'"
run "curl -s localhost:8080/v1/jobs/1/checkpoints; curl -s -o ckpt.safetensors localhost:8080/v1/jobs/1/checkpoints/600 && ls -l ckpt.safetensors"
run "curl -s localhost:8080/v1/jobs/1/layers"
while curl -s localhost:8080/v1/jobs | grep -q '"status":"\(queued\|running\)"'; do sleep 0.5; done
run "curl -s 'localhost:8080/v1/compare?ids=3,1,2'"
curl -s -H 'Content-Type: application/json' -d '{"name": "long", "model": {"layers": [784, 256, 10]}, "steps": 100000}' localhost:8080/v1/jobs >/dev/null
sleep 4
run "curl -s -X POST -H 'Content-Type: application/json' localhost:8080/v1/jobs/4/cancel | head -c 160; echo; sleep 2; curl -s -X POST -H 'Content-Type: application/json' localhost:8080/v1/jobs/4/resume | head -c 160"
sleep 1
run "curl -s localhost:8080/metrics | grep -E '^(# TYPE ampd_loss_scale|ampd_loss_scale|# TYPE ampd_jobs|ampd_jobs|ampd_step_seconds)'"
rm -f ckpt.safetensors # the download the walk-through shows
