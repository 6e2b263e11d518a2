#!/bin/bash
# check_guard.sh - guard mode end to end: `AMPD_GUARD=1 ampd run` puts every block of the job
# (weights, gradients, optimizer state, activations, scratch) between inaccessible pages and
# checks the bytes around each after every step. A bf16 and an fp16 GPT and MLP train several
# steps that way on every GEMM path this machine has (`ampd version` lists them: openblas and
# emulated everywhere, widen and native where oneDNN has AVX-512 and AVX512_BF16 kernels):
# each exits 0 with its summary succeeded, and its log says that guard mode was on and
# raises no warning that AMPD_GEMM named a path it cannot take. Evaluation and diagnostics
# run too (they use the same blocks). A path this machine lacks is reported as SKIP. (The
# native plans' fallback on subnormal operands, where a scratch overrun once hid, is forced
# by check_gpt's test_native_subnormal_grads on guarded blocks.)
set -u
AMPD=${AMPD:-./ampd}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"

paths=$("$AMPD" version | sed -n 's/^gemm paths (AMPD_GEMM): //p')
check "ampd version lists the GEMM paths ($paths)" test -n "$paths"

mkdir -p "$TMP/text"
for i in $(seq 1 300); do echo "a guard page after every block, line $((i * 7919 % 1000))"; done \
    >"$TMP/text/lines.txt"

gpt() { # dtype -> spec
    printf '{"name":"guard-gpt-%s","model":{"type":"gpt","n_layer":2,"n_head":2,"d_model":64,' "$1"
    printf '"seq_len":32,"vocab":256},"data":{"type":"text","train":"lines.txt"},'
    printf '"precision":{"dtype":"%s","loss_scale":{"mode":"none"}},' "$1"
    printf '"optimizer":{"type":"adamw","lr":0.001},"batch_size":4,"steps":6,'
    printf '"eval_every":3,"diagnostics_every":3,"threads":2,"device":"cpu","seed":3}'
}
mlp() { # dtype -> spec
    printf '{"name":"guard-mlp-%s","model":{"layers":[48,96,64,10]},' "$1"
    printf '"data":{"type":"synthetic","train_size":512,"eval_size":128},'
    printf '"precision":{"dtype":"%s"},"batch_size":64,"steps":12,"eval_every":6,' "$1"
    printf '"diagnostics_every":4,"threads":2,"device":"cpu"}'
}

for path in openblas widen native emulated; do
    case " $paths " in
    *" $path "*) ;;
    *)
        echo "SKIP: guard mode on the $path path: not on this machine (paths: $paths)"
        continue
        ;;
    esac
    for model in gpt mlp; do
        for dt in bf16 fp16; do
            name="$model $dt on $path"
            "$model" "$dt" | AMPD_GUARD=1 AMPD_GEMM=$path "$AMPD" run --data-root "$TMP/text" - \
                >"$TMP/out" 2>"$TMP/err"
            rc=$?
            status_is "$name" 0 "$rc"
            check "$name: summary succeeded" grep -q '"type":"summary",.*"status":"succeeded"' \
                "$TMP/out"
            check "$name: the log says guard mode is on" grep -q 'guard mode:' "$TMP/err"
            check "$name: no AMPD_GEMM warning" \
                sh -c "! grep -q 'not a GEMM path' '$TMP/err'"
            if [ "$rc" -ne 0 ]; then
                tail -5 "$TMP/err"
            fi
        done
    done
done

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
