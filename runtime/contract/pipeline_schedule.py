"""A pipeline's schedule as data: which layers each stage holds, and each pipeline rank's ordered
actions for one training step (forward and backward of stage s on micro-batch m, and the
point-to-point sends and receives of activations and their gradients).

The builder computes it (builder/spec/pipeline_order.py); the runtime executes it
(runtime/pipeline_executor.py) without deciding anything. It is read from an untrusted artifact,
so `from_json` bounds every size before it iterates and `check` proves, by simulating every rank,
that the actions are complete, causally ordered and cannot deadlock when sends are posted
without waiting and a receive waits only for its own send. Torch-free: titan-show prints it.

An action is written as torch.distributed.pipelining writes its `_Action`s: `1F0` (stage 1,
forward, micro-batch 0), `0SEND_F3`, `2RECV_B1`. A zero-bubble schedule splits a backward in two:
`1I0`, the gradient of the stage's input (what the previous stage waits for), where the full
backward `B` would be, and later `1W0`, its parameters' gradients, filling what would be a bubble.

The format is the same for every schedule: a record written before zbv existed reads unchanged;
a record of a schedule a runtime does not know (e.g. zbv in an older one) is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from titan.runtime.contract.checks import check_int, check_str, fail

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
"""The schedules titan builds (builder/spec/pipeline_order.py), by their --pp-schedule names."""
SPLIT_BACKWARD = ("zbv",)
"""The schedules that run each backward as I (input gradient) then W (parameter gradients), not B."""
COMPUTE = ("F", "B", "I", "W")
SENDS = {"SEND_F": "RECV_F", "SEND_B": "RECV_B"}
"""Each send's matching receive: SEND_F(s, m) feeds RECV_F(s + 1, m); SEND_B(s, m) feeds RECV_B(s - 1, m)."""
KINDS = (*COMPUTE, *SENDS, *SENDS.values())
MAX_STAGES = 1024
MAX_MICROBATCHES = 4096
MAX_ACTIONS = 1 << 20
"""Actions over all ranks: 7 per stage and micro-batch at most (forward, I and W, four transfers);
bounded before a list is walked."""

_ACTION = re.compile(r"(\d{1,4})(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d{1,4})")


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    """The stage it runs (or sends / receives for)."""
    kind: str
    """F, B (full backward), I (input gradient), W (parameter gradients), SEND_F, RECV_F, SEND_B or RECV_B."""
    microbatch: int
    """The micro-batch."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text, where: str) -> Action:
        if not isinstance(text, str) or not (match := _ACTION.fullmatch(text)):
            fail(where, f"{str(text)[:40]!r} is not a pipeline action (e.g. 1F0, 1I0, 0SEND_F2)")
        stage, kind, microbatch = match.groups()
        return Action(int(stage), kind, int(microbatch))


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    schedule: str
    """gpipe, 1f1b, interleaved-1f1b (several stages per pp rank) or zbv (two per rank, in a V)."""
    microbatches: int
    """Micro-batches per step: the rank's batch is split into this many along dim 0."""
    stage_layers: tuple[tuple[int, int], ...]
    """Per stage, the [start, stop) of its transformer blocks; the first stage also holds the
    embedding, the last the final norm, the output projection and the loss."""
    stage_rank: tuple[int, ...]
    """Per stage, the pipeline coordinate (pp rank) that runs it: the schedule's placement
    (stage_ranks)."""
    actions: tuple[tuple[Action, ...], ...]
    """Per pipeline coordinate, its actions for one step, in the order they run."""

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def backward_kinds(self) -> tuple[str, ...]:
        """What runs a stage's backward of one micro-batch: B, or I then W (SPLIT_BACKWARD)."""
        return ("I", "W") if self.schedule in SPLIT_BACKWARD else ("B",)

    def local(self, stage: int, neighbour: int) -> bool:
        """Whether `neighbour` (stage +- 1) exists and runs on the same rank as `stage`: then what
        passes between them is handed over in memory, with no transfer (zbv's turn of the V)."""
        return 0 <= neighbour < self.n_stages and self.stage_rank[neighbour] == self.stage_rank[stage]

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "microbatches": self.microbatches,
                "stage_layers": [list(s) for s in self.stage_layers], "stage_rank": list(self.stage_rank),
                "actions": [[str(a) for a in rank] for rank in self.actions]}

    @staticmethod
    def from_json(d, where: str, *, n_layers: int, pp: int) -> PipelineSchedule:
        """Read and check a record for a model of `n_layers` blocks on `pp` pipeline coordinates."""
        if not isinstance(d, dict) or set(d) != {"schedule", "microbatches", "stage_layers", "stage_rank", "actions"}:
            fail(where, "a pipeline schedule needs exactly schedule, microbatches, stage_layers, stage_rank, actions")
        if check_str(d["schedule"], where, "schedule") not in SCHEDULES:
            fail(where, f"unknown schedule {d['schedule']!r} (known: {', '.join(SCHEDULES)})")
        microbatches = check_int(d["microbatches"], f"{where} microbatches", 1, MAX_MICROBATCHES)
        layers, ranks, actions = d["stage_layers"], d["stage_rank"], d["actions"]
        if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_STAGES:
            fail(where, f"stage_layers must list 1 to {MAX_STAGES} stages")
        if not isinstance(ranks, list) or len(ranks) != len(layers):
            fail(where, "stage_rank must give one pipeline rank per stage")
        if not isinstance(actions, list) or len(actions) != pp or not all(isinstance(a, list) for a in actions):
            fail(where, f"actions must hold one list per pipeline rank ({pp})")
        if sum(len(a) for a in actions) > MAX_ACTIONS:
            fail(where, f"more than {MAX_ACTIONS} actions")
        spans = []
        for s, span in enumerate(layers):
            if not isinstance(span, list) or len(span) != 2:
                fail(where, f"stage {s}'s layers must be [start, stop]")
            spans.append((check_int(span[0], f"{where} stage {s} start", 0, n_layers),
                          check_int(span[1], f"{where} stage {s} stop", 0, n_layers)))
        record = PipelineSchedule(
            schedule=d["schedule"], microbatches=microbatches, stage_layers=tuple(spans),
            stage_rank=tuple(check_int(r, f"{where} stage_rank", 0, pp - 1) for r in ranks),
            actions=tuple(tuple(Action.parse(a, f"{where} rank {r}") for a in rank) for r, rank in enumerate(actions)))
        record.check(where, n_layers=n_layers)
        return record

    def check(self, where: str, *, n_layers: int) -> None:
        """Fail unless the stages cover the layers in order and the actions are one complete,
        deadlock-free step (see the module docstring)."""
        stop = 0
        for s, (a, b) in enumerate(self.stage_layers):
            if a != stop or b <= a:
                fail(where, f"stage {s} holds layers [{a}, {b}); stages must hold consecutive, non-empty runs of layers")
            stop = b
        if stop != n_layers:
            fail(where, f"the stages hold {stop} layers, the model has {n_layers}")
        last = self.n_stages - 1
        pp = len(self.actions)
        if (placement := stage_ranks(self.schedule, stages=self.n_stages, pp=pp)) is None:
            fail(where, f"{self.schedule} cannot place {self.n_stages} stages on {pp} pp ranks")
        if self.stage_rank != placement:
            fail(where, f"stage_rank {list(self.stage_rank)[:16]} is not {self.schedule}'s placement of "
                        f"{self.n_stages} stages on {pp} pp ranks ({list(placement)[:16]})")
        # What a complete step needs is bounded as the record is, before any set of it is made.
        needed = self.microbatches * sum(len(self._kinds(s)) for s in range(self.n_stages))
        if needed > MAX_ACTIONS:
            fail(where, f"{self.n_stages} stages x {self.microbatches} micro-batches need {needed:,} actions, more than "
                        f"{MAX_ACTIONS:,}")
        for r, rank in enumerate(self.actions):
            seen: set[tuple[str, int, int]] = set()
            for a in rank:
                if a.stage > last or self.stage_rank[a.stage] != r:
                    fail(where, f"rank {r} runs {a}, a stage it does not hold")
                if a.kind not in self._kinds(a.stage):
                    fail(where, f"rank {r} runs {a}, which stage {a.stage} has no use for")
                if a.microbatch >= self.microbatches:
                    fail(where, f"{a}: micro-batch out of range (the step has {self.microbatches})")
                if (a.kind, a.stage, a.microbatch) in seen:
                    fail(where, f"rank {r} runs {a} twice")
                for need in self._requires(a):
                    if need not in seen:
                        fail(where, f"rank {r} runs {a} before {need[1]}{need[0]}{need[2]}")
                seen.add((a.kind, a.stage, a.microbatch))
            owned = [s for s in range(self.n_stages) if self.stage_rank[s] == r]
            expected = {(k, s, m) for s in owned for m in range(self.microbatches) for k in self._kinds(s)}
            if missing := sorted(expected - seen):
                kind, stage, mb = missing[0]
                fail(where, f"rank {r} never runs {stage}{kind}{mb}")
        self._check_deadlock_free(where)
        self._check_pairs_in_order(where)

    def _kinds(self, stage: int) -> tuple[str, ...]:
        """The actions a stage runs for each micro-batch: its forward, its backward (B, or I and W)
        and a transfer each way to each neighbour on another rank."""
        prev, nxt = stage - 1, stage + 1
        return ("F", *self.backward_kinds,
                *(("RECV_F", "SEND_B") if prev >= 0 and not self.local(stage, prev) else ()),
                *(("SEND_F", "RECV_B") if nxt < self.n_stages and not self.local(stage, nxt) else ()))

    def _requires(self, a: Action) -> tuple[tuple[str, int, int], ...]:
        """The actions of the same rank that must come before `a`. A neighbour on the same rank
        hands over in memory: its forward (or input gradient) must have run instead of a receive."""
        s, m, kind = a.stage, a.microbatch, a.kind
        backward = self.backward_kinds[0]  # B, or I: what yields the stage's input gradient
        if kind == "F":
            if s == 0:
                return ()
            return (("F", s - 1, m),) if self.local(s, s - 1) else (("RECV_F", s, m),)
        if kind in ("B", "I"):
            if s == self.n_stages - 1:
                return (("F", s, m),)
            return (("F", s, m), (backward, s + 1, m) if self.local(s, s + 1) else ("RECV_B", s, m))
        if kind == "W":
            return (("I", s, m),)
        if kind == "SEND_F" or kind == "RECV_B":
            return (("F", s, m),)
        if kind == "SEND_B":
            return ((backward, s, m),)
        return ()

    def peer(self, a: Action) -> int:
        """The pp rank a transfer goes to or comes from."""
        step = 1 if a.kind in ("SEND_F", "RECV_B") else -1
        return self.stage_rank[a.stage + step]

    def _check_pairs_in_order(self, where: str) -> None:
        """Between two ranks, the receiver takes messages in the order they were sent (NCCL matches
        point-to-point messages by order alone)."""
        sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for r, rank in enumerate(self.actions):
            for a in rank:
                if a.kind in SENDS:
                    target = a.stage + 1 if a.kind == "SEND_F" else a.stage - 1
                    sent.setdefault((r, self.peer(a)), []).append((SENDS[a.kind], target, a.microbatch))
                elif a.kind in SENDS.values():
                    received.setdefault((self.peer(a), r), []).append((a.kind, a.stage, a.microbatch))
        for pair, messages in received.items():
            if sent.get(pair) != messages:
                fail(where, f"pp rank {pair[1]} receives from pp rank {pair[0]} in another order than it sends")

    def _check_deadlock_free(self, where: str) -> None:
        """Run every rank's actions: a send is posted at once, a receive waits for its send. Every
        rank must reach its end. Linear in the actions (a hostile record cannot make it slow): a
        rank runs until it blocks, and is woken once by the send it waits for."""
        posted: set[tuple[str, int, int]] = set()
        waiting: dict[tuple[str, int, int], int] = {}  # the receive a blocked rank waits for -> that rank
        at = [0] * len(self.actions)
        ready = list(range(len(self.actions)))
        while ready:
            r = ready.pop()
            rank = self.actions[r]
            while at[r] < len(rank):
                a = rank[at[r]]
                key = (a.kind, a.stage, a.microbatch)
                if a.kind in SENDS.values() and key not in posted:
                    waiting[key] = r
                    break
                if a.kind in SENDS:
                    target = a.stage + 1 if a.kind == "SEND_F" else a.stage - 1
                    sent = (SENDS[a.kind], target, a.microbatch)
                    posted.add(sent)
                    if sent in waiting:
                        ready.append(waiting.pop(sent))
                at[r] += 1
        if waiting:
            stuck = ", ".join(f"rank {r} at {self.actions[r][at[r]]}" for r in sorted(waiting.values()))
            fail(where, f"the schedule deadlocks ({stuck})")

    def in_flight(self, stage: int) -> int:
        """The most micro-batches whose forward ran on `stage` and whose backward has not finished
        (B, or W of a split one: between I and W a micro-batch still holds what W reads): how many
        micro-batches' saved activations the stage holds at its peak."""
        held = peak = 0
        for a in self.actions[self.stage_rank[stage]]:
            if a.stage == stage and a.kind in ("F", self.backward_kinds[-1]):
                held += 1 if a.kind == "F" else -1
                peak = max(peak, held)
        return peak

    def rank_in_flight(self, rank: int) -> int:
        """The most (stage, micro-batch) forwards on pp rank `rank` whose backward has not run:
        with several stages per rank, the activations the rank holds at its peak, in stage-micro-batches."""
        held = peak = 0
        for a in self.actions[rank]:
            if a.kind in ("F", self.backward_kinds[-1]):
                held += 1 if a.kind == "F" else -1
                peak = max(peak, held)
        return peak

    def table(self) -> list[str]:
        """One line per pipeline rank: its stages and actions (titan-show)."""
        lines = [f"{self.schedule}, {self.microbatches} micro-batches, {self.n_stages} stages"]
        for s, (a, b) in enumerate(self.stage_layers):
            extra = (["embedding"] if s == 0 else []) + (["norm, output, loss"] if s == self.n_stages - 1 else [])
            lines.append(f"  stage {s} on pp rank {self.stage_rank[s]}: layers {a}-{b - 1}"
                         f"{' + ' + ' + '.join(extra) if extra else ''}; peak micro-batches in flight {self.in_flight(s)}")
        lines += [f"  pp rank {r}: {' '.join(map(str, rank))}" for r, rank in enumerate(self.actions)]
        return lines


def stage_ranks(schedule: str, *, stages: int, pp: int) -> tuple[int, ...] | None:
    """Which pp rank runs each stage (None where the schedule cannot place `stages` on `pp` ranks):
    one stage per rank in order; interleaved, rank r holds stages r, r + pp, ...; zbv's V, rank r
    holds stages r and 2 pp - 1 - r (the first and the last stage on rank 0, and the turn of the V,
    stages pp - 1 and pp, both on rank pp - 1)."""
    if schedule == "zbv":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(stages)) if stages == 2 * pp else None
    if schedule == "interleaved-1f1b":
        return tuple(s % pp for s in range(stages)) if stages % pp == 0 and stages > pp else None
    return tuple(range(stages)) if stages == pp else None
