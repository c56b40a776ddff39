#!/usr/bin/env bash
# A one-machine Slurm cluster for testing the sbatch scripts (run as root; Debian/Ubuntu).
#
#   jobs/slurm/local_cluster.sh up      # install slurm + munge if missing, start the daemons,
#                                       # wait until every node is idle (idempotent)
#   jobs/slurm/local_cluster.sh status  # sinfo of the local cluster
#   jobs/slurm/local_cluster.sh env     # print `export SLURM_CONF=...` for sbatch/sinfo/...
#   jobs/slurm/local_cluster.sh down    # stop the slurmds, slurmctld and the munged `up` started
#
# MPIPS_SLURM_NODES (default 2) virtual nodes mpips1, mpips2, ... on this machine, one slurmd
# each (`slurmd -N`), each declaring MPIPS_SLURM_CPUS (default 2) CPUs whatever the machine
# has (SlurmdParameters=config_overrides); proctrack/linuxproc, task/none; no accounting
# database (`sacct` does not work: use `sbatch --wait`, `scontrol show job`, or the
# job-completion file $MPIPS_SLURM_DIR/jobcomp.txt). So train.sbatch runs as on a real
# cluster, 2 nodes x 2 tasks: MPICH's mpiexec starts one proxy per node through srun, and
# MPI sees two nodes. Config, state, spool and logs live in MPIPS_SLURM_DIR (default
# /tmp/mpips-slurm); client commands find the config through
# SLURM_CONF=$MPIPS_SLURM_DIR/slurm.conf. Ports: 6817 (slurmctld), 6818 and up (slurmds).
# Cost on a fresh machine: ~25 s of apt (4 packages, --no-install-recommends), then ~1 s to
# start. `up` keeps a running cluster as it is: after changing the settings, `down` then `up`.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"   # munged, slurmctld, slurmd

DIR=${MPIPS_SLURM_DIR:-/tmp/mpips-slurm}
NODES=${MPIPS_SLURM_NODES:-2}
CPUS=${MPIPS_SLURM_CPUS:-2}
HOST=$(hostname -s)
NAMES=$(seq -f 'mpips%g' -s ' ' 1 "$NODES")
CONF=$DIR/slurm.conf
TIMEOUT=${MPIPS_SLURM_TIMEOUT:-60}   # seconds to wait for the nodes to become idle
export SLURM_CONF=$CONF

log() { echo "local_cluster: $*" >&2; }

install_packages() {
    local exe missing=0
    for exe in munged slurmctld slurmd sbatch; do
        command -v "$exe" >/dev/null 2>&1 || missing=1
    done
    [ "$missing" = 0 ] && return 0
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
    mkdir -p "$DIR/state" "$DIR/spool"
    cat >"$CONF" <<EOF
# written by jobs/slurm/local_cluster.sh: $NODES node(s) on $HOST, daemons as root, under $DIR
ClusterName=mpipslocal
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again after cred_expire seconds (default 120)
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
SlurmctldPort=6817
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=3600
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=30
EOF
    local i=0 name
    for name in $NAMES; do
        i=$((i + 1))
        echo "NodeName=$name NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((6817 + i))" \
             "CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=1000" \
             "State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=local Nodes=${NAMES// /,} Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

alive() {  # alive PIDFILE: the daemon recorded there is running
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

munge_ok() {
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1
}

start_munge() {
    munge_ok && return 0
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge "$DIR"
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$DIR/munged.started"
    for _ in $(seq 50); do
        munge_ok && return 0
        sleep 0.1
    done
    log "munged did not start (see /var/log/munge/munged.log)"
    exit 1
}

ready_nodes() {  # how many nodes are up and usable
    sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | grep -c -E ' (idle|mixed|allocated)$' || true
}

wait_idle() {
    local name
    for _ in $(seq $((TIMEOUT * 2))); do
        if [ "$(ready_nodes)" = "$NODES" ]; then
            log "$NODES node(s) up ($NAMES); export SLURM_CONF=$CONF"
            return 0
        fi
        for name in $(sinfo -h -N -t down,drain -o %N 2>/dev/null | sort -u); do
            scontrol update nodename="$name" state=resume 2>/dev/null || true
        done
        sleep 0.5
    done
    log "nodes not idle after ${TIMEOUT}s; see $DIR/slurmctld.log and $DIR/slurmd-*.log"
    sinfo -N >&2 || true
    exit 1
}

slurmds_alive() {
    local name
    for name in $NAMES; do alive "$DIR/slurmd-$name.pid" || return 1; done
}

up() {
    [ "$(id -u)" = 0 ] || { log "run as root (the daemons run as root)"; exit 1; }
    install_packages
    start_munge
    if alive "$DIR/slurmctld.pid" && slurmds_alive; then wait_idle; return 0; fi
    write_conf
    alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF"
    local name
    for name in $NAMES; do
        alive "$DIR/slurmd-$name.pid" || slurmd -f "$CONF" -N "$name"
    done
    wait_idle
}

stop_pidfile() {  # stop_pidfile FILE NAME: TERM the daemon, wait up to 10 s
    alive "$1" || return 0
    local pid
    pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    log "$2 (pid $pid) still running after 10 s"
}

down() {
    local pidfile
    for pidfile in "$DIR"/slurmd-*.pid; do
        [ -e "$pidfile" ] && stop_pidfile "$pidfile" slurmd
    done
    stop_pidfile "$DIR/slurmctld.pid" slurmctld
    if [ -e "$DIR/munged.started" ]; then
        stop_pidfile /run/munge/munged.pid munged
        rm -f "$DIR/munged.started"
    fi
    log "stopped"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) sinfo -N ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
