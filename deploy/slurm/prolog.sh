#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/path/to/prolog.sh): start the job user's commd daemon.
# The work is done by commd-slurm.sh next to this file (the real path, symlinks resolved).
here=$(/usr/bin/dirname "$(/usr/bin/readlink -f "$0")")
exec /bin/bash "$here/commd-slurm.sh" prolog
