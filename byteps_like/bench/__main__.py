"""``python -m byteps_like.bench <benchmark> [options]``: the benchmarks of byteps_like.

Subcommands:
  pushpull   push_pull bandwidth of a local job against raw pyzmq and gloo all_reduce
  sum        the summation kernels (_core.add_into) against numpy
  cluster    emulated cluster (network namespaces, capped NICs) vs gloo, Horovod, theory (root)
  gil        push_pull while the main thread runs Python (GIL contention), and the loop's rate
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _pushpull(argv: Sequence[str]) -> int:
    from .pushpull import main
    return main(argv)


def _sum(argv: Sequence[str]) -> int:
    from .summation import main
    return main(argv)


def _cluster(argv: Sequence[str]) -> int:
    from .cluster import main
    return main(argv)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "pushpull": (_pushpull, "push_pull bandwidth of a local job vs raw pyzmq and gloo"),
    "sum": (_sum, "summation kernels (_core.add_into) vs numpy"),
    "cluster": (_cluster, "emulated cluster in network namespaces vs gloo/Horovod (root)"),
    "local": (lambda argv: __import__("byteps_like.bench.local", fromlist=["main"]).main(argv),
              "local reduction on one machine (L ranks) vs one process, vs memcpy; GPU copies"),
    "compress": (lambda argv: __import__("byteps_like.bench.compress", fromlist=["main"]).main(argv),
                 "gradient compressors: encode/decode GB/s and payload ratio vs memcpy"),
    "gil": (lambda argv: __import__("byteps_like.bench.gil", fromlist=["main"]).main(argv),
            "push_pull with a busy Python main thread (GIL contention) vs alone"),
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
