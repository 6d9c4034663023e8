#!/usr/bin/env bash
# A real, single-node SLURM cluster on this machine, for tests and for trying
# profiles/slurm by hand. Debian's packages, daemons started directly (no
# systemd), job accounting through slurmdbd and a private MariaDB, so sacct
# works as on a production cluster.
#
#   .ci/slurm.sh install      apt-get the packages if they are missing (root)
#   .ci/slurm.sh up DIR       configure and start everything; state, logs and
#                             config live in DIR (new or empty); /etc/slurm/
#                             slurm.conf, slurmdbd.conf, gres.conf become
#                             symlinks into DIR
#   .ci/slurm.sh down DIR     stop what `up DIR` started, remove the symlinks
#
# `up` prints KEY=VALUE lines (cluster, partition, account, gpus, ...) on
# stdout; everything else goes to stderr. It refuses to touch an
# /etc/slurm/slurm.conf that is not its own symlink (a real cluster's).
# The node offers FAKE_GPUS (default 2) GPUs as GRES backed by /dev/tty
# character devices: SLURM allocates them and sets CUDA_VISIBLE_DEVICES, which
# is all a CPU-only test can check.
set -euo pipefail

PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)
CLUSTER=draftflow
PARTITION=debug
ACCOUNT=draftflow
FAKE_GPUS=${FAKE_GPUS:-2}
CONF_DIR=/etc/slurm

log() { echo "slurm.sh: $*" >&2; }
die() { log "$*"; exit 1; }

missing_packages() {
    local p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
    done
}

install() {
    local missing
    missing=$(missing_packages)
    if [ -z "$missing" ]; then
        log "packages present"
        return
    fi
    [ "$(id -u)" = 0 ] || die "missing packages ($missing) and not root"
    command -v apt-get >/dev/null || die "missing packages ($missing) and no apt-get"
    log "installing: $missing"
    export DEBIAN_FRONTEND=noninteractive
    # Debian's postinst scripts must not start services: there is no systemd here.
    apt-get update -qq >&2
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >&2
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for() {  # wait_for SECONDS DESCRIPTION LOGFILE COMMAND...: exit 2 from COMMAND gives up at once
    local seconds=$1 what=$2 logfile=$3
    shift 3
    local deadline=$((SECONDS + seconds)) rc
    while :; do
        rc=0
        "$@" >/dev/null 2>&1 || rc=$?
        [ $rc -eq 0 ] && return 0
        if [ $rc -eq 2 ] || [ $SECONDS -ge $deadline ]; then
            [ -n "$logfile" ] && [ -s "$logfile" ] && { log "last lines of $logfile:"; tail -n 20 "$logfile" >&2; }
            die "$([ $rc -eq 2 ] && echo "gave up" || echo "timed out after ${seconds}s") waiting for $what"
        fi
        sleep 0.2
    done
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_daemons() {  # stop_daemons NAME=PIDFILE...: SIGTERM to all at once, SIGKILL after 15 s
    local entry name file pid pids=() alive=() i
    for entry in "$@"; do
        name=${entry%%=*}
        file=${entry#*=}
        [ -s "$file" ] || continue
        pid=$(cat "$file")
        rm -f "$file"
        # only the daemon it names: a stale pid file's number may belong to anything now
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || continue
        kill "$pid" 2>/dev/null && pids+=("$pid")
    done
    for i in $(seq 150); do
        alive=()
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null && alive+=("$pid")
        done
        [ ${#alive[@]} -eq 0 ] && return 0
        sleep 0.1
    done
    for pid in "${alive[@]}"; do
        log "$(cat "/proc/$pid/comm" 2>/dev/null) ($pid) ignored SIGTERM, killing it"
        kill -9 "$pid" 2>/dev/null || true
    done
}

own_link() {  # is $1 a symlink into $2?
    [ -L "$1" ] && case "$(readlink "$1")" in "$2"/*) return 0 ;; esac
    return 1
}

up() {
    local dir=$1
    [ "$(id -u)" = 0 ] || die "needs root (daemons, /etc/slurm)"
    [ -z "$(missing_packages)" ] || die "packages missing: $(missing_packages | tr '\n' ' ')(run: $0 install)"
    if [ -d "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
        die "$dir is not empty (a cluster there still up? run: $0 down $dir); give a new or empty folder"
    fi
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    for f in "$CONF_DIR/slurm.conf" "$CONF_DIR/slurmdbd.conf" "$CONF_DIR/gres.conf"; do
        if [ -e "$f" ] || [ -L "$f" ]; then
            own_link "$f" "$dir" && continue
            if [ -L "$f" ] && [ ! -e "$f" ]; then  # dangling: a crashed run's, whoever made it
                log "removing dangling link $f -> $(readlink "$f")"
                rm -f "$f"
                continue
            fi
            die "$f exists and is not ours: this machine has its own SLURM configuration"
        fi
    done
    # a failure on the way stops what already started
    # shellcheck disable=SC2064
    trap "log 'bring-up failed: stopping what started'; down '$dir' >&2 || true" EXIT
    # mysql and munge must reach their folders in it
    chmod 755 "$dir"
    mkdir -p "$dir/ctld" "$dir/slurmd" "$dir/log" "$dir/run"

    local node cpus mem_mb dbd_port ctld_port slurmd_port db_port db_pass
    node=$(hostname -s)
    cpus=$(nproc)
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
    dbd_port=$(free_port)
    ctld_port=$(free_port)
    slurmd_port=$(free_port)
    db_port=$(free_port)
    db_pass=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')

    # munge: reuse a running munged, else start our own
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        if [ ! -s /etc/munge/munge.key ]; then
            mungekey --create --keyfile=/etc/munge/munge.key
            chown munge:munge /etc/munge/munge.key
            chmod 400 /etc/munge/munge.key
        fi
        mkdir -p /run/munge
        chown munge:munge /run/munge
        chmod 755 /run/munge
        mkdir -p "$dir/munge"
        chown munge:munge "$dir/munge"
        runuser -u munge -- munged --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log"
        wait_for 20 munged "$dir/munge/munged.log" sh -c 'munge -n | unmunge'
        # munged writes its pid file as the munge user; remember that it is ours
        touch "$dir/run/munged.ours"
    fi

    # MariaDB, private: own data dir, own port on 127.0.0.1, run as mysql
    local my="$dir/mysql"
    mkdir -p "$my/data"
    chown -R mysql:mysql "$my"
    mariadb-install-db --no-defaults --user=mysql --datadir="$my/data" --auth-root-authentication-method=socket \
        --skip-test-db >"$dir/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed: see $dir/log/mariadb-install.log"
    mariadbd --no-defaults --user=mysql --datadir="$my/data" --socket="$my/mysqld.sock" \
        --pid-file="$my/mariadbd.pid" --bind-address=127.0.0.1 --port="$db_port" \
        --log-error="$my/mariadbd.log" --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
    local mariadbd_pid=$!
    wait_for 60 mariadbd "$my/mariadbd.log" \
        sh -c "kill -0 $mariadbd_pid || exit 2; mariadb --no-defaults --socket='$my/mysqld.sock' -u root -e 'select 1'"
    mariadb --no-defaults --socket="$my/mysqld.sock" -u root -e "
        CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_pass';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

    local gres_files
    gres_files="/dev/tty[20-$((20 + FAKE_GPUS - 1))]"
    cat >"$dir/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$dbd_port
SlurmUser=root
PidFile=$dir/run/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=$db_pass
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$dir/slurmdbd.conf"
    cat >"$dir/slurm.conf" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/slurmd
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
ReturnToService=2
# finished jobs stay visible to squeue/scontrol for 10 min
MinJobAge=600
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$dbd_port
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
GresTypes=gpu
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb Gres=gpu:$FAKE_GPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$dir/gres.conf" <<EOF
NodeName=$node Name=gpu File=$gres_files
EOF
    mkdir -p "$CONF_DIR"
    ln -sfn "$dir/slurm.conf" "$CONF_DIR/slurm.conf"
    ln -sfn "$dir/slurmdbd.conf" "$CONF_DIR/slurmdbd.conf"
    ln -sfn "$dir/gres.conf" "$CONF_DIR/gres.conf"

    slurmdbd || die "slurmdbd did not start: see $dir/log/slurmdbd.log"
    wait_for 30 slurmdbd "$dir/log/slurmdbd.log" sacctmgr -n list cluster
    sacctmgr -i add cluster "$CLUSTER" >&2
    sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" description=draftflow organization=draftflow >&2
    sacctmgr -i add user "$(id -un)" account="$ACCOUNT" defaultaccount="$ACCOUNT" cluster="$CLUSTER" >&2
    slurmctld || die "slurmctld did not start: see $dir/log/slurmctld.log"
    wait_for 30 slurmctld "$dir/log/slurmctld.log" scontrol ping
    slurmd || die "slurmd did not start: see $dir/log/slurmd.log"
    wait_for 30 "node $node idle" "$dir/log/slurmd.log" sh -c "sinfo -h -N -n '$node' -o %t | grep -qx idle"

    trap - EXIT
    echo "cluster=$CLUSTER"
    echo "partition=$PARTITION"
    echo "account=$ACCOUNT"
    echo "node=$node"
    echo "cpus=$cpus"
    echo "gpus=$FAKE_GPUS"
    echo "dir=$dir"
}

down() {
    local dir=$1
    [ -d "$dir" ] || { log "$dir: nothing to stop"; return 0; }
    dir=$(cd "$dir" && pwd)
    # running jobs first, so nothing holds the node
    if [ -e "$dir/run/slurmctld.pid" ] && own_link "$CONF_DIR/slurm.conf" "$dir"; then
        scancel --quiet --user="$(id -un)" 2>/dev/null || true
        local i
        for i in $(seq 50); do
            [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    stop_daemons slurmd="$dir/run/slurmd.pid" slurmctld="$dir/run/slurmctld.pid"
    stop_daemons slurmdbd="$dir/run/slurmdbd.pid" mariadbd="$dir/mysql/mariadbd.pid"
    if [ -e "$dir/run/munged.ours" ]; then
        stop_daemons munged="$dir/munge/munged.pid"
        rm -f "$dir/run/munged.ours"
    fi
    local f
    for f in slurm.conf slurmdbd.conf gres.conf; do
        own_link "$CONF_DIR/$f" "$dir" && rm -f "$CONF_DIR/$f"
    done
    log "stopped ($dir kept: logs in $dir/log)"
}

case "${1:-}" in
    install) install ;;
    up) [ $# -eq 2 ] || die "usage: $0 up DIR"; up "$2" ;;
    down) [ $# -eq 2 ] || die "usage: $0 down DIR"; down "$2" ;;
    *) die "usage: $0 install | up DIR | down DIR" ;;
esac
