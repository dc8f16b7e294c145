"""Fitting a deep model's program from shallow traces (builder/program/stamp.py): a list that grows by
one block per layer is extended, anything else refused; and how the trace tasks are shared
among workers. (The fitted program against a full-depth trace: e2e/test_deep_program_build.py.)"""

from __future__ import annotations

import pytest

from titan.builder.program.stamp import STAMP_CHECK_DEPTH, STAMP_DEPTHS, NotStampable, fit


def _samples(*lists):
    return [({"n": n}, x) for n, x in zip(STAMP_DEPTHS, lists)]


def test_fit_extends_a_list_that_grows_by_one_block_per_layer():
    # A prefix, two elements per layer (names and references shift with the layer), a suffix
    # that refers back to the last layer.
    def doc(n):
        layers = [x for i in range(n) for x in ({"name": f"mm_{i}", "arg": {"$n": 1 + 2 * i}},
                                                {"name": f"add_{i}", "arg": {"$n": 2 + 2 * i}})]
        return [{"name": "embed", "arg": 0}, *layers, {"name": "norm", "arg": {"$n": 2 * n}}]

    fitted = fit(_samples(*(doc(n) for n in STAMP_DEPTHS)), "doc")
    assert fitted.at({"n": 9}) == doc(9)
    assert fitted.at({"n": STAMP_CHECK_DEPTH}) == doc(STAMP_CHECK_DEPTH)


@pytest.mark.parametrize("values", [[1, 2, 4], [0.5, 0.25, 0.125], ["a", "b", "c"], [[1], [1, 2], [1, 2, 3, 4]]],
                         ids=["not-affine", "floats", "text", "uneven-growth"])
def test_fit_refuses_values_that_are_not_one_repeated_block(values):
    with pytest.raises(NotStampable):
        fit(_samples(*values), "value")


def _planned_loads(tasks, jobs: int) -> list[int]:
    """Each worker's layers when the pool runs `tasks` in order, each on the first free worker."""
    loads = [0] * jobs
    for _, depths in tasks:
        loads[loads.index(min(loads))] += sum(depths)
    return loads


@pytest.mark.parametrize("todo", [{0: (3, 4, 5, 6), 1: (3, 4, 5), 3: (3, 4, 5)},  # 8B --tp 4
                                  {0: (3, 4, 5, 6), 1: (3, 4, 5), 8: (3, 4, 5), 1023: (3, 4, 5)},  # 405B
                                  {0: (6, 7, 8, 9), 1: (6, 7, 8), 2: (6, 7, 8), 3: (6, 7, 8), 4: (6, 7, 8)}],
                         ids=["8B", "405B", "671B"])
def test_trace_tasks_keep_both_workers_busy_in_few_processes(todo):
    from titan.builder.trace.pool import trace_tasks

    tasks = trace_tasks(todo, jobs=2)
    # Every depth of every rank once; a task is one rank's depths, shortest first.
    assert sorted((r, d) for r, depths in tasks for d in depths) == sorted(
        (r, d) for r, depths in todo.items() for d in depths)
    assert all(list(depths) == sorted(depths) for _, depths in tasks)
    # The workers finish together (within the shortest depth), in one process per rank or so.
    loads = _planned_loads(tasks, jobs=2)
    assert max(loads) - min(loads) <= min(d for depths in todo.values() for d in depths)
    assert len(tasks) <= len(todo) + 1 < sum(len(depths) for depths in todo.values())


def test_trace_tasks_keep_a_rank_whole_when_workers_suffice():
    from titan.builder.trace.pool import trace_tasks

    todo = {0: (3, 4, 5, 6), 1: (3, 4, 5), 3: (3, 4, 5)}
    assert trace_tasks(todo, jobs=4) == [(0, (3, 4, 5, 6)), (1, (3, 4, 5)), (3, (3, 4, 5))]
    assert trace_tasks(todo, jobs=1) == [(0, (3, 4, 5, 6)), (1, (3, 4, 5)), (3, (3, 4, 5))]
    assert trace_tasks({0: (None,), 1: (None,), 3: (None,)}, jobs=2) == [(0, (None,)), (1, (None,)), (3, (None,))]
    assert trace_tasks({2: (None,)}, jobs=1) == [(2, (None,))]


@pytest.mark.parametrize("mesh, checking", [
    ({"tp": 8, "ep": 64, "dp_shard": 4}, "the far corner"),  # DeepSeek-V3 671B's probes: 0, 1, 8, 512, 2047
    ({"tp": 4}, "the far corner"),                           # 0, 1 and 3: 3 checks that coordinate 1 scales
    ({"tp": 2, "dp_shard": 2}, "the far corner"),
    ({"tp": 2}, None),                                       # the corner is the unit probe: nothing only checks
])
def test_only_the_far_corner_is_traced_at_one_depth(mesh, checking):
    """The probes whose traces only check the bindings (builder/program/deep.py): rank 0 and the
    unit probes give every binding and are traced at every shallow depth."""
    from titan.builder.program.bind import probe_ranks
    from titan.builder.program.deep import _checking_probes
    from titan.runtime.contract.layout import Layout

    layout = Layout(**mesh)
    probes = probe_ranks(layout)
    found = _checking_probes(layout, probes)
    if checking is None:
        assert found == set()
    else:
        assert found == {layout.world_size - 1}
        assert 0 in probes and all(sum(layout.coordinates(r).values()) == 1 for r in set(probes) - found - {0})
