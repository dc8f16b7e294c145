"""The titan-* commands.

Every command imports this package first (a console script and `python -m titan.cli.X` alike),
before click, numpy or torch: that is where Ctrl-C handling is installed, so that a Ctrl-C at
any instant of any command, imports included, ends it with one `interrupted` line and status 130
(runtime/common/interrupt.py says how). It is also where the compilers' caches are pointed into
the user's private directory, before anything can read them (runtime/common/compiler_caches.py).
A titan-run rank or a build worker (RANK set, or a multiprocessing child) ends quietly: its
launcher reports, and it dies with its launcher even when that is killed
(runtime/common/parent_death.py).
"""

import os as _os

# Ctrl-C handling first: a signal that lands while the rest of this package imports is then
# titan's one `interrupted` line, not a KeyboardInterrupt traceback.
from titan.runtime.common import interrupt as _interrupt  # noqa: E402

_interrupt.install(quiet="RANK" in _os.environ)

from titan.runtime.common import compiler_caches as _compiler_caches  # noqa: E402
from titan.runtime.common import parent_death as _parent_death  # noqa: E402

_parent_death.from_environment()
# Before torch is imported: the caches of the compilers titan drives are private to the user
# (runtime/common/compiler_caches.py says why; the commands that compile report a problem in one line).
_compiler_caches.install()
