"""One titan rank under cProfile, from process start to its exit: where start-up time goes.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
        python benchmarks/profile_startup.py OUT.prof ARTIFACT [titan-run flags]

A rank ends with os._exit (runtime/distributed.py: exit_rank), which cProfile's own command line
never sees; this wraps the rank so that the profile is written first.
"""

from __future__ import annotations

import cProfile
import runpy
import sys

import titan.runtime.distributed as distributed


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    profile = cProfile.Profile()
    exit_rank = distributed.exit_rank

    def write_then_exit(code: int) -> None:
        profile.disable()
        profile.dump_stats(out)
        # What the start should not need (issue 30: sympy came through a meta kernel, 3.7 s).
        found = {m: m in sys.modules for m in ("sympy", "torch._inductor", "torch._dynamo")}
        print("profile_startup: imported " + ", ".join(f"{m} {'yes' if v else 'no'}" for m, v in found.items()),
              file=sys.stderr, flush=True)
        exit_rank(code)

    distributed.exit_rank = write_then_exit
    sys.argv = ["titan-run", *argv]
    profile.enable()
    try:
        runpy.run_module("titan.cli.run", run_name="__main__")
    except SystemExit as e:
        write_then_exit(e.code if isinstance(e.code, int) else 1)
    write_then_exit(0)


if __name__ == "__main__":
    main()
