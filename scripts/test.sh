#!/usr/bin/env bash
# Set up the environments and run the whole test suite: the static checks (scripts/lint.sh: ruff
# and mypy), the main suite in .venv (its quick tier, then the multi-process tests, each on two
# pytest processes; extra arguments go to both pytest runs), then the MXNet suite in
# .venv-mxnet (MXNet 1.9.1 needs numpy < 1.24, so it has its own environment). All always run;
# the exit status is non-zero if any fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# .venv-mxnet before the main suite, whose MXNet cases outside tests/frameworks (the optimizer
# step counts of tests/integration/test_observability.py) run in it; its _core is its own
mxnet=0
bash scripts/setup_mxnet.sh || mxnet=$?
lint=0
bash scripts/lint.sh || lint=$?
main=0
# the in-process tests (the quick tier), then the multi-process ones (marked integration or
# slow), each on two pytest processes: together they are every test. The multi-process tier
# took 23 minutes one test after another on 2 cores, 16 on two processes (its tests wait for
# the events they check, so a second job beside each is only load, as CI's machines have)
tier() {  # a pytest run; "no test collected" (exit status 5: arguments that name only the
  # other tier's tests) is not a failure
  local rc=0
  .venv/bin/python -m pytest -q "$@" || rc=$?
  [ "$rc" -eq 5 ] && rc=0
  [ "$rc" -eq 0 ] || main=$rc
}
tier -n 2 -m "not integration and not slow" --durations=10 "$@"
tier -n 2 -m "integration or slow" --durations=30 "$@"
if [ "$mxnet" -eq 0 ]; then
  .venv-mxnet/bin/python -m pytest -q tests/frameworks || mxnet=$?
fi
if [ "$lint" -ne 0 ] || [ "$main" -ne 0 ] || [ "$mxnet" -ne 0 ]; then
  echo "test.sh: lint exit status $lint, main suite exit status $main," \
       "MXNet suite exit status $mxnet" >&2
  exit 1
fi
