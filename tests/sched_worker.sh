#!/bin/bash
# sched_worker.sh - a test double for the worker binary, used by tests/check_sched.c: it
# takes the arguments the scheduler gives `ampd run` and prints the same kinds of JSON
# lines, but what it does is chosen by the spec ({"mode": ..., "steps": N, "ckpt": K,
# "delay": S}) so that the scheduler's handling of crashes, hangs, failures, cancels and
# resumes can be tested quickly and deterministically.
#   ok        N steps, a checkpoint every K steps, a summary, exit 0
#   slow      the same with `delay` seconds per step; SIGTERM: checkpoint, exit 130
#   crash     3 steps, a line on stderr, then SIGKILL to itself
#   abort     the ok run, its "succeeded" summary included, then glibc's line on stderr and
#             SIGABRT to itself, as an `ampd run` whose cleanup finds a double free ends
#   fail      2 steps, a summary with an error, exit 1
#   overflow  steps 1-3 overflow (scale 8, 4, 2), then clean steps at scale 1
#   longline  a step line of about 3 MB (one huge field), then the ok run
#   garbage   non-JSON and type-less lines, and malformed layers and event lines, between
#             the ok run's lines
#   hang, fds a start line, then silence (the test reads /proc/PID/fd of an fds worker)
# With "keep": K (> 0) each checkpoint beyond the K newest of this run is dropped, as the
# retention of `ampd run --no-delete` does: a checkpoint_drop line after the newer one's line
# (the file is left for the daemon to delete).
# With "walkback": K (> 0) a resumed worker reports that the checkpoint it was given was
# damaged: it continues from K steps before it (the resume line names the skipped one, and
# a checkpoint_drop line follows), as `ampd run` walks back.
# With "diag": K (> 0) a "layers" line follows every K-th step's line and every overflowing
# step's line, as `ampd run` prints them (two layers: fc1 with plain numbers, fc2 with an
# "Infinity" headroom and a "NaN" underflow fraction; an overflowing step has act_overflow
# and grad_nonfinite 5 and a "NaN" grad_amax on fc2, and fc2's forward as the first
# non-finite), and the first diagnosed step also prints two recommendation events (one
# naming a layer) and an event of a kind the daemon keeps for itself.
set -u
ckdir="" resume="" spec=""
while [ $# -gt 0 ]; do
    case $1 in
    run) ;;
    --every) shift ;;
    --checkpoint-dir) ckdir=$2; shift ;;
    --resume) resume=$2; shift ;;
    --no-delete) ;;
    --data-root) shift ;;
    *) spec=$1 ;;
    esac
    shift
done
text=$(cat "$spec")
get() { # key default
    local v
    v=$(printf '%s' "$text" | sed -n "s/.*\"$1\": *\"\\{0,1\\}\\([A-Za-z0-9.]*\\).*/\\1/p")
    echo "${v:-$2}"
}
mode=$(get mode ok)
steps=$(get steps 20)
ckpt=$(get ckpt 0)
delay=$(get delay 0)
diag=$(get diag 0)
walkback=$(get walkback 0)
keep=$(get keep 0)
step=0
if [ -n "$resume" ]; then
    step=${resume##*ckpt-}
    step=${step%.safetensors}
fi

diagnosed=0
layers() { # step scale overflowed
    local first=null ovf=0 gmax=0.0625
    if [ "$3" = true ]; then
        first='{"layer":"fc2","where":"forward"}'
        ovf=5
        gmax='"NaN"'
    fi
    printf '{"type":"layers","step":%d,"scale":%d,' "$1" "$2"
    printf '"first_nonfinite":%s,"layers":[' "$first"
    printf '{"name":"fc1","dtype":"fp16","act_amax":%d.5,"act_headroom":32.75,' "$1"
    printf '"act_overflow":0,"grad_amax":0.125,"grad_underflow":0.25,'
    printf '"grad_underflow_unscaled":0.75,"grad_nonfinite":0,"lost_updates":0},'
    printf '{"name":"fc2","dtype":"fp16","act_amax":0,"act_headroom":"Infinity",'
    printf '"act_overflow":%d,"grad_amax":%s,"grad_underflow":"NaN",' "$ovf" "$gmax"
    printf '"grad_underflow_unscaled":0.5,"grad_nonfinite":%d,"lost_updates":0}]}\n' "$ovf"
    if [ "$diagnosed" = 0 ]; then
        diagnosed=1
        printf '{"type":"event","step":%d,"kind":"recommendation","layer":"fc1",' "$1"
        printf '"message":"75%% of the gradients of fc1 flush to zero without loss scaling"}\n'
        printf '{"type":"event","step":%d,"kind":"recommendation",' "$1"
        printf '"message":"loss scale pinned at its minimum"}\n'
        printf '{"type":"event","step":%d,"kind":"scale","message":"not the daemon'"'"'s"}\n' "$1"
    fi
}

kept=()
checkpoint() {
    local path="$ckdir/ckpt-$step.safetensors"
    echo "weights at step $step" >"$path.tmp" && mv "$path.tmp" "$path"
    printf '{"type":"checkpoint","step":%d,"path":"%s","bytes":%d}\n' "$step" "$path" \
        "$(wc -c <"$path")"
    kept+=("$step")
    if [ "$keep" -gt 0 ] && [ "${#kept[@]}" -gt "$keep" ]; then
        printf '{"type":"checkpoint_drop","step":%d,"path":"%s/ckpt-%d.safetensors",%s}\n' \
            "${kept[0]}" "$ckdir" "${kept[0]}" '"reason":"retention","deleted":false'
        kept=("${kept[@]:1}")
    fi
}
stopped=0
trap 'stopped=1' TERM INT

echo "{\"type\":\"start\",\"name\":\"fake\",\"params\":100,\"blas\":\"none\",\"spec\":{}}"
if [ -n "$resume" ] && [ "$walkback" -gt 0 ]; then
    from=$step
    step=$((step - walkback))
    printf '{"type":"resume","step":%d,"path":"%s/ckpt-%d.safetensors","skipped":' "$step" \
        "$ckdir" "$step"
    printf '[{"step":%d,"path":"%s","reason":"checksum mismatch: fake"}]}\n' "$from" "$resume"
    printf '{"type":"checkpoint_drop","step":%d,"path":"%s","reason":"checksum mismatch: fake"}\n' \
        "$from" "$resume"
elif [ -n "$resume" ]; then
    echo "{\"type\":\"resume\",\"step\":$step,\"path\":\"$resume\",\"skipped\":[]}"
fi
case $mode in
hang | fds) exec sleep 1000 ;;
esac
scale=1
while [ "$step" -lt "$steps" ]; do
    step=$((step + 1))
    ovf=false
    if [ "$mode" = overflow ] && [ "$step" -le 3 ]; then
        ovf=true
        scale=$((16 >> step))
    elif [ "$mode" = overflow ]; then
        scale=1
    fi
    pad=""
    if [ "$mode" = longline ] && [ "$step" -eq 2 ]; then
        pad=",\"pad\":\"$(head -c 3000000 /dev/zero | tr '\0' x)\""
    fi
    [ "$mode" = garbage ] && echo "not json at step $step" && echo '{"no_type":1}' && echo '[1,2' &&
        echo '{"type":"layers","step":2}' && echo '{"type":"layers","layers":[]}' &&
        echo '{"type":"layers","step":3,"layers":[{"dtype":"fp16","act_amax":1}]}' &&
        echo '{"type":"event","step":1,"kind":"Bad Kind","message":"x"}' &&
        echo '{"type":"event","step":1,"kind":"recommendation"}'
    printf '{"type":"step","step":%d,"loss":%d.5,"lr":0.001,' "$step" "$step"
    printf '"loss_scale":%d,' "$scale"
    printf '"overflow":%s,"skipped":%s,"overflow_total":0,"skipped_total":0,' "$ovf" "$ovf"
    printf '"grad_norm":"NaN","step_ms":1.5,"samples_per_s":"Infinity",'
    printf '"mem_bytes":%d,"peak_mem_bytes":%d,"comm_bytes":0,"comm_ms":0,' $((1000 + step)) \
        $((1000 + step))
    printf '"tokens_per_s":0,"lost_updates":0,"mem":{"total":%d}%s}\n' $((1000 + step)) "$pad"
    if [ "$diag" -gt 0 ] && { [ $((step % diag)) -eq 0 ] || [ "$ovf" = true ]; }; then
        layers "$step" "$scale" "$ovf"
    fi
    if [ "$ckpt" -gt 0 ] && [ $((step % ckpt)) -eq 0 ]; then
        checkpoint
    fi
    if [ "$mode" = crash ] && [ "$step" -eq 3 ]; then
        echo "boom: the fake worker crashes" >&2
        kill -KILL $$
    fi
    if [ "$mode" = fail ] && [ "$step" -eq 2 ]; then
        echo "fake failure on stderr" >&2
        printf '{"type":"summary","name":"fake","status":"failed","steps":2,%s}\n' \
            '"error":"loss scale stuck"'
        exit 1
    fi
    [ "$delay" != 0 ] && sleep "$delay"
    if [ "$stopped" = 1 ]; then
        checkpoint
        echo "{\"type\":\"summary\",\"name\":\"fake\",\"status\":\"interrupted\",\"steps\":$step}"
        exit 130
    fi
done
echo "{\"type\":\"eval\",\"step\":$step,\"eval_loss\":0.25,\"eval_acc\":0.9,\"count\":10}"
printf '{"type":"summary","name":"fake","status":"succeeded","steps":%d,' "$step"
printf '"final_loss_scale":%d}\n' "$scale"
if [ "$mode" = abort ]; then
    # glibc's line before its abort(), then SIGABRT with its default action (no trap), and no
    # core file left in the daemon's directory
    echo "double free or corruption (out)" >&2
    ulimit -c 0
    trap - ABRT
    kill -ABRT $$
    echo "sched_worker.sh: SIGABRT did not end the fake worker (ignored or blocked)" >&2
    exit 1
fi
exit 0
