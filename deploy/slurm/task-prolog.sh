#!/bin/bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/path/to/task-prolog.sh): runs as the job user before
# each task; its `export NAME=value` lines become the task's environment.  Points the job's
# processes at the daemon that prolog.sh started: its job name, runtime root and node name.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
conf=${COMMD_SLURM_CONF:-/etc/commd/slurm.conf}
runtime=/tmp/commd-%u
if [[ -r $conf ]]; then
    while IFS= read -r line || [[ -n $line ]]; do
        [[ $line =~ ^[[:space:]]*RUNTIME_DIR=[\"\']?([A-Za-z0-9_./%-]+)[\"\']?[[:space:]]*$ ]] && runtime=${BASH_REMATCH[1]}
    done <"$conf"
fi
node=${SLURMD_NODENAME:-$(hostname -s 2>/dev/null || uname -n)}
if [[ ${SLURM_JOB_ID:-} =~ ^[0-9]{1,12}$ ]]; then
    echo "export COMMD_JOB=slurm-$SLURM_JOB_ID"
    echo "export COMMD_RUNTIME_DIR=${runtime//%u/$(id -u)}"
    echo "export COMMD_NODE=${node%%.*}"
fi
