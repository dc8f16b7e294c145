"""Imported once by the fork server that every trace process is forked from (builder/trace/pool.py):
torch, the tracer and the modules a trace would otherwise import lazily on its first graph
(inductor's lowerings and decompositions, which the partitioner reaches), so that no trace
process pays for them again. Imports only: no process group and no DTensor state is made here
(one fresh process per rank, builder/trace/rank_trace.py says why).
"""

from __future__ import annotations

import importlib
import os

import titan.runtime.common.parent_death as parent_death

# First, before the seconds of imports below: this server dies with titan-build (it started it
# with its pid in the environment), and each trace process it forks dies with this server. A
# killed build then leaves nothing: a worker, blocked for ever on a pipe whose reader is gone,
# would otherwise keep the server alive too (each worker holds the server's "alive" pipe).
parent_death.from_environment()
parent_death.forked_children_die_with_parent()

# Traces run on fake tensors and never need a GPU; hiding the host's GPUs here (and so from
# every trace process forked from here) keeps an import from initializing CUDA in this process,
# which forked children could then not use, and makes a build the same on any host.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The fork server is an entry point of its own: the compilers' caches are the user's private
# ones before torch is imported (runtime/common/compiler_caches.py; titan-build checked them already).
from titan.runtime.common import compiler_caches  # noqa: E402

compiler_caches.install()

import titan.builder.trace.rank_trace  # noqa: E402, F401

# Best effort: a torch without one of these only loses the head start.
_WARM = ("torch._inductor.lowering", "torch._inductor.decomposition", "torch._functorch.compilers",
         "torch._inductor.fx_passes.joint_graph")
for _name in _WARM:
    try:
        importlib.import_module(_name)
    except ImportError:
        pass
