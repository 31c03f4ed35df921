"""``python -m byteps_like.bench <benchmark> [options]``: the benchmarks of byteps_like.

Subcommands:
  pushpull   push_pull bandwidth of a local job against raw pyzmq and gloo all_reduce
  sum        the summation kernels (_core.add_into) against numpy
  cluster    emulated cluster (network namespaces, capped NICs) vs gloo, Horovod, theory (root)
  local      the local reduction of one machine's L ranks vs one process, vs memcpy; GPU copies
  compress   the gradient compressors' encode/decode rate and payload ratio vs memcpy
  gil        push_pull while the main thread runs Python (GIL contention), and the loop's rate
  train      real models on synthetic data: byteps_like vs no communication vs DDP (Horovod)
  sparse     a DLRM-shaped model: server-held embedding tables vs the same tables pushed dense
  failover   a server lost while a real model trains: stall, steps lost, step time after

Their processes run on bpslaunch's plan and supervisor (:mod:`.harness`); what they print is
:mod:`.report`'s.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence


def _run(module: str) -> Callable[[Sequence[str]], int]:
    """The ``main`` of ``byteps_like.bench.<module>``, imported only when it runs."""
    def run(argv: Sequence[str]) -> int:
        main: Callable[[Sequence[str]], int] = importlib.import_module(
            f"byteps_like.bench.{module}").main
        return main(argv)
    return run


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "pushpull": (_run("pushpull"), "push_pull bandwidth of a local job vs raw pyzmq and gloo"),
    "sum": (_run("summation"), "summation kernels (_core.add_into) vs numpy"),
    "cluster": (_run("cluster"), "emulated cluster in network namespaces vs gloo/Horovod (root)"),
    "local": (_run("local"),
              "local reduction on one machine (L ranks) vs one process, vs memcpy; GPU copies"),
    "compress": (_run("compress"),
                 "gradient compressors: encode/decode GB/s and payload ratio vs memcpy"),
    "gil": (_run("gil"), "push_pull with a busy Python main thread (GIL contention) vs alone"),
    "train": (_run("train"),
              "real models on synthetic data: byteps_like vs local (no communication) vs DDP"),
    "sparse": (_run("sparse"),
               "DLRM-shaped model: server-held embedding tables vs the same tables dense"),
    "failover": (_run("failover"),
                 "a server lost while a real model trains: stall, steps lost, step time after"),
}


def usage() -> str:
    lines = ["usage: python -m byteps_like.bench {" + ",".join(COMMANDS) + "} [options]", "",
             "benchmarks:"]
    lines += [f"  {name:<10} {text}" for name, (_fn, text) in COMMANDS.items()]
    lines += ["", "`python -m byteps_like.bench <benchmark> --help` describes its options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        print(f"python -m byteps_like.bench: unknown benchmark {argv[0]!r}\n\n{usage()}",
              file=sys.stderr)
        return 2
    return cmd[0](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
