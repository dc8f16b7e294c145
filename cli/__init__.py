"""The titan-* commands.

Every command imports this package first (a console script and `python -m titan.cli.X` alike),
before click, numpy or torch: that is where Ctrl-C handling is installed, so that a Ctrl-C at
any instant of any command, imports included, ends it with one `interrupted` line and status 130
(runtime/interrupt.py says how). A titan-run rank or a build worker (RANK set, or a
multiprocessing child) ends quietly: its launcher reports, and it dies with its launcher even
when that is killed (runtime/parent_death.py).
"""

import os as _os

from titan.runtime import interrupt as _interrupt
from titan.runtime import parent_death as _parent_death

_parent_death.from_environment()
_interrupt.install(quiet="RANK" in _os.environ)
