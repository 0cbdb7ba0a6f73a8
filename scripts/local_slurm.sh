#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for the tests (make test-slurm) and for trying
# hydra/launcher=slurm on a laptop or a CI machine.
#
#   scripts/local_slurm.sh start    install what is missing (apt-get, as root), start the daemons, wait until the
#                                   node is idle; does nothing when the cluster is already up
#   scripts/local_slurm.sh stop     cancel the cluster's jobs, stop the daemons this script started
#   scripts/local_slurm.sh status   up or down (exit 0 / 3), the node's state, the SLURM_CONF to use
#   scripts/local_slurm.sh env      the export line for: eval "$(scripts/local_slurm.sh env)"
#
# Settings (environment):
#   LOCAL_SLURM_DIR         state folder: configs, logs, pid files, spool, the accounting database
#                           (default /tmp/rewarduq-local-slurm)
#   LOCAL_SLURM_ACCOUNTING  1 (default): job accounting (slurmdbd on a private MariaDB), so that sacct answers as on a
#                           real cluster; 0: none, sacct then fails ("accounting storage is disabled"), the setting of
#                           a cluster without slurmdbd
#   LOCAL_SLURM_PORT        first of four TCP ports on 127.0.0.1 (default 6817): slurmctld, slurmd, slurmdbd, MariaDB
#
# Needs root: slurmd starts jobs as their users, and the packages (slurm-wlm, munge; slurmdbd and mariadb-server for
# accounting) are installed with apt-get when missing. Besides the packages, nothing is written under /etc but the
# munge key, created (Debian's place for it) only when there is none. Slurm's own settings all live in
# $LOCAL_SLURM_DIR/etc/slurm.conf, which the Slurm commands read through SLURM_CONF. The accounting database is a
# MariaDB server of its own (data, socket and port under this script's control), so a system MariaDB, if any, is never
# touched. When accounting cannot be set up (no package, the database does not start), the cluster starts without it
# and says so.
#
# The node is this machine as nproc and /proc/meminfo see it (less a memory margin for the system), in one partition,
# "debug". No cgroups (proctrack/linuxproc, task/none): they are not available in most containers, and the tests need
# scheduling, arrays, requeue and signals, not resource enforcement. The timeouts are short so that scancel, requeue
# and a node's return are quick.
set -euo pipefail

STATE=${LOCAL_SLURM_DIR:-/tmp/rewarduq-local-slurm}
CONF_DIR=$STATE/etc
CONF=$CONF_DIR/slurm.conf
RUN=$STATE/run
LOG=$STATE/log
ACCOUNTING=${LOCAL_SLURM_ACCOUNTING:-1}
PORT=${LOCAL_SLURM_PORT:-6817}
CTLD_PORT=$PORT
SLURMD_PORT=$((PORT + 1))
DBD_PORT=$((PORT + 2))
DB_PORT=$((PORT + 3))
DB_SOCKET=$RUN/mariadb.sock
CLUSTER=rewarduq-local
HOST=$(hostname -s)
export SLURM_CONF=$CONF
PATH=$PATH:/usr/sbin:/sbin  # the daemons are in sbin, which a non-login shell may not have on its PATH

say() { echo "local_slurm: $*"; }
die() { echo "local_slurm: $*" >&2; exit 1; }

# The pid a pid file names, if that process is alive and is the program named (a pid file left by a crash may name a
# pid that another program now has).
live_pid() {
    local file=$1 prog=$2 pid
    [[ -s $file ]] || return 1
    pid=$(tr -dc '0-9' < "$file")
    # (/proc rather than ps: procps is not in every minimal image)
    [[ -n $pid ]] && [[ "$(cat "/proc/$pid/comm" 2> /dev/null)" == "$prog" ]] || return 1
    echo "$pid"
}

node_state() { timeout 15 sinfo -h -o %T 2>/dev/null | head -n 1; }

is_up() {
    live_pid "$RUN/slurmctld.pid" slurmctld > /dev/null && live_pid "$RUN/slurmd.pid" slurmd > /dev/null || return 1
    [[ "$(node_state)" =~ ^(idle|mixed|allocated|completing)$ ]]
}

install_packages() {  # install_packages <package>...; apt-get update only when the package lists are stale
    # The lock timeout: on a freshly booted machine, unattended upgrades may hold dpkg's lock for a while.
    local apt=(apt-get -y -q -o DPkg::Lock::Timeout=600)
    export DEBIAN_FRONTEND=noninteractive
    "${apt[@]}" install --no-install-recommends "$@" > "$LOG/apt.log" 2>&1 && return 0
    "${apt[@]}" update >> "$LOG/apt.log" 2>&1 || true
    "${apt[@]}" install --no-install-recommends "$@" >> "$LOG/apt.log" 2>&1
}

ensure_slurm() {
    local tool missing=0
    for tool in sbatch slurmctld slurmd munged; do
        command -v "$tool" > /dev/null || missing=1
    done
    if ((missing)); then
        [[ $(id -u) == 0 ]] || die "Slurm is not installed; as root: apt-get install slurm-wlm munge"
        command -v apt-get > /dev/null \
            || die "Slurm is not installed and there is no apt-get; install Slurm (slurmctld, slurmd, sbatch) and munge"
        say "installing slurm-wlm and munge (apt-get) ..."
        install_packages slurm-wlm munge || die "apt-get install slurm-wlm munge failed; see $LOG/apt.log"
    fi
}

ensure_munge() {
    if munge -n < /dev/null 2> /dev/null | unmunge > /dev/null 2>&1; then
        return 0  # a munged is running (the system's, or ours from an earlier start)
    fi
    local key=/etc/munge/munge.key
    if [[ ! -s $key ]]; then
        install -d -o munge -g munge -m 0700 /etc/munge
        if command -v mungekey > /dev/null; then
            mungekey --create --keyfile="$key"
        elif command -v create-munge-key > /dev/null; then
            create-munge-key -f > /dev/null
        else
            dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
        fi
        chown munge:munge "$key"
        chmod 0400 "$key"
    fi
    # A fresh boot has no /run/munge (tmpfs); munged checks the ownership of these folders.
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    runuser -u munge -- munged || die "munged did not start; see /var/log/munge/munged.log"
    local pid
    for _ in $(seq 50); do
        pid=$(live_pid /run/munge/munged.pid munged) && break
        sleep 0.1
    done
    [[ -n ${pid:-} ]] || die "munged did not start; see /var/log/munge/munged.log"
    echo "$pid" > "$RUN/munged.pid"  # so that stop ends it, and only it
}

# MariaDB for slurmdbd; its data folder is created once and kept, so sacct remembers earlier jobs across restarts.
start_mariadb() {
    local data=$STATE/mariadb pass_file=$CONF_DIR/db-password server=""
    if ! live_pid "$RUN/mariadbd.pid" mariadbd > /dev/null; then
        if [[ ! -d $data/mysql ]]; then
            rm -rf "$data"
            mariadb-install-db --no-defaults --user=root --datadir="$data" --auth-root-authentication-method=socket \
                --skip-test-db > "$LOG/mariadb-install.log" 2>&1 || return 1
        fi
        # --no-defaults: none of the system's my.cnf (its datadir, socket and port are the system server's). The lock
        # timeout is slurmdbd's recommendation; its buffer pool size is for large clusters (it logs that this is less).
        setsid mariadbd --no-defaults --user=root --datadir="$data" --socket="$DB_SOCKET" \
            --pid-file="$RUN/mariadbd.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
            --log-error="$LOG/mariadb.log" --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
            < /dev/null > /dev/null 2>&1 &
        server=$!
    fi
    local ok=0
    for _ in $(seq 60); do
        if mariadb --no-defaults --socket="$DB_SOCKET" -u root -e 'SELECT 1' > /dev/null 2>&1; then ok=1; break; fi
        [[ -z $server ]] || kill -0 "$server" 2> /dev/null || break  # it exited (its port taken, say)
        sleep 0.5
    done
    ((ok)) || return 1
    [[ -s $pass_file ]] || (umask 077 && head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' > "$pass_file")
    local pass
    pass=$(cat "$pass_file")
    mariadb --no-defaults --socket="$DB_SOCKET" -u root > "$LOG/mariadb-setup.log" 2>&1 <<SQL || return 1
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
SQL
    # slurmdbd refuses a slurmdbd.conf that others can read (it holds the password)
    (umask 077 && cat > "$CONF_DIR/slurmdbd.conf" <<EOF
# written by scripts/local_slurm.sh start
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
EOF
)
}

start_accounting() {
    if ! command -v slurmdbd > /dev/null || ! command -v mariadbd > /dev/null; then
        say "installing slurmdbd and mariadb-server for job accounting (apt-get) ..."
        if ! install_packages slurmdbd mariadb-server; then
            say "could not install slurmdbd and mariadb-server (see $LOG/apt.log)"
            return 1
        fi
    fi
    start_mariadb || { say "MariaDB did not start; see $LOG/mariadb.log"; return 1; }
    if ! live_pid "$RUN/slurmdbd.pid" slurmdbd > /dev/null; then
        slurmdbd || { say "slurmdbd did not start; see $LOG/slurmdbd.log"; return 1; }
    fi
    # slurmdbd creates its tables on the first start, which takes a few seconds
    for _ in $(seq 60); do
        if timeout 10 sacctmgr -n -P list cluster format=cluster > "$RUN/clusters" 2>/dev/null; then
            grep -qx "$CLUSTER" "$RUN/clusters" || timeout 10 sacctmgr -i add cluster "$CLUSTER" > /dev/null || return 1
            return 0
        fi
        sleep 0.5
    done
    say "slurmdbd does not answer; see $LOG/slurmdbd.log"
    return 1
}

write_slurm_conf() {  # write_slurm_conf <accounting_storage plugin>
    local cpus mem_total margin mem
    # not plain nproc: it answers OMP_NUM_THREADS when that is set (the test suite sets it to 1 for its own processes)
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    mem_total=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)  # MB, as free -m says
    # slurmd drains a node that has less memory than configured; leave the system a margin (5%, at least 512 MB)
    margin=$((mem_total / 20 > 512 ? mem_total / 20 : 512))
    mem=$((mem_total - margin))
    local acct_lines="AccountingStorageType=accounting_storage/none"
    if [[ $1 == slurmdbd ]]; then
        acct_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT"
    fi
    : > "$CONF_DIR/plugstack.conf"  # none of the system's SPANK plugins
    cat > "$CONF" <<EOF
# written by scripts/local_slurm.sh start ($(date -Is)); rewritten at every start
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds (default 120) before it may start again
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=5
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$acct_lines
JobRequeue=1
ReturnToService=2
# quick scancel, requeue and cleanup: the tests wait for all of these
KillWait=5
MinJobAge=10
MessageTimeout=10
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
Waittime=0
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
PlugStackConfig=$CONF_DIR/plugstack.conf
MailProg=/bin/true
# a job without --mem gets its CPUs' share, not the whole node (which would run one job at a time)
DefMemPerCPU=$((mem / cpus))
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
# OverSubscribe=YES: jobs that ask (sbatch --oversubscribe) may share a CPU, up to 4 per CPU; the tests start 8 array
# tasks at once on a 2-core machine that way. Jobs that do not ask get CPUs of their own, as on a real cluster.
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

print_logs() {
    local f
    for f in "$LOG"/slurmctld.log "$LOG"/slurmd.log "$LOG"/slurmdbd.log; do
        [[ -s $f ]] && { echo "--- $f (last lines)" >&2; tail -n 15 "$f" >&2; }
    done
    return 0
}

start() {
    if is_up; then
        say "already up (SLURM_CONF=$CONF)"
        return 0
    fi
    if [[ $(id -u) != 0 ]]; then
        ensure_slurm  # (says what to install, if Slurm is missing)
        die "starting the cluster needs root (slurmd starts jobs as their users): sudo $0 start"
    fi
    mkdir -p "$CONF_DIR" "$RUN" "$LOG" "$STATE/spool/ctld" "$STATE/spool/slurmd"
    stop_daemons quiet  # what is left of an earlier start that is not up (a daemon died, a config changed)
    ensure_slurm
    ensure_munge
    local storage=none
    if [[ $ACCOUNTING != 0 ]]; then
        # slurmdbd reads the cluster's slurm.conf too (for sacctmgr), so write one first that points at it
        write_slurm_conf slurmdbd
        if start_accounting; then
            storage=slurmdbd
        else
            say "starting without job accounting (sacct will not answer)"
            stop_daemons quiet
            ensure_munge
        fi
    fi
    write_slurm_conf "$storage"
    echo "$storage" > "$RUN/accounting"
    slurmctld || { print_logs; die "slurmctld did not start"; }
    slurmd || { print_logs; die "slurmd did not start"; }
    local state=""
    for _ in $(seq 120); do
        state=$(node_state)
        [[ $state == idle ]] && break
        sleep 0.5
    done
    if [[ $state != idle ]]; then
        print_logs
        die "the node is not idle after 60 s (state: ${state:-no answer}); logs in $LOG"
    fi
    say "up: node $HOST idle, accounting: $([[ $storage == slurmdbd ]] && echo on || echo off)"
    say "use it with: export SLURM_CONF=$CONF"
}

stop_one() {  # stop_one <pid file> <program>: TERM, wait up to 30 s, then KILL
    local pid
    pid=$(live_pid "$1" "$2") || { rm -f "$1"; return 0; }
    kill -TERM "$pid" 2> /dev/null || true
    for _ in $(seq 60); do
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.5
    done
    if kill -0 "$pid" 2> /dev/null; then
        say "$2 ($pid) did not stop in 30 s; killing it"
        kill -KILL "$pid" 2> /dev/null || true
    fi
    rm -f "$1"
    [[ ${3:-} == quiet ]] || say "stopped $2"
}

stop_daemons() {
    stop_one "$RUN/slurmd.pid" slurmd "${1:-}"
    stop_one "$RUN/slurmctld.pid" slurmctld "${1:-}"
    stop_one "$RUN/slurmdbd.pid" slurmdbd "${1:-}"
    stop_one "$RUN/mariadbd.pid" mariadbd "${1:-}"
    stop_one "$RUN/munged.pid" munged "${1:-}"  # only when this script started it (a system munged has no file here)
}

stop() {
    if live_pid "$RUN/slurmctld.pid" slurmctld > /dev/null; then
        # The jobs' processes would outlive slurmd (linuxproc tracks, it does not contain): end them first.
        local jobs=()
        mapfile -t jobs < <(timeout 15 squeue -h -o %F 2> /dev/null | sort -u)
        ((${#jobs[@]} == 0)) || timeout 15 scancel "${jobs[@]}" > /dev/null 2>&1 || true
        for _ in $(seq 30); do
            [[ -z "$(timeout 10 squeue -h -o %A 2>/dev/null)" ]] && break
            sleep 0.5
        done
    fi
    stop_daemons
    say "down"
}

status() {
    if is_up; then
        local accounting=off
        [[ $(cat "$RUN/accounting" 2> /dev/null) == slurmdbd ]] && accounting=on
        say "up: node $HOST $(node_state), accounting: $accounting"
        say "SLURM_CONF=$CONF"
        return 0
    fi
    say "down (SLURM_CONF would be $CONF)"
    return 3
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
