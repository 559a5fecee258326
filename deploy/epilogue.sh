#!/usr/bin/env bash
# Job epilogue: stop the commd node daemon that deploy/prologue.sh started for $COMMD_JOB.
#
# SIGTERM lets the daemon fail what is still in flight with a clear error and
# remove its socket and secret; after COMMD_EPILOGUE_TIMEOUT seconds (default
# 30) it is killed.  Exits 0 when no daemon runs for the job (any more).
set -euo pipefail

die() { echo "commd epilogue: $1" >&2; exit "${2:-1}"; }

job=${COMMD_JOB:-}
[[ $job =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || die "COMMD_JOB='$job' is not a valid job name" 2
timeout=${COMMD_EPILOGUE_TIMEOUT:-30}
[[ $timeout =~ ^[0-9]+$ ]] || die "COMMD_EPILOGUE_TIMEOUT='$timeout' must be an integer" 2

if command -v systemctl >/dev/null 2>&1 && systemctl --user is-active --quiet "commd@$job.service" 2>/dev/null; then
    exec systemctl --user stop "commd@$job.service"
fi

if [[ -n ${COMMD_RUNTIME_DIR:-} ]]; then
    root=$COMMD_RUNTIME_DIR
elif [[ -n ${XDG_RUNTIME_DIR:-} && -d $XDG_RUNTIME_DIR ]]; then
    root=$XDG_RUNTIME_DIR/commd
else
    root=${TMPDIR:-/tmp}/commd-$(id -u)
fi
pidfile=$root/$job/daemon.pid
pid=$(cat "$pidfile" 2>/dev/null || true)
if [[ ! $pid =~ ^[0-9]+$ ]] || ! kill -0 "$pid" 2>/dev/null; then
    echo "commd epilogue: no daemon runs for job $job"
    exit 0
fi
# Only signal the pid if it really is this job's commd daemon (pid files can go stale).
if ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "daemon --job $job "; then
    echo "commd epilogue: pid $pid in $pidfile is not the commd daemon of job $job; leaving it alone"
    exit 0
fi
kill -TERM "$pid"
deadline=$((SECONDS + timeout))
while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
        echo "commd epilogue: daemon pid $pid did not stop within ${timeout}s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
        break
    fi
    sleep 0.2
done
echo "commd epilogue: the daemon of job $job stopped"
