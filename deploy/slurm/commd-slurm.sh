#!/bin/bash
# commd for Slurm: start (prolog) or stop (epilog) the job user's commd daemon on this node.
#
# Called as `commd-slurm.sh prolog` or `commd-slurm.sh epilog` by prolog.sh / epilog.sh
# (Slurm's Prolog= and Epilog= take a path without arguments).  slurmd runs them as root
# with no PATH and little more than SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_USER and
# SLURM_JOB_NODELIST.  A non-zero exit drains the node, so every job-side problem (a
# missing or broken commd, one the job user may not execute, a bad node list, a daemon that
# fails) is logged and recorded for the job's processes, which then fail with that reason; the
# script exits 0.  A job of root gets no daemon (refused, logged).
#
# Prolog: the daemon of job "slurm-$SLURM_JOB_ID" is started detached, as the job user,
# and the script returns at once: it never waits for other nodes.  Node rank = index
# of this node (SLURMD_NODENAME, else the short host name) in the expanded node list;
# node 0 hosts the rendezvous store at its own address, port PORT_BASE + job id mod
# PORT_SPAN.  A job on several nodes gets its secret as HMAC-SHA256(site secret,
# "commd-slurm-job:<id>"), computed here as root: the job user never sees the site secret.
# Epilog: SIGTERM to the daemon (and whatever its start left running), SIGKILL after
# STOP_TIMEOUT seconds, then the job's runtime directory and shared memory are removed.
#
# Settings: /etc/commd/slurm.conf (or $COMMD_SLURM_CONF), KEY=VALUE lines, read without
# executing anything; it must belong to root and be writable by root only.  Keys:
#   COMMD_BIN            absolute path of the job environment's `commd` (required).  The job user
#                        must be able to execute it and the interpreter it runs, and enter every
#                        directory above both; the prolog checks that and names what is closed
#   SITE_SECRET_FILE     site secret for jobs on several nodes (default /etc/commd/slurm-secret):
#                        32-64 hex digits, owned by root, mode 0600 or 0400, the same on every node
#   RUNTIME_DIR          the daemons' runtime root; %u = the job user's uid (default /tmp/commd-%u)
#   LOG_FILE             this script's log (default /var/log/commd-slurm.log); also syslog via logger
#   PORT_BASE, PORT_SPAN rendezvous ports (default 41000, 1000)
#   RENDEZVOUS_TIMEOUT   seconds a daemon waits for the other nodes (default 300)
#   STOP_TIMEOUT         seconds the epilog waits after SIGTERM before SIGKILL (default 20)
#   PLAN_TIMEOUT         seconds `commd slurm-plan` may take (default 60)
# The job's processes find the daemon with COMMD_JOB=slurm-$SLURM_JOB_ID and the same
# COMMD_RUNTIME_DIR: deploy/slurm/task-prolog.sh exports both (Slurm's TaskProlog=).

PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
umask 022

ACTION=${1:-}
CONF=${COMMD_SLURM_CONF:-/etc/commd/slurm.conf}

COMMD_BIN=
SITE_SECRET_FILE=/etc/commd/slurm-secret
RUNTIME_DIR=/tmp/commd-%u
LOG_FILE=/var/log/commd-slurm.log
PORT_BASE=41000
PORT_SPAN=1000
RENDEZVOUS_TIMEOUT=300
STOP_TIMEOUT=20
PLAN_TIMEOUT=60

JOB_ID=${SLURM_JOB_ID:-}
JOB_USER=${SLURM_JOB_USER:-}
JOB_UID=${SLURM_JOB_UID:-}
JOB_GID=
JOB_HOME=/
JOB=
JOBDIR=
NODE=${SLURMD_NODENAME:-$(hostname -s 2>/dev/null || uname -n)}
NODE=${NODE%%.*}

log() {
    local msg="commd $ACTION[job ${JOB_ID:-?}, node $NODE]: $*"
    timeout 5 logger -t commd-slurm -- "$msg" >/dev/null 2>&1
    printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$msg" >>"$LOG_FILE" 2>/dev/null
    printf '%s\n' "$msg" >&2
}

# Run a command as the job user (no PAM session, no new environment, no setuid gains).
as_user() {
    setpriv --reuid="$JOB_UID" --regid="$JOB_GID" --init-groups --no-new-privs -- "$@"
}

# A job-side failure: log it, leave the reason where the job's processes look, exit 0.
job_failed() {
    log "$1"
    if [[ -n $JOBDIR ]] && as_user test -d "$JOBDIR" 2>/dev/null; then
        printf 'on node %s: %s\n' "$NODE" "$1" | as_user sh -c 'cat >"$1.tmp" && mv -f "$1.tmp" "$1"' sh "$JOBDIR/start.error" 2>/dev/null
    fi
    exit 0
}

# Reads $CONF into the settings above.  A problem is recorded in CONF_PROBLEM (the prolog
# reports it to the job once the job directory exists; the epilog cleans up regardless).
CONF_PROBLEM=
conf_problem() { CONF_PROBLEM=$1; }

read_conf() {
    [[ -e $CONF ]] || return 0
    local owner_mode line key value n=0
    owner_mode=$(stat -L -c '%u %a' -- "$CONF" 2>/dev/null) || { conf_problem "cannot stat $CONF"; return; }
    [[ -f $CONF ]] || { conf_problem "$CONF is not a regular file"; return; }
    # Root runs what this file names: only root may be able to change it.
    if [[ ${owner_mode% *} != 0 ]] || (( 8#${owner_mode#* } & 8#022 )); then
        conf_problem "$CONF must belong to root and be writable by root only (it is: uid ${owner_mode% *}, mode ${owner_mode#* })"
        return
    fi
    while IFS= read -r line || [[ -n $line ]]; do
        n=$((n + 1))
        line=${line#"${line%%[![:space:]]*}"}
        line=${line%"${line##*[![:space:]]}"}
        [[ -z $line || $line == \#* ]] && continue
        [[ $line =~ ^([A-Z_]+)=(.*)$ ]] || { conf_problem "$CONF line $n: expected KEY=VALUE, got '$line'"; return; }
        key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
        if [[ $value =~ ^\"(.*)\"$ || $value =~ ^\'(.*)\'$ ]]; then value=${BASH_REMATCH[1]}; fi
        case $key in
            COMMD_BIN | SITE_SECRET_FILE | RUNTIME_DIR | LOG_FILE | PORT_BASE | PORT_SPAN | RENDEZVOUS_TIMEOUT | STOP_TIMEOUT | PLAN_TIMEOUT)
                printf -v "$key" '%s' "$value" ;;
            *) conf_problem "$CONF line $n: unknown setting $key"; return ;;
        esac
    done <"$CONF"
    local k
    for k in PORT_BASE PORT_SPAN RENDEZVOUS_TIMEOUT STOP_TIMEOUT PLAN_TIMEOUT; do
        [[ ${!k} =~ ^[0-9]{1,5}$ ]] || { conf_problem "$CONF: $k='${!k}' must be a whole number"; printf -v "$k" 1; }
    done
    ((PORT_BASE >= 1024 && PORT_SPAN >= 1 && PORT_BASE + PORT_SPAN <= 65536)) ||
        conf_problem "$CONF: ports PORT_BASE..PORT_BASE+PORT_SPAN must lie in [1024, 65536)"
    ((RENDEZVOUS_TIMEOUT >= 1 && PLAN_TIMEOUT >= 1)) || conf_problem "$CONF: timeouts must be at least 1 second"
    if [[ $RUNTIME_DIR != /* || $RUNTIME_DIR == *..* || $RUNTIME_DIR =~ [^A-Za-z0-9_./%-] ]]; then
        conf_problem "$CONF: RUNTIME_DIR='$RUNTIME_DIR' must be an absolute path of [A-Za-z0-9_./-] (and %u) without '..'"
        RUNTIME_DIR=/tmp/commd-%u
    fi
    [[ $LOG_FILE == /* ]] || { conf_problem "$CONF: LOG_FILE='$LOG_FILE' must be an absolute path"; LOG_FILE=/var/log/commd-slurm.log; }
}

# The job, its user and the job's runtime directory, all validated.
job_identity() {
    [[ $JOB_ID =~ ^[0-9]{1,12}$ ]] || job_failed "SLURM_JOB_ID='$JOB_ID' is not a job id"
    JOB=slurm-$JOB_ID
    [[ $JOB_USER =~ ^[A-Za-z_][A-Za-z0-9_.-]{0,31}$ ]] || job_failed "SLURM_JOB_USER='$JOB_USER' is not a user name"
    [[ $JOB_UID =~ ^[0-9]{1,10}$ ]] || job_failed "SLURM_JOB_UID='$JOB_UID' is not a uid"
    local uid
    uid=$(id -u -- "$JOB_USER" 2>/dev/null) || job_failed "user '$JOB_USER' does not exist on this node"
    [[ $uid == "$JOB_UID" ]] || job_failed "user '$JOB_USER' has uid $uid here, not SLURM_JOB_UID=$JOB_UID"
    ((JOB_UID != 0)) || job_failed "refusing to run a commd daemon as root (job user '$JOB_USER')"
    JOB_GID=$(id -g -- "$JOB_USER") || job_failed "cannot find the group of user '$JOB_USER'"
    JOB_HOME=$(getent passwd -- "$JOB_USER" | cut -d: -f6)
    [[ -n $JOB_HOME ]] || JOB_HOME=/
    RUNTIME_DIR=${RUNTIME_DIR//%u/$JOB_UID}
    JOBDIR=$RUNTIME_DIR/$JOB
}

# HMAC-SHA256 of $2 with key $1 (ASCII, at most 64 bytes), hex.  Bash and sha256sum only:
# the key never appears on a command line (printf is a builtin).
hmac_sha256() {
    local key=$1 msg=$2 i c ipad= opad= inner outer
    for ((i = 0; i < 64; i++)); do
        if ((i < ${#key})); then printf -v c '%d' "'${key:i:1}"; else c=0; fi
        printf -v ipad '%s\\x%02x' "$ipad" $((c ^ 0x36))
        printf -v opad '%s\\x%02x' "$opad" $((c ^ 0x5c))
    done
    inner=$({ printf "$ipad"; printf '%s' "$msg"; } | sha256sum) || return 1
    inner=${inner%% *}
    outer=$({ printf "$opad"; printf "$(printf '%s' "$inner" | sed 's/../\\x&/g')"; } | sha256sum) || return 1
    printf '%s\n' "${outer%% *}"
}

# SECRET = this job's secret, derived from the site secret.
SECRET=
site_secret() {
    local owner_mode key
    [[ -e $SITE_SECRET_FILE ]] || job_failed "a job on several nodes needs the site secret $SITE_SECRET_FILE (the same file on every node); there is none"
    owner_mode=$(stat -L -c '%u %a' -- "$SITE_SECRET_FILE") || job_failed "cannot stat $SITE_SECRET_FILE"
    [[ $owner_mode == "0 600" || $owner_mode == "0 400" ]] ||
        job_failed "site secret $SITE_SECRET_FILE must belong to root with mode 0600 or 0400 (it is: uid ${owner_mode% *}, mode ${owner_mode#* })"
    IFS= read -r key <"$SITE_SECRET_FILE" || [[ -n $key ]] || job_failed "cannot read $SITE_SECRET_FILE"
    key=${key%%[[:space:]]*}
    [[ $key =~ ^[0-9a-fA-F]{32,64}$ ]] || job_failed "site secret $SITE_SECRET_FILE must hold 32-64 hex digits (e.g. openssl rand -hex 32)"
    SECRET=$(hmac_sha256 "$key" "commd-slurm-job:$JOB_ID")
    [[ $SECRET =~ ^[0-9a-f]{64}$ ]] || job_failed "cannot derive the job secret (sha256sum failed)"
}

# Why the job user cannot enter the directory $1: the first directory on its path it cannot enter
# (through a symlink: the first one on the link's real path), or one that does not exist.  Prints
# nothing when it can.
dir_problem() {
    local dir= rest=${1#/} part real problem
    while [[ -n $rest ]]; do
        part=${rest%%/*}
        if [[ $rest == */* ]]; then rest=${rest#*/}; else rest=; fi
        [[ -n $part ]] || continue
        dir=$dir/$part
        [[ -e $dir ]] || { printf '%s does not exist' "$dir"; return; }
        [[ -d $dir ]] || { printf '%s is not a directory' "$dir"; return; }
        as_user test -x "$dir" 2>/dev/null && continue
        if [[ -L $dir ]] && real=$(readlink -f -- "$dir") && problem=$(dir_problem "$real") && [[ -n $problem ]]; then
            printf '%s' "$problem"
            return
        fi
        printf 'user %s cannot enter the directory %s (owner %s, mode %s)' "$JOB_USER" "$dir" \
            "$(stat -L -c %U -- "$dir")" "$(stat -L -c %a -- "$dir")"
        return
    done
}

# Why the job user cannot execute the file $1: a directory above it (see dir_problem), the file
# missing, or the file (a symlink's target) not executable for it.  Prints nothing when it can.
exec_problem() {
    local target=$1 problem real
    problem=$(dir_problem "$(dirname -- "$target")")
    [[ -z $problem ]] || { printf '%s' "$problem"; return; }
    if [[ ! -e $target ]]; then
        printf '%s does not exist' "$target"
    elif ! as_user test -f "$target" -a -x "$target" 2>/dev/null; then
        if [[ -L $target ]] && real=$(readlink -f -- "$target") && problem=$(exec_problem "$real") &&
            [[ -n $problem ]]; then
            printf '%s' "$problem"
            return
        fi
        printf 'user %s may not execute it (owner %s, mode %s)' "$JOB_USER" \
            "$(stat -L -c %U -- "$target")" "$(stat -L -c %a -- "$target")"
    fi
}

# The interpreter a script's first line names (#!/abs/path; pip's form for long paths: #!/bin/sh,
# then '''exec' /abs/path/python), read as the job user.  Nothing for a binary or an `env` lookup.
script_interpreter() {
    local first= second=
    { IFS= read -r first; IFS= read -r second; } < <(as_user head -c 4096 -- "$1" 2>/dev/null)
    [[ $first =~ ^\#![[:space:]]*(/[^[:space:]]+) ]] || return 0
    first=${BASH_REMATCH[1]}
    if [[ $first == */sh && $second =~ ^\'\'\'exec\'[[:space:]]+\"?(/[^\"[:space:]]+) ]]; then
        first=${BASH_REMATCH[1]}
    fi
    [[ $first == */env ]] || printf '%s' "$first"
}

EXEC_NEEDS="the job user needs execute permission on COMMD_BIN, on the interpreter it runs and on every directory above them"

# The job user must be able to execute COMMD_BIN and the interpreter its first line names, and enter
# every directory above both: say which one it cannot, in the log and to the job.
check_commd_bin() {
    local bin=$1 problem interp
    problem=$(exec_problem "$bin")
    [[ -z $problem ]] ||
        job_failed "COMMD_BIN=$bin is not an executable file for user $JOB_USER: $problem; $EXEC_NEEDS"
    interp=$(script_interpreter "$bin")
    [[ -n $interp ]] || return 0
    problem=$(exec_problem "$interp")
    [[ -z $problem ]] ||
        job_failed "the interpreter $interp that COMMD_BIN=$bin names is not an executable file for user $JOB_USER: $problem; $EXEC_NEEDS"
}

daemon_running() {
    local pid
    pid=$(as_user cat "$JOBDIR/daemon.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && as_user kill -0 "$pid" 2>/dev/null
}

prolog() {
    local node=$NODE nodelist bin plan rc line key value nnodes= rank= rendezvous= deadline
    job_identity
    bin=$COMMD_BIN
    nodelist=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}

    # The job directory first, so every later failure reaches the job's processes.
    if ! as_user mkdir -p -m 0700 -- "$RUNTIME_DIR" || ! as_user mkdir -p -m 0700 -- "$JOBDIR"; then
        local where=$JOBDIR
        JOBDIR=
        job_failed "cannot create the runtime directory $where as user $JOB_USER"
    fi
    as_user rm -f -- "$JOBDIR/start.error" "$JOBDIR/starting"
    [[ -z $CONF_PROBLEM ]] || job_failed "$CONF_PROBLEM"
    if daemon_running; then
        log "the daemon of job $JOB already runs"
        exit 0
    fi

    [[ -n $bin ]] || job_failed "COMMD_BIN is not set in $CONF: it must name the job environment's commd"
    [[ $bin == /* ]] || job_failed "COMMD_BIN='$bin' in $CONF must be an absolute path"
    check_commd_bin "$bin"
    [[ -n $nodelist ]] || job_failed "SLURM_JOB_NODELIST is empty"

    plan=$(as_user timeout "$PLAN_TIMEOUT" "$bin" slurm-plan --nodelist "$nodelist" --node "$node" \
        --job-id "$JOB_ID" --port-base "$PORT_BASE" --port-span "$PORT_SPAN" 2>&1)
    rc=$?
    # 126/127: a program COMMD_BIN runs (a wrapper's interpreter) could not be executed or found.
    ((rc != 126 && rc != 127)) ||
        job_failed "user $JOB_USER cannot run COMMD_BIN=$bin (exit $rc): ${plan:-no output}; $EXEC_NEEDS"
    ((rc == 0)) || job_failed "cannot plan the daemon (exit $rc): ${plan:-no output}"
    while IFS= read -r line; do
        key=${line%%=*} value=${line#*=}
        case $key in
            NNODES) [[ $value =~ ^[1-9][0-9]{0,4}$ ]] && nnodes=$value ;;
            NODE_RANK) [[ $value =~ ^[0-9]{1,5}$ ]] && rank=$value ;;
            RENDEZVOUS) [[ $value =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}:[0-9]{1,5}$ ]] && rendezvous=$value ;;
        esac
    done <<<"$plan"
    [[ -n $nnodes && -n $rank ]] || job_failed "commd slurm-plan gave no node count and rank: $plan"

    local args=(daemon --job "$JOB" --node-name "$node")
    unset COMMD_SECRET
    if ((nnodes > 1)); then
        [[ -n $rendezvous ]] || job_failed "commd slurm-plan gave no rendezvous address: $plan"
        site_secret
        export COMMD_SECRET=$SECRET
        args+=(--nnodes "$nnodes" --node-rank "$rank" --rendezvous "$rendezvous"
            --rendezvous-timeout "$RENDEZVOUS_TIMEOUT")
    fi

    # The daemon's environment: this one (slurmd's, minimal) plus what commd needs.
    export COMMD_RUNTIME_DIR=$RUNTIME_DIR HOME=$JOB_HOME USER=$JOB_USER LOGNAME=$JOB_USER
    unset NOTIFY_SOCKET
    # Detached (own session) supervisor: records its pid in `starting` (clients wait while it
    # lives), runs the daemon, and leaves the reason in start.error if the daemon fails.
    # shellcheck disable=SC2016
    as_user setsid -f sh -c '
        dir=$1; shift
        echo $$ >"$dir/starting.tmp" && mv -f "$dir/starting.tmp" "$dir/starting"
        "$@" </dev/null >>"$dir/daemon.log" 2>&1
        rc=$?
        if [ "$rc" -ne 0 ]; then
            reason=$(grep "^commd daemon: " "$dir/daemon.log" | tail -n 1)
            if [ -n "$reason" ]; then
                echo "the daemon exited with code $rc: ${reason#commd daemon: } (log: $dir/daemon.log)"
            else
                echo "the daemon exited with code $rc; last lines of $dir/daemon.log:"; tail -n 5 "$dir/daemon.log"
            fi >"$dir/start.error.tmp"
            mv -f "$dir/start.error.tmp" "$dir/start.error"
        fi
        rm -f "$dir/starting"' sh "$JOBDIR" "$bin" "${args[@]}" </dev/null >/dev/null 2>&1 ||
        job_failed "cannot start the daemon as user $JOB_USER"
    unset COMMD_SECRET
    # Wait only for the local supervisor to record itself (it is a shell: milliseconds).
    deadline=$((SECONDS + 10))
    until as_user test -e "$JOBDIR/starting" -o -e "$JOBDIR/start.error"; do
        ((SECONDS < deadline)) || job_failed "the daemon's supervisor did not start within 10s"
        sleep 0.05
    done
    log "started the daemon of job $JOB as $JOB_USER (node $node, rank $rank of $nnodes${rendezvous:+, rendezvous $rendezvous})"
    exit 0
}

# The process group of the start's supervisor (daemon included), else the daemon's pid file.
epilog() {
    local sup pid target deadline
    [[ -z $CONF_PROBLEM ]] || log "$CONF_PROBLEM (cleaning up with the settings read so far)"
    job_identity
    sup=$(as_user cat "$JOBDIR/starting" 2>/dev/null)
    pid=$(as_user cat "$JOBDIR/daemon.pid" 2>/dev/null)
    target=
    # Signals are sent as the job user: a stale pid can never hit anyone else's process.
    if [[ $sup =~ ^[0-9]+$ ]] && as_user kill -0 -- "-$sup" 2>/dev/null; then
        target=-$sup
    elif [[ $pid =~ ^[0-9]+$ ]] && as_user kill -0 "$pid" 2>/dev/null &&
        tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "daemon --job $JOB "; then
        target=$pid
    fi
    if [[ -n $target ]]; then
        as_user kill -TERM -- "$target" 2>/dev/null
        deadline=$((SECONDS + STOP_TIMEOUT))
        while as_user kill -0 -- "$target" 2>/dev/null; do
            if ((SECONDS >= deadline)); then
                log "the daemon of job $JOB did not stop within ${STOP_TIMEOUT}s after SIGTERM; killing it"
                as_user kill -KILL -- "$target" 2>/dev/null
                break
            fi
            sleep 0.1
        done
        log "stopped the daemon of job $JOB"
    fi
    if [[ -d $JOBDIR ]]; then
        as_user rm -rf -- "$JOBDIR" || log "cannot remove $JOBDIR"
    fi
    as_user rmdir -- "$RUNTIME_DIR" 2>/dev/null
    as_user find /dev/shm -maxdepth 1 -name "commd-$JOB-*" -user "$JOB_UID" -delete 2>/dev/null
    exit 0
}

case $ACTION in
    prolog) read_conf; prolog ;;
    epilog) read_conf; epilog ;;
    *) echo "usage: $0 prolog|epilog" >&2; exit 0 ;;
esac
