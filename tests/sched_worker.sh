#!/bin/bash
# sched_worker.sh - a test double for the worker binary, used by tests/check_sched.c: it
# takes the arguments the scheduler gives `ampd run` and prints the same kinds of JSON
# lines, but what it does is chosen by the spec ({"mode": ..., "steps": N, "ckpt": K,
# "delay": S}) so that the scheduler's handling of crashes, hangs, failures, cancels and
# resumes can be tested quickly and deterministically.
#   ok        N steps, a checkpoint every K steps, a summary, exit 0
#   slow      the same with `delay` seconds per step; SIGTERM: checkpoint, exit 130
#   crash     3 steps, a line on stderr, then SIGKILL to itself
#   fail      2 steps, a summary with an error, exit 1
#   overflow  steps 1-3 overflow (scale 8, 4, 2), then clean steps at scale 1
#   longline  a step line of about 3 MB (one huge field), then the ok run
#   garbage   non-JSON and type-less lines between the ok run's lines
#   hang, fds a start line, then silence (the test reads /proc/PID/fd of an fds worker)
set -u
ckdir="" resume="" spec=""
while [ $# -gt 0 ]; do
    case $1 in
    run) ;;
    --every) shift ;;
    --checkpoint-dir) ckdir=$2; shift ;;
    --resume) resume=$2; shift ;;
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
step=0
if [ -n "$resume" ]; then
    step=${resume##*ckpt-}
    step=${step%.safetensors}
fi

checkpoint() {
    local path="$ckdir/ckpt-$step.safetensors"
    echo "weights at step $step" >"$path.tmp" && mv "$path.tmp" "$path"
    printf '{"type":"checkpoint","step":%d,"path":"%s","bytes":%d}\n' "$step" "$path" \
        "$(wc -c <"$path")"
}
stopped=0
trap 'stopped=1' TERM INT

echo "{\"type\":\"start\",\"name\":\"fake\",\"params\":100,\"blas\":\"none\",\"spec\":{}}"
[ -n "$resume" ] && echo "{\"type\":\"resume\",\"step\":$step}"
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
    [ "$mode" = garbage ] && echo "not json at step $step" && echo '{"no_type":1}' && echo '[1,2'
    printf '{"type":"step","step":%d,"loss":%d.5,"lr":0.001,' "$step" "$step"
    printf '"loss_scale":%d,' "$scale"
    printf '"overflow":%s,"skipped":%s,"overflow_total":0,"skipped_total":0,' "$ovf" "$ovf"
    printf '"grad_norm":"NaN","step_ms":1.5,"samples_per_s":"Infinity","lost_updates":0,'
    printf '"mem":{"total":%d}%s}\n' $((1000 + step)) "$pad"
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
exit 0
