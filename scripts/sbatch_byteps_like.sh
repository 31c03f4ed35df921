#!/usr/bin/env bash
# Run a byteps_like job on a SLURM allocation, one bpslaunch task per node (docs/deployment.md).
#
#   sbatch --nodes=4 scripts/sbatch_byteps_like.sh python train.py --epochs 10
#
# The first node runs the scheduler; by default every node is a worker machine with one server
# colocated. BPSL_SLURM_ARGS passes options to `bpslaunch slurm` (--servers K, --server-nodes M,
# --local-size L, --port P, --timeout S), BPSL_PYTHON the interpreter with byteps_like installed
# (default python3). Every BYTEPS_* setting of the submitting shell travels with the job
# (sbatch exports the environment by default). Authentication is on: unless BYTEPS_AUTH_SECRET or
# BYTEPS_AUTH_SECRET_FILE is set, a one-time secret is generated here and reaches every task
# (BPSL_SLURM_ARGS=--no-auth runs without one).
#SBATCH --job-name=byteps_like
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=byteps_like-%j.out
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: sbatch $0 COMMAND [ARG ...]" >&2; exit 2; }
PYTHON=${BPSL_PYTHON:-python3}
if [[ -z "${BYTEPS_AUTH_SECRET:-}${BYTEPS_AUTH_SECRET_FILE:-}" && " ${BPSL_SLURM_ARGS:-} " != *" --no-auth "* ]]; then
    BYTEPS_AUTH_SECRET=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
    export BYTEPS_AUTH_SECRET  # this job's tasks only (srun passes the environment on)
fi
# shellcheck disable=SC2086  # BPSL_SLURM_ARGS is a list of options
exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    "$PYTHON" -m byteps_like.launcher slurm ${BPSL_SLURM_ARGS:-} -- "$@"
