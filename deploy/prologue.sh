#!/usr/bin/env bash
# Job prologue: start the commd node daemon for $COMMD_JOB and wait until it answers.
#
# Workers started afterwards with COMMD_JOB set (by torchrun, srun, mpirun or
# `commd launch --job $COMMD_JOB`) find this daemon and use it.  Run this as the
# job's user and with the COMMD_RUNTIME_DIR (if any) the workers will have: the
# daemon keeps the job secret in a runtime directory only that user can read.
#
# Settings (environment):
#   COMMD_JOB               job name, required: 1-64 characters of [A-Za-z0-9_.-]
#   COMMD_BIN               the commd command (default: `commd` on PATH)
#   COMMD_PROLOGUE_TIMEOUT  seconds to wait for the daemon to answer (default 60)
#   COMMD_PROLOGUE_MODE     auto (default): the systemd user unit commd@$COMMD_JOB if it
#                           is installed, else a detached process; or systemd / detach.
#                           The unit's runtime root is $XDG_RUNTIME_DIR/commd-$COMMD_JOB:
#                           workers then need that COMMD_RUNTIME_DIR (printed at the end).
#   COMMD_RUNTIME_DIR, COMMD_OP_TIMEOUT, COMMD_LOG_LEVEL, COMMD_NODE, COMMD_CONFIG
#                           passed on to a detached daemon (a systemd unit reads its
#                           own, see deploy/commd@.service)
#   COMMD_NNODES, COMMD_NODE_RANK, COMMD_RENDEZVOUS=HOST:PORT, COMMD_SECRET or COMMD_SECRET_FILE
#                           a job on several nodes: run this prologue on every node with
#                           its node rank; node 0's daemon hosts the rendezvous store at
#                           HOST:PORT (node 0's address).  Give every node the same secret:
#                           COMMD_SECRET (e.g. from the scheduler's job credential) or
#                           COMMD_SECRET_FILE, a file of yours with mode 0600 (required: the
#                           store is readable by anyone who reaches it, so commd never
#                           publishes a secret there).  The daemon answers
#                           only once every node has joined, so raise COMMD_PROLOGUE_TIMEOUT
#                           to cover the slowest node's start.  (Under MPI instead:
#                           `mpiexec -n K -ppn 1 commd daemon --job $COMMD_JOB`.)
#
# Exit status: 0 once the daemon answers (also when it was already running),
# 1 if it does not start or answer in time, 2 for bad settings.
# Stop the daemon in the epilogue: deploy/epilogue.sh.
set -euo pipefail

die() { echo "commd prologue: $1" >&2; exit "${2:-1}"; }

job=${COMMD_JOB:-}
[[ -n $job ]] || die "COMMD_JOB is not set: it must name the job" 2
[[ $job =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || die "COMMD_JOB='$job' is not a valid job name (1-64 of A-Z a-z 0-9 _ . -)" 2
bin=${COMMD_BIN:-commd}
command -v "$bin" >/dev/null 2>&1 || die "cannot find the commd command '$bin' (set COMMD_BIN)" 2
timeout=${COMMD_PROLOGUE_TIMEOUT:-60}
[[ $timeout =~ ^[0-9]+$ && $timeout -gt 0 ]] || die "COMMD_PROLOGUE_TIMEOUT='$timeout' must be a positive integer" 2
mode=${COMMD_PROLOGUE_MODE:-auto}

# The job directory as commd computes it (commd/runtime.py: runtime_root).
if [[ -n ${COMMD_RUNTIME_DIR:-} ]]; then
    root=$COMMD_RUNTIME_DIR
elif [[ -n ${XDG_RUNTIME_DIR:-} && -d $XDG_RUNTIME_DIR ]]; then
    root=$XDG_RUNTIME_DIR/commd
else
    root=${TMPDIR:-/tmp}/commd-$(id -u)
fi
jobdir=$root/$job

answers() {
    # `commd status` needs the secret and a reply: proof that workers can use the daemon.
    "$bin" status --job "$job" --json --timeout 2 >/dev/null 2>&1
}

if answers; then
    echo "commd prologue: the daemon of job $job is already running"
    exit 0
fi

case $mode in
    auto)
        if command -v systemctl >/dev/null 2>&1 && systemctl --user cat commd@.service >/dev/null 2>&1; then
            mode=systemd
        else
            mode=detach
        fi ;;
    systemd | detach) ;;
    *) die "COMMD_PROLOGUE_MODE='$mode' must be auto, systemd or detach" 2 ;;
esac

pid=
if [[ $mode == systemd ]]; then
    # The unit's runtime root is its RuntimeDirectory, %t/commd-<job> (deploy/commd@.service).
    [[ -n ${XDG_RUNTIME_DIR:-} ]] || die "COMMD_PROLOGUE_MODE=systemd needs XDG_RUNTIME_DIR (the user manager's %t)" 2
    export COMMD_RUNTIME_DIR=$XDG_RUNTIME_DIR/commd-$job
    jobdir=$COMMD_RUNTIME_DIR/$job
    systemctl --user start "commd@$job.service" || die "systemctl --user start commd@$job failed"
else
    (umask 077 && mkdir -p "$jobdir") || die "cannot create $jobdir"
    # Own session: the daemon outlives this script and the shell that ran it.
    setsid "$bin" daemon --job "$job" </dev/null >>"$jobdir/daemon.out" 2>&1 &
    pid=$!
fi

deadline=$((SECONDS + timeout))
while ! answers; do
    if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then
        wait "$pid" && code=0 || code=$?
        echo "commd prologue: the daemon exited with code $code while starting; last lines of $jobdir/daemon.out:" >&2
        tail -n 20 "$jobdir/daemon.out" >&2 || true
        exit 1
    fi
    if [[ $mode == systemd ]] && systemctl --user is-failed --quiet "commd@$job.service"; then
        systemctl --user status --no-pager --lines 20 "commd@$job.service" >&2 || true
        die "commd@$job.service failed to start"
    fi
    if ((SECONDS >= deadline)); then
        if [[ -n $pid ]]; then
            kill -TERM "$pid" 2>/dev/null || true
        else
            systemctl --user stop "commd@$job.service" || true
        fi
        die "the daemon of job $job did not answer within ${timeout}s (logs: $jobdir)"
    fi
    sleep 0.2
done
echo "commd prologue: the daemon of job $job answers (${mode}${pid:+, pid $pid})"
if [[ $mode == systemd ]]; then
    echo "commd prologue: workers need COMMD_JOB=$job COMMD_RUNTIME_DIR=$COMMD_RUNTIME_DIR"
fi
