#!/bin/bash
# check_roundtrip.sh - the canonical spec round-trips: the fully defaulted spec `ampd run`
# prints in its start line (data.train_images and the other resolved IDX files, the whole
# precision.autocast.table, every default) is a spec that can be submitted back. For an mlp
# on Fashion-MNIST (IDX, from $AMPD_TEST_DATA; skipped without it), an mlp on synthetic data
# with autocast overrides, and a gpt on a text file:
#   print -> `ampd run -` on it -> print gives the same canonical spec, byte for byte (every
#   `ampd run` exiting 0);
#   print -> POST /v1/jobs on a daemon is accepted (201), the job keeps that spec, its
#   worker accepts it and trains (succeeded), and `ampd run` on the spec the daemon stored
#   prints it again.
# Every daemon started here is killed on exit; every wait is bounded.
set -u
AMPD=${AMPD:-./ampd}
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp

ROOT=$TMP/root
mkdir -p "$ROOT"
for _ in $(seq 1 300); do echo 'the quick brown fox jumps over the lazy dog'; done >"$ROOT/text.txt"
IDX=${AMPD_TEST_DATA:-/usr/share/datasets/fashion-mnist}
ROOTS=(--data-root "$ROOT" --data-root "$(dirname "$IDX")")

# canon SPEC-FILE OUT: `ampd run -` on the spec; OUT gets the canonical spec of its start
# line (the raw text: "spec" is the line's last member). Returns ampd's exit status.
canon() {
    "$AMPD" run "${ROOTS[@]}" - <"$1" >"$TMP/out" 2>"$TMP/err"
    local rc=$?
    grep -m1 '^{"type":"start",' "$TMP/out" | sed 's/^.*,"spec"://; s/}$//' >"$2"
    [ "$rc" -eq 0 ] || sed 's/^/#   /' "$TMP/err" | tail -3
    return "$rc"
}

declare -A CASES
CASES[mlp-idx]='{"name": "rt-idx", "model": {"layers": [784, 16, 10]},
    "data": {"type": "idx", "train": "fashion-mnist"}, "precision": {"dtype": "fp16"},
    "batch_size": 16, "steps": 2, "threads": 1}'
CASES[mlp-synthetic]='{"name": "rt-synth", "model": {"layers": [16, 8, 4], "activation": "gelu"},
    "data": {"type": "synthetic", "train_size": 64, "eval_size": 16},
    "precision": {"dtype": "bf16", "autocast": {"overrides": {"softmax": "lowp", "add": "fp32"}}},
    "optimizer": {"type": "sgd", "lr": 0.05, "schedule": "cosine", "warmup_steps": 1},
    "batch_size": 8, "steps": 2, "eval_every": 1, "threads": 1}'
CASES[gpt-text]='{"name": "rt-gpt", "model": {"type": "gpt", "n_layer": 1, "n_head": 2,
    "d_model": 32, "seq_len": 16}, "data": {"type": "text", "train": "text.txt"},
    "precision": {"dtype": "fp16", "loss_scale": {"init": 1024, "growth_interval": 7}},
    "optimizer": {"lr": 0.0003, "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0},
    "batch_size": 4, "steps": 2, "threads": 1}'

serve "$TMP/port" "$TMP/daemon.log" --data-dir "$TMP/data" --no-dashboard "${ROOTS[@]}"
URL="http://127.0.0.1:${SERVE_PORT:-0}"
check "the daemon starts" test -n "$SERVE_PORT"

for name in mlp-idx mlp-synthetic gpt-text; do
    if [ "$name" = mlp-idx ] && [ ! -e "$IDX/train-images-idx3-ubyte.gz" ] &&
        [ ! -e "$IDX/train-images-idx3-ubyte" ]; then
        echo "# SKIP $name: no Fashion-MNIST in $IDX (Debian's dataset-fashion-mnist)"
        continue
    fi
    printf '%s\n' "${CASES[$name]}" >"$TMP/$name.json"
    canon "$TMP/$name.json" "$TMP/$name.c1"
    status_is "$name: ampd run on the spec" 0 $?
    check "$name: ampd run prints a canonical spec" test -s "$TMP/$name.c1"
    canon "$TMP/$name.c1" "$TMP/$name.c2"
    status_is "$name: ampd run on the canonical spec" 0 $?
    check "$name: the canonical spec submitted back to ampd run is accepted" \
        test -s "$TMP/$name.c2"
    check "$name: ... and prints the same canonical spec" cmp -s "$TMP/$name.c1" "$TMP/$name.c2"

    code=$(curl -sS -m 20 -o "$TMP/$name.resp" -w '%{http_code}' \
        -H 'Content-Type: application/json' --data-binary @"$TMP/$name.c1" "$URL/v1/jobs")
    check "$name: POST /v1/jobs of the canonical spec is accepted (got $code: $(head -c 200 \
        "$TMP/$name.resp"))" test "$code" = 201
    id=$(grep -o '"id":[0-9]*' "$TMP/$name.resp" | head -1 | cut -d: -f2)
    st=""
    for _ in $(seq 1 400); do
        st=$(curl -sS -m 10 "$URL/v1/jobs/${id:-0}" | grep -o '"status":"[a-z]*"' | head -1)
        case $st in *succeeded* | *failed* | *cancelled*) break ;; esac
        sleep 0.05
    done
    check "$name: ... and its worker trains it ($st)" test "$st" = '"status":"succeeded"'
    curl -sS -m 10 "$URL/v1/jobs/${id:-0}" >"$TMP/$name.job"
    check "$name: ... the job keeps the spec as submitted" \
        grep -qF ",\"spec\":$(cat "$TMP/$name.c1")}" "$TMP/$name.job"
    sed 's/^.*,"spec"://; s/}$//' "$TMP/$name.job" >"$TMP/$name.stored"
    canon "$TMP/$name.stored" "$TMP/$name.c3"
    status_is "$name: ampd run on the stored spec" 0 $?
    check "$name: ... and ampd run on the stored spec prints it again" \
        cmp -s "$TMP/$name.c1" "$TMP/$name.c3"
done

echo "$pass passed, $fail failed"
test "$fail" -eq 0
