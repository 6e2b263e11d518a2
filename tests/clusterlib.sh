# clusterlib.sh - a real two-node cluster on this one machine, for the tests of jobs that
# run across hosts (sourced by tests/check_cluster.sh after testlib.sh):
#   - a bridge in this network namespace and three network namespaces on it: "head"
#     (slurmctld) and two nodes, n1 and n2 (a slurmd each), with addresses of a /24 picked
#     from the script's pid (10.77.X.0/24; the bridge is .254, head .1, n1 .2, n2 .3); the
#     tests talk to no other address;
#   - each of head, n1 and n2 also has a mount namespace of its own, where a per-node
#     directory is bind-mounted over one path ($CL/node: the spool, TmpFS and PMIx's files,
#     which would collide otherwise) and a hostname of its own; namespaces are entered with
#     `nsenter --net` (`ip netns exec` remounts /sys and hides the cgroup mounts slurmd needs);
#   - munged of its own (its socket, key and pid under $CL/munge; the system's munge is not
#     touched), slurmctld and the two slurmd, every one started here and stopped by pid;
#   - cl_agent, Open MPI's plm_rsh_agent that starts a remote orted in a node's namespaces
#     instead of over SSH, for mpirun --host n1,n2;
#   - the environment srun, squeue and the ranks need: SLURM_CONF, and Open MPI's TCP
#     transports pinned to the cluster's subnet.
# cl_skip_reason prints why the cluster cannot run here (not root, no network namespaces, a
# missing package) and fails when it can; cl_up builds it, cl_down takes it apart (every
# daemon killed by pid, every process left in a node's namespace too, the namespaces and the
# bridge removed), also from the EXIT trap; cl_kill_node N and cl_start_slurmd N are the node
# failure and its return.
SLURM_PKGS="slurmctld slurmd slurm-client munge"
CL_NODES=(n1 n2)
CL_PIDS=()

# Why the cluster cannot be built here; nothing printed (and status 1) when it can.
cl_skip_reason() {
    local t
    if [ "$(id -u)" -ne 0 ]; then
        echo "not root: network namespaces and slurmd need root"
        return 0
    fi
    for t in ip nsenter unshare slurmctld slurmd srun squeue scontrol scancel sinfo munged; do
        if ! command -v "$t" >/dev/null; then
            echo "$t is missing (Debian packages: $SLURM_PKGS iproute2 util-linux)"
            return 0
        fi
    done
    if [ ! -e /usr/lib/x86_64-linux-gnu/slurm-wlm/mpi_pmix.so ] &&
        ! ls /usr/lib/*/slurm-wlm/mpi_pmix*.so >/dev/null 2>&1; then
        echo "Slurm's PMIx plugin (mpi_pmix.so, Debian slurm-wlm-basic-plugins) is missing"
        return 0
    fi
    if ! ip netns add "ampdprobe$$" 2>/dev/null; then
        echo "cannot create a network namespace here (ip netns add failed)"
        return 0
    fi
    ip netns del "ampdprobe$$"
    return 1
}

# cl_up DIR: build the cluster under DIR (CL); exports SLURM_CONF and Open MPI's variables.
cl_up() {
    CL=$1
    CL_TAG="a$(($$ % 100000))"
    CL_NET="10.77.$(($$ % 250)).0"
    CL_PFX=${CL_NET%.0}
    CL_BR="${CL_TAG}br"
    mkdir -p "$CL"/{state,munge,nodes/head,nodes/n1,nodes/n2,node}
    chmod 755 "$CL"
    cl_net || return 1
    cl_munge || return 1
    cl_conf
    cl_in head "hostname head && exec slurmctld -D -i -f $CL/slurm.conf" \
        >"$CL/slurmctld.out" 2>&1 &
    CL_PIDS+=($!)
    CL_CTLD=$!
    for n in n1 n2; do cl_start_slurmd "$n" || return 1; done
    export SLURM_CONF="$CL/slurm.conf"
    export OMPI_MCA_btl_tcp_if_include="$CL_NET/24" OMPI_MCA_oob_tcp_if_include="$CL_NET/24"
    export OMPI_MCA_btl="self,tcp" OMPI_MCA_pml="ob1"
    wait_for 60 cl_nodes_idle 2 || {
        echo "clusterlib: the nodes did not come up:"
        sinfo 2>&1
        tail -5 "$CL"/*.log
        return 1
    }
}

# The network: the bridge (.254 here), and per namespace a veth pair on it.
cl_net() {
    local i=1 ns
    ip link add "$CL_BR" type bridge && ip addr add "$CL_PFX.254/24" dev "$CL_BR" &&
        ip link set "$CL_BR" up || return 1
    for ns in head n1 n2; do
        ip netns add "$CL_TAG$ns" && ip link add "${CL_TAG}h$i" type veth peer name "${CL_TAG}v$i" &&
            ip link set "${CL_TAG}v$i" netns "$CL_TAG$ns" && ip link set "${CL_TAG}h$i" master "$CL_BR" &&
            ip link set "${CL_TAG}h$i" up &&
            ip -n "$CL_TAG$ns" addr add "$CL_PFX.$i/24" dev "${CL_TAG}v$i" &&
            ip -n "$CL_TAG$ns" link set "${CL_TAG}v$i" up && ip -n "$CL_TAG$ns" link set lo up ||
            return 1
        i=$((i + 1))
    done
}

# munged of the cluster's own, as the munge user, its files under $CL/munge.
cl_munge() {
    local m=$CL/munge
    dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 2>/dev/null
    chown -R munge:munge "$m" && chmod 711 "$m" && chmod 400 "$m/munge.key" || return 1
    runuser -u munge -- munged --socket="$m/munge.socket" --key-file="$m/munge.key" \
        --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" ||
        return 1
    wait_for 10 test -s "$m/munged.pid" && CL_PIDS+=("$(cat "$m/munged.pid")")
}

cl_conf() {
    cat >"$CL/slurm.conf" <<EOF
ClusterName=ampdtest
SlurmctldHost=head($CL_PFX.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$CL/munge/munge.socket
StateSaveLocation=$CL/state
SlurmdSpoolDir=$CL/node/spool
TmpFS=$CL/node/tmp
SlurmctldPidFile=$CL/node/slurmctld.pid
SlurmdPidFile=$CL/node/slurmd.pid
SlurmctldLogFile=$CL/slurmctld.log
SlurmdLogFile=$CL/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout=20
MessageTimeout=5
KillWait=5
NodeName=n1 NodeAddr=$CL_PFX.2 NodeHostname=n1 CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeAddr=$CL_PFX.3 NodeHostname=n2 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=30 State=UP
EOF
    echo "PMIxCliTmpDirBase=$CL/node/pmix" >"$CL/mpi.conf"
}

# cl_in NAME COMMAND: COMMAND (sh -c) in namespace NAME's network, a mount namespace of its
# own where $CL/nodes/NAME is $CL/node, and a hostname of its own (set by COMMAND).
cl_in() {
    nsenter --net="/run/netns/$CL_TAG$1" unshare --mount --uts --propagation private \
        sh -c "mount --bind $CL/nodes/$1 $CL/node && mkdir -p $CL/node/spool $CL/node/tmp $CL/node/pmix && $2"
}

# cl_start_slurmd NAME: node NAME's slurmd, in the foreground of a background job.
cl_start_slurmd() {
    cl_in "$1" "hostname $1 && exec slurmd -D -f $CL/slurm.conf -N $1" >>"$CL/slurmd-$1.out" 2>&1 &
    CL_PIDS+=($!)
}

cl_nodes_idle() { # N: whether N nodes are idle
    [ "$(sinfo -h -t idle -o '%D' 2>/dev/null | head -1)" = "$1" ]
}

# The processes in namespace NAME's network (slurmd, its steps, their ranks).
cl_node_pids() {
    local p ns
    ns=$(stat -L -c %i "/run/netns/$CL_TAG$1" 2>/dev/null) || return 0
    for p in /proc/[0-9]*; do
        [ "$(stat -L -c %i "$p/ns/net" 2>/dev/null)" = "$ns" ] && echo "${p#/proc/}"
    done
    return 0
}

# cl_kill_node NAME: SIGKILL to every process of node NAME, as if it lost power.
cl_kill_node() {
    local p
    for p in $(cl_node_pids "$1"); do kill -9 "$p" 2>/dev/null; done
}

# The agent Open MPI runs in place of ssh: `$CL/agent HOST COMMAND...`, COMMAND a shell
# command line as ssh would hand it to the remote shell (mpirun started by its full path
# puts PATH=... assignments before orted). cl_agent writes it, for plm_rsh_agent.
cl_agent() {
    cat >"$CL/agent" <<EOF
#!/bin/sh
# plm_rsh_agent for the test cluster: run Open MPI's orted in host \$1's namespaces
h=\$1
shift
exec nsenter --net=/run/netns/$CL_TAG\$h unshare --mount --uts --propagation private \
    sh -c "mount --bind $CL/nodes/\$h $CL/node && hostname \$h && \$*"
EOF
    chmod 755 "$CL/agent"
}

# Everything down: the daemons by pid, anything left in the namespaces, the namespaces,
# the bridge.
cl_down() {
    local p n
    [ -n "${CL_TAG:-}" ] || return 0
    for p in "${CL_PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
    for n in head n1 n2; do cl_kill_node "$n"; done
    for p in "${CL_PIDS[@]}"; do { wait "$p"; } 2>/dev/null; done
    for n in head n1 n2; do ip netns del "$CL_TAG$n" 2>/dev/null; done
    ip link del "$CL_BR" 2>/dev/null
    CL_TAG=""
    return 0
}
