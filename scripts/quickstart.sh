#!/usr/bin/env bash
# Set up the environment and train a small model on a local byteps_like cluster
# (scheduler, 2 servers, 2 workers on this machine). Extra arguments go to the training script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/bpslaunch --local --workers 2 --servers 2 -- \
  .venv/bin/python examples/numpy/train_digits.py "$@"
