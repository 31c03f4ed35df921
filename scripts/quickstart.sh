#!/usr/bin/env bash
# Set up a light environment (scripts/setup.sh --minimal: torch and scikit-learn, no TensorFlow
# or test tools) and train a small PyTorch model on a local byteps_like cluster (scheduler,
# 1 server, 2 workers on this machine). Extra arguments go to the training script.
# SETUP_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --minimal
train=(.venv/bin/bpslaunch --local --workers 2 --servers 1 --
       .venv/bin/python examples/pytorch/train_digits.py "$@")
if [ "${SETUP_DRY_RUN:-0}" = 1 ]; then
  echo "+ ${train[*]}"
  exit 0
fi
exec "${train[@]}"
