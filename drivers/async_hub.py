"""The asynchronous job's dispatcher and sample queue, in one Ray actor (:class:`SampleHub`).

The dispatcher owns the data position: it hands prompts out in the sampler's order (first
any prompt whose work was given back: a dropped group, or the in-flight work of a
``rollout_state=drop`` resume) and keeps every prompt dispatched and not yet trained on
(*outstanding*), and dispatches no prompt that could only be trained on beyond the
staleness bound (:meth:`Dispatcher.room`).  The queue holds finished sequences by prompt; a GRPO group is
taken only once all its ``n`` sequences are in.  A group whose oldest token is more than
``staleness_threshold`` policy versions behind the trainer is dropped, counted, and its
prompt dispatched again.  Every state is plain lists and numbers (the checkpoint's).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import ray

from raycheckpoint import ResumableSampler
from workers.streaming import Sequence

Key = tuple[int, int]  # (epoch, prompt row)


class Dispatcher:
    def __init__(self, rows: int, *, seed: int, batch: int, staleness: float,
                 sync_every: int = 1) -> None:
        self.sampler = ResumableSampler(rows, seed=seed)
        self.staleness = staleness
        self.per_version = batch * sync_every  # prompts the trainer takes under one version
        self.requeue: list[Key] = []  # given back, dispatched again before new prompts
        self.outstanding: list[Key] = []  # dispatched, not trained on, in dispatch order
        self.dispatched = 0
        self.consumed = 0

    def room(self, version: int) -> int:
        """How many prompts may be dispatched under policy ``version``: the trainer takes
        ``sync_every`` batches per version (``trigger_parameter_sync_step``), so a prompt
        dispatched now is trained by version ``version + staleness`` only while no more than
        ``(version + staleness + 1) * sync_every`` batches have been dispatched (those given
        back are dispatched again, and count then).  A fractional ``staleness`` (verl's
        ``0.1``) lets that fraction of a version's batches out ahead."""
        return (math.floor((version + self.staleness + 1) * self.per_version) - self.consumed
                - len(self.outstanding))

    def dispatch(self, k: int, version: int) -> list[Key]:
        """Up to ``k`` prompts, fewer where the throttle (:meth:`room`) says so."""
        k = max(0, min(k, self.room(version)))
        out = self.requeue[:k]
        self.requeue = self.requeue[k:]
        while len(out) < k:
            row = self.sampler.next_batch(1)[0]
            out.append((self.sampler.epoch, row))
        self.outstanding += out
        self.dispatched += len(out)
        return out

    def consume(self, keys: list[Key]) -> None:
        gone = set(keys)
        self.outstanding = [k for k in self.outstanding if k not in gone]
        self.consumed += len(keys)

    def give_back(self, keys: list[Key]) -> None:
        """Prompts whose work is lost (dropped, or not restored): dispatched again first."""
        gone = set(keys)
        self.outstanding = [k for k in self.outstanding if k not in gone]
        self.requeue += [k for k in keys if k not in self.requeue]

    def state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "requeue": [list(k) for k in self.requeue],
                "outstanding": [list(k) for k in self.outstanding],
                "dispatched": self.dispatched, "consumed": self.consumed}

    def load(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.requeue = [tuple(k) for k in state["requeue"]]
        self.outstanding = [tuple(k) for k in state["outstanding"]]
        self.dispatched, self.consumed = int(state["dispatched"]), int(state["consumed"])


class SampleQueue:
    def __init__(self, n: int) -> None:
        self.n = n
        self.groups: dict[Key, list[dict[str, Any]]] = {}  # by prompt, in order of first arrival
        self.dropped_groups = 0
        self.dropped_tokens = 0

    def push(self, sequences: list[dict[str, Any]]) -> None:
        for s in sequences:
            self.groups.setdefault((s["epoch"], s["pid"]), []).append(s)

    def complete(self) -> list[Key]:
        return [k for k, g in self.groups.items() if len(g) == self.n]

    def depth(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def state(self) -> dict[str, Any]:
        return {"sequences": [s for g in self.groups.values() for s in g],
                "dropped_groups": self.dropped_groups, "dropped_tokens": self.dropped_tokens}

    def load(self, state: dict[str, Any]) -> None:
        self.groups = {}
        self.push(state["sequences"])
        self.dropped_groups = int(state["dropped_groups"])
        self.dropped_tokens = int(state["dropped_tokens"])


def oldest_version(group: list[dict[str, Any]]) -> int:
    return min(v for s in group for v in s["versions"])


@ray.remote
class SampleHub:
    """Dispatcher and queue together: one actor, so that one call reads both consistently."""

    def __init__(self, prompts: list[list[int]], *, seed: int, n: int, batch: int,
                 staleness: float, sync_every: int = 1) -> None:
        self.prompts = prompts  # token ids of each dataset row's prompt
        self.dispatcher = Dispatcher(len(prompts), seed=seed, batch=batch, staleness=staleness,
                                     sync_every=sync_every)
        self.queue = SampleQueue(n)
        self.n = n
        # versions a trained group may lag: a fraction of a version's batches let out ahead
        # is trained under the next version at the latest
        self.staleness = math.ceil(staleness)

    def dispatch(self, k: int, version: int) -> list[dict[str, Any]]:
        """The ``n`` new sequences of each of up to ``k`` prompts (see :meth:`Dispatcher.room`)."""
        return [asdict(Sequence(e, pid, j, self.prompts[pid]))
                for e, pid in self.dispatcher.dispatch(k, version) for j in range(self.n)]

    def push(self, sequences: list[dict[str, Any]]) -> int:
        self.queue.push(sequences)
        return self.queue.depth()

    def take(self, prompts: int, version: int) -> dict[str, Any] | None:
        """``prompts`` complete groups in the order they completed, each within the staleness
        bound at policy ``version`` (staler ones are dropped and their prompts given back),
        or None while fewer are complete."""
        dropped: list[Key] = []
        for key in self.queue.complete():
            group = self.queue.groups[key]
            if version - oldest_version(group) > self.staleness:
                del self.queue.groups[key]
                dropped.append(key)
                self.queue.dropped_groups += 1
                self.queue.dropped_tokens += sum(len(s["tokens"]) for s in group)
        self.dispatcher.give_back(dropped)
        ready = self.queue.complete()[:prompts]
        if len(ready) < prompts:
            return None
        groups = [self.queue.groups.pop(k) for k in ready]
        self.dispatcher.consume(ready)
        return {"groups": groups, "dropped_now": len(dropped), **self.counters()}

    def counters(self) -> dict[str, int]:
        return {"queue_depth": self.queue.depth(), "dropped_groups": self.queue.dropped_groups,
                "dropped_tokens": self.queue.dropped_tokens,
                "dispatched": self.dispatcher.dispatched, "consumed": self.dispatcher.consumed,
                "outstanding": len(self.dispatcher.outstanding)}

    def state(self) -> dict[str, Any]:
        return {"dispatcher": self.dispatcher.state(), "queue": self.queue.state()}

    def load(self, state: dict[str, Any]) -> None:
        self.dispatcher.load(state["dispatcher"])
        self.queue.load(state["queue"])

    def data_position(self) -> dict[str, Any]:
        """What ``rollout_state=drop`` keeps (:func:`without_work` of :meth:`state`)."""
        return without_work(self.state())


def without_work(state: dict[str, Any]) -> dict[str, Any]:
    """A hub state with only the data position: every outstanding prompt given back, in
    dispatch order, and the queue emptied (in-flight and queued work is generated again)."""
    d, q = state["dispatcher"], state["queue"]
    requeue = d["requeue"] + [k for k in d["outstanding"] if k not in d["requeue"]]
    return {"dispatcher": {**d, "requeue": requeue, "outstanding": []},
            "queue": {**q, "sequences": []}}
