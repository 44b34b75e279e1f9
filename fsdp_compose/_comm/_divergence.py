"""Ranks that diverge: a ``DivergenceError`` on every rank, in bounded time.
Measurements and history: docs/design.md, "Divergence".

[Note: divergence]
Collectives pair by position (a group's n-th on every rank), so ranks that do
different things pair the wrong ones: a crash or a hang. Three mechanisms
make it a DivergenceError on every rank, naming the unit, the collective and
what each rank did, with no further collective issued:
1. Lazy-init check: one all-reduce (MAX of ``[v, -v]``: each field's max and
   min everywhere) of the unit count and a hash of every unit's layout.
2. Step check (FSDP_COMPOSE_STEP_CHECK, default on): the same at each root
   forward's start (CUDA: and outer backward's) of the phase, the optimizer
   steps, forwards and backwards since the last step, and the schedule
   settings' hash; all between two checks is a function of these. On a
   mismatch each rank posts its lines and the group's first rank summarises.
3. A rank that left a step half-done posts its collective count to the store
   and waits for every rank's (all alike: the step is dropped; else raise).
   Gloo waits run in ``SLICE``s, reading the store between; a failed one
   becomes our error; a rank that raised raises again at its next step.

[Note: one check per step]
On gloo only the forward's step check is issued (each costs a round trip).
A rank in a backward still never pairs a parameter collective with another's
check: gloo pairs only collectives of the same kind, and the backward's first
collective on a group (an all-gather, or a reduce-scatter) is waited for by
every later one, so both ranks wait. The store resolves that wait: a rank
waiting in a check for a slice posts the check's number and its position in
every group (``next_op``); a rank blocked for a slice in a collective reads
it, and if the peer waits in a check this rank has not issued and has not
issued the collective this rank waits for, it never will: raise, naming what
both began, and post the record (the peer reads it within a slice). A slow
peer has issued that collective (or waits in no check): nothing is raised.
What a backward check would catch is caught at the next forward's or here.

[Note: step check on CUDA]
NCCL pairs a communicator's n-th collectives whatever their kind and size, so
on CUDA both phases are checked and a check is compared before its phase
issues anything (else an all-gather could pair with a differently sized one:
a hang, or bytes written where they do not belong). The check's all-reduce
(current stream), a copy of its result to pinned host memory per group and ONE
event are enqueued at the phase start; ``settle`` (the phase's first
``next_op``) polls the event, reading the store every ``SLICE`` for a peer's
record, then compares: the CPU waits for the GPU at each phase start. A rank
blocked on the GPU in a collective is invisible to its CPU; NCCL's watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the group's timeout) ends that process.
"""
from __future__ import annotations

import json
import os
import re
import time
import weakref
import zlib
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from .._base import _compat
from .._base._common import label, rank, unit_error
from .._base._job import job


class DivergenceError(RuntimeError):
    """The ranks of a job did different things (forwards, backwards, settings,
    parameters), or one of them left a step half-done: their collectives can no
    longer be matched. Raised on every rank; a rank that raised it raises it
    again at its next step without communicating."""


# The step check (2. in the Note): FSDP_COMPOSE_STEP_CHECK=1 / 0 turns it on /
# off (read when a root initialises); unset: STEP_CHECK_DEFAULT (on). The lazy-init
# check, the sliced waits and a step left half-done are always handled.
STEP_CHECK_DEFAULT = True  # measured: docs/design.md, "Divergence"


def step_check_enabled() -> bool:
    value = os.environ.get("FSDP_COMPOSE_STEP_CHECK", "").strip()
    return STEP_CHECK_DEFAULT if value == "" else value not in ("0", "false", "False")

SLICE = timedelta(seconds=1)       # a blocked wait reads the store this often
EXPLAIN_WAIT = timedelta(seconds=10)  # for the other ranks' lines on a mismatch

LAZY_INIT, FORWARD, EVAL_FORWARD, BACKWARD = 0, 1, 2, 3
PHASES = {LAZY_INIT: "lazy init", FORWARD: "a training forward",
          EVAL_FORWARD: "a no-grad forward", BACKWARD: "a backward"}
_MASK = (1 << 62) - 1  # hashes fit an int64 and its negation

# ---------------------------------------------------------------------------
# Optimizer steps over sharded parameters (written by _torch_hooks' step pre-hook)
# ---------------------------------------------------------------------------
def count_optimizer_step() -> None:
    job().optimizer_steps += 1  # a counter only: each root counts the steps of its lifetime


# ---------------------------------------------------------------------------
# The store: records of ranks that stopped (3. in the Note)
#
# [Note: divergence records are per root]
# Every record is keyed by the root it belongs to, never by what another
# model in the same process could share (a unit FQN: every root's is '', the
# ranks, a counter of checks): ``StepChecks.prefix`` names the root's
# lifetime (the n-th root this process made over these ranks and process
# groups, agreed in the lazy-init check) and its groups. A root's store keys
# live under it: the words of a step left half-done (deleted by the last rank
# to read them), the lines of a mismatch; the keys this rank wrote are
# deleted when the root is freed (``weakref.finalize``). A stop is also
# recorded per process group: after a DivergenceError a rank may still have
# a collective in flight there, so every root on that group (the model that
# raised, one alive beside it, one made later) raises instead of pairing its
# collectives with it. A model on other process groups is not affected.
# A root's record is ``StepChecks.stopped``; the process groups' are the
# job's (``job().stopped_pgs``, "*": unknown), as is the root whose phase
# began last (``job().active``).
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Where each rank is in each process group's sequence of collectives (the
# ones _collectives issues): a rank that waits in a step check posts these,
# and a rank blocked in a collective its peer has not issued learns that the
# peer never will (see StepChecks.before). The job's: ``job().positions``
# (group name -> collectives issued on it), ``job().names`` (group -> its
# name, alike on its members), ``job().unsettled`` (whose step check is
# issued, not yet compared).
# ---------------------------------------------------------------------------
def settle() -> None:
    """Wait for and compare a step check still in flight (see StepChecks.settle)."""
    unsettled = job().unsettled
    checks = unsettled() if unsettled is not None else None
    if checks is not None:
        checks.settle()


def next_op(group) -> tuple:
    """A collective is issued on ``group``: (its group's name, its position
    there). First, a step check still in flight is waited for and compared
    (``StepChecks.settle``): no collective of a phase before its check."""
    j = job()
    if j.unsettled is not None:
        settle()
    name = j.names.get(group)
    if name is None:
        name = j.names[group] = (group if group is not None else dist.group.WORLD).group_name  # type: ignore[union-attr]
    at = j.positions.get(name, 0) + 1
    j.positions[name] = at
    return name, at


def _store():
    try:
        return _compat.default_store()
    except (RuntimeError, ValueError):  # no default process group
        return None


def _pg_key(pg, ranks: tuple) -> str:
    """A process group, named alike on its members: torch's group name and its ranks."""
    return f"{pg.group_name}:{len(ranks)}:{zlib.crc32(repr(ranks).encode()):08x}"


def _pg_stop_key(pg_key: str) -> str:
    return f"fsdp_compose/pg/{pg_key}/stopped"


def stop(record: str, checks: "StepChecks | None" = None) -> None:
    """This rank stops communicating on ``checks``' groups (default: the root
    whose phase runs): say why, to the other ranks and to later calls."""
    j = job()
    if checks is None:
        checks = j.active() if j.active is not None else None
    keys = []
    if checks is not None:
        if checks.prefix is not None:
            if checks.stopped is None:
                checks.stopped = record
            keys += [checks.key("stopped"), checks.key(f"stopped/{dist.get_rank()}")]
        for k in checks.pg_keys:
            j.stopped_pgs.setdefault(k, record)
            keys.append(_pg_stop_key(k))
    else:
        j.stopped_pgs.setdefault("*", record)
        keys.append(_pg_stop_key("*"))
    store = _store()
    if store is not None:
        try:
            for key in keys:  # the first record stays: the rank that found the divergence
                store.compare_set(key, "", record)  # ("": set only where there is none)
        except RuntimeError:  # the store's host (rank 0's process) is gone
            pass


def stopped_here(checks: "StepChecks | None") -> str | None:
    """This process's record, if it stopped (raised a DivergenceError) on
    ``checks``' root or on one of its process groups."""
    if checks is not None and checks.stopped is not None:
        return checks.stopped
    stopped_pgs = job().stopped_pgs
    if not stopped_pgs:
        return None
    if checks is not None:
        for k in checks.pg_keys:
            if k in stopped_pgs:
                return stopped_pgs[k]
    return stopped_pgs.get("*")


def peer_record(at: tuple | None = None, doing: str | None = None) -> str | None:
    """A record another rank posted, if any (store round trips per live root):
    one that stopped, one that left a step half-done (see StepChecks.left), or,
    for a rank blocked in the collective ``at`` ((group name, position)), one
    waiting in a step check this rank has not reached, that has not issued
    ``at`` (see StepChecks.before); ``doing`` names ``at`` in that record."""
    store = _store()
    if store is None:
        return None
    try:
        roots = [c for c in list(job().roots) if c.prefix is not None]
        stop_keys = [c.key("stopped") for c in roots]
        stop_keys += [_pg_stop_key(k) for k in {k for c in roots for k in c.pg_keys}]
        stop_keys.append(_pg_stop_key("*"))
        for key in stop_keys:
            if store.check([key]):
                return store.get(key).decode(errors="replace")
        for checks in roots:
            key = checks.left_key("count")
            if store.check([key]):
                return (f"{_ranks(_left_ranks(store, checks))} left a step half-done (an "
                        "exception inside its forward or backward)")
        if at is not None:
            for checks in roots:
                record = checks.waiting_peer(store, at, doing)
                if record is not None:
                    return record
    except RuntimeError:
        return "the store's host (rank 0's process) is gone"
    return None


def _left_ranks(store, checks) -> list[int]:
    return [r for r in checks.members if store.check([checks.left_key(r)])]


def raise_if_stopped(fqn: str, checks: "StepChecks | None" = None) -> None:
    record = stopped_here(checks)
    if record is not None:
        raise unit_error(fqn, f"this rank stopped communicating after an earlier error "
                         f"({record}); the ranks' collectives on this model's process groups "
                         "no longer match.",
                         "Let the first DivergenceError end the job (on every rank); a model "
                         "built after it needs process groups of its own.",
                         exc=DivergenceError)


# ---------------------------------------------------------------------------
# Sliced waits (gloo: waiting blocks the CPU)
# ---------------------------------------------------------------------------
class CollectiveStopped(DivergenceError):
    """A collective did not complete: a peer stopped, exited, or timed out.
    ``reason`` says what is known; the caller names the unit and collective."""

    def __init__(self, reason: str):
        super().__init__(f"fsdp_compose [rank {rank()}]: a collective did not complete: {reason}")
        self.reason = reason


RECORD_GRACE = 1.0  # seconds a failed collective waits for a peer's record (see wait)


def wait(work, at: tuple | None = None, stuck=None, doing: str | None = None) -> None:
    """``work.wait()`` for a collective that blocks the CPU (gloo), in slices:
    between slices, read the store for a record of a rank that stopped. A
    work whose slice timed out stays usable (gloo: ``wait(timeout)`` raises,
    the collective goes on). Raises ``CollectiveStopped`` (and posts this
    rank's record) if it failed or another rank stopped. ``at``: the
    collective's (group name, position), see ``peer_record``; ``stuck()`` is
    called after every slice that went by; ``doing``: what this rank waits in,
    for the record its peers read (a user's call: ``user_collective``)."""
    while True:
        try:
            work.wait(SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # done since the slice ended, or failed
                try:
                    work.wait()
                    return
                except RuntimeError as e:  # failed: a peer exited, or the group's timeout
                    failure = e
            else:
                failure = None
        if failure is not None:
            record = peer_record()
            # A peer that raised posts its record, then exits, which fails this
            # collective: the two race, so give its record a moment to land.
            deadline = time.monotonic() + RECORD_GRACE
            while record is None and time.monotonic() < deadline:
                time.sleep(0.05)
                record = peer_record()
            reason = f"{type(failure).__name__}: {_first_line(failure)}"
            if record is not None:
                reason += f"; {record}"
            else:
                reason += ("; another rank has probably exited or stopped outside "
                           "fsdp_compose: its own error is in its log")
            stop(f"rank {rank()} stopped: a collective it waited for failed")
            raise CollectiveStopped(reason) from failure
        if stuck is not None:
            stuck()
        record = peer_record(at, doing)
        if record is not None:
            stop(f"rank {rank()} stopped: {record}")
            raise CollectiveStopped(record)


def user_collective(group, issue: Callable, doing: str, blocks_cpu: bool) -> None:
    """A collective a user's call issues on one of the model's groups (a
    sharded parameter's ``full_tensor()``, ``redistribute``...): counted
    there (``next_op``) and, where it blocks the CPU (gloo), waited for in
    slices. Called on some ranks only, it meets the others' next step check:
    a DivergenceError on every rank within a few slices, naming ``doing``,
    where it would wait for the backend's timeout (30 minutes by default).
    ``issue()`` issues it with ``async_op=True`` and returns its work."""
    at = next_op(group)
    work = issue()
    if not blocks_cpu:
        work.wait()
        return
    try:
        wait(work, at, doing=doing)
    except CollectiveStopped as e:
        raise DivergenceError(
            f"fsdp_compose [rank {rank()}]: {doing} waited for a collective that did not "
            f"complete: {e.reason}. It is a collective over the model's ranks (as a sharded "
            "parameter's full_tensor() or redistribute() is): call it on every rank alike; "
            "called on some ranks only, it waits for the others forever.") from e


def _first_line(e: BaseException) -> str:
    """The gist of a backend's error: its first sentence, without a source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip())
    text = text.splitlines()[0] if text else ""
    return text.split(". ")[0]


def collective_error(fqn: str, what: str, e: CollectiveStopped) -> DivergenceError:
    """``e`` as the error of unit ``fqn`` waiting for ``what``."""
    return unit_error(fqn,  # type: ignore[return-value]
                      f"waiting for {what}, which did not complete: {e.reason}.",
                      _FIX, exc=DivergenceError)


_FIX = ("Every rank must run the same forwards and backwards of the model between "
        "optimizer steps, with the same settings (set_requires_gradient_sync, "
        "set_requires_all_reduce, ...), and an exception inside forward or backward "
        "must end the job: look for a rank-dependent branch in the training loop (an "
        "extra microbatch, a forward for logging on one rank, an exception caught on "
        "one rank). See the README, 'When ranks diverge'.")


# ---------------------------------------------------------------------------
# The checks (1. and 2. in the Note)
# ---------------------------------------------------------------------------
def _forget(written: list[str]) -> None:
    """A root was freed: delete the store keys this rank wrote for it (see
    [Note: divergence records are per root])."""
    store = _store() if written else None
    if store is None:
        return
    for key in written:
        try:
            store.delete_key(key)
        except RuntimeError:  # the store's host is gone: nothing left to clean
            return


def stable_hash(text: str) -> int:
    """A hash that is the same in every process (``hash(str)`` is salted)."""
    return zlib.crc32(text.encode())


_AGREED = (3, 4)  # fields of the lazy-init vector that differ by rank: max and min taken
AGREE_WAIT = 60.0  # seconds a rank that left a step half-done waits for the others' word


class StepChecks:
    """A root's checks over the process groups its units communicate on."""

    def __init__(self, fqn: str, pgs: list, units: list, runtime=None):
        self.fqn = fqn
        self._rt = runtime  # CUDA: the root's stream runtime (see [Note: step check on CUDA])
        # [(process group, its ranks, the device of its tensors)]
        self.pgs = [(pg, tuple(dist.get_process_group_ranks(pg)), device)
                    for pg, device in pgs]
        self.pg_keys = [_pg_key(pg, ranks) for pg, ranks, _ in self.pgs]
        self.index = {u: i for i, u in enumerate(units)}  # (explicit prefetch, by position)
        self.names = [u.fqn or "<root>" for u in units]
        self.enabled = step_check_enabled()  # the step check (the lazy-init one always)
        self._opt_base = job().optimizer_steps  # optimizer steps before this root existed
        self._opt_seen = 0  # ... and since, at the last check
        self.forwards = 0   # root forwards since the last optimizer step
        self.backwards = 0  # backwards (outer) since the last optimizer step
        # every rank the checks reach, and the steps they left half-done together
        self.members = sorted({r for _, ranks, _ in self.pgs for r in ranks})
        self.left_together = 0
        # this root's lifetime (see [Note: divergence records are per root]):
        # set by lazy_init; the checks issued per group; the store keys this
        # rank wrote (deleted when the root is freed)
        self._agreed: list[int] = []  # lazy init: max and -min of the _AGREED fields
        # gloo: the step check runs at forward starts only (see before); the
        # checks issued (a rank waiting in one posts its number), and what
        # this rank began last (for a peer's error)
        self.gloo = all(device.type != "cuda" for _, _, device in self.pgs)
        self.issued = 0
        self._began: Callable[[], list] = lambda: []
        self._describe: Callable[[], list] = lambda: []  # the settings' lines, last check
        self._pending: tuple | None = None  # a step check issued, not compared (settle)
        self.prefix: str | None = None
        self.stopped: str | None = None  # this process's record, if it stopped on this root
        self._counts = [0] * len(self.pgs)
        self._written: list[str] = []
        self._ref = weakref.ref(self)
        job().roots.add(self)  # (read by peer_record)

    def key(self, what: str) -> str:
        """A store key of this root (before lazy init has named it: of the lazy-init check)."""
        return f"{self.prefix or 'fsdp_compose/lazy_init'}/{what}"

    def lazy_init(self, layout: list[str]) -> None:
        """``layout``: one line per unit, what every rank must have alike. Also
        names this root's lifetime alike on every rank of its groups (see
        [Note: divergence records are per root]): the highest of the ranks'
        "roots I took part in, plus one" and the lowest rank (two roots alive
        at once share a rank, whose count tells them apart, or have different
        lowest ranks)."""
        j = job()
        for k in self.pg_keys:  # a group an earlier model stopped on
            if k in j.stopped_pgs:
                raise_if_stopped(self.fqn, self)
        vec = [LAZY_INIT, len(layout), stable_hash("\n".join(layout)) & _MASK,
               j.roots_made + 1, -dist.get_rank()]
        with label("step_check", self.fqn):
            self._issue(vec, lambda: [f"{len(layout)} units"] + layout)
        made, low = self._agreed[0], self._agreed[1]
        if len(self.pgs) > 1:  # (HSDP) over the shard group, what its members saw elsewhere
            pg, _, device = self.pgs[0]
            t = torch.tensor([made, low], dtype=torch.int64)
            if device.type == "cuda":
                rt = self._runtime(device)
                t, host = rt.to_device(t, device), rt.host_empty(2, torch.int64, pin=True)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
                rt.device_to_host(host, t)
                with rt.intended_sync("lazy init: the root's name"):
                    rt.current_stream().record_event().synchronize()
                t = host
            else:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
            made, low = t.tolist()
        j.roots_made = max(j.roots_made, made)
        self.prefix = f"fsdp_compose/root/{made}/{-low}"
        weakref.finalize(self, _forget, self._written).atexit = False

    def before(self, phase: int, settings: tuple, describe) -> None:
        """At the start of ``phase`` (FORWARD, EVAL_FORWARD, BACKWARD), before
        its first collective. ``settings``: the schedule settings (hashable,
        ints and bools only: the same hash in every process); ``describe()``
        explains them in lines, on a mismatch."""
        j = job()
        j.active = self._ref
        if j.unsettled is not None:
            settle()
        if not self.enabled:
            return
        if self._opt_seen != j.optimizer_steps - self._opt_base:
            self._opt_seen, self.forwards, self.backwards = j.optimizer_steps - self._opt_base, 0, 0
        steps, fwd, bwd = self._opt_seen, self.forwards, self.backwards
        vec = [phase, steps, fwd, bwd, hash(settings) & _MASK]

        def lines():
            return [f"began {PHASES[phase]}",
                    f"optimizer steps so far: {steps}",
                    f"since the last optimizer step: {fwd} forward(s), {bwd} backward(s) "
                    "of this model"] + describe()
        if phase == BACKWARD:
            self.backwards += 1
        else:
            self.forwards += 1
        self._began, self._describe = lines, describe
        if phase == BACKWARD and self.gloo:
            return  # see [Note: one check per step]
        self.issued += 1
        with label("step_check", self.fqn):
            self._issue(vec, lines, defer=True)

    def now(self, doing: str | None = None) -> list[str]:
        """What this rank began, as of now: the lines of the phase it began
        last (``before``), unless it is blocked in ``doing`` (a user's
        collective) or an optimizer step came since; then the live counts."""
        steps = job().optimizer_steps - self._opt_base
        if doing is None and steps == self._opt_seen:
            return self._began()
        fwd, bwd = (self.forwards, self.backwards) if steps == self._opt_seen else (0, 0)
        return [f"began {doing or 'no forward or backward since its last optimizer step'}",
                f"optimizer steps so far: {steps}",
                f"since the last optimizer step: {fwd} forward(s), {bwd} backward(s) "
                "of this model"] + self._describe()

    def _post_waiting(self, vec: list[int], lines):
        """``stuck()`` for the wait of a step check: after its first slice,
        post where this rank is (its check's number, its position in every
        group, what it began) for the ranks blocked elsewhere; returns also
        the function that takes the post back once the check completed."""
        posted: list = []

        def stuck():
            if posted:
                return
            store = _store()
            if store is None:
                return
            record = json.dumps({"check": self.issued, "at": job().positions, "phase": vec[0],
                                 "lines": [x[:_LINE] for x in lines()[:_LINES]]})
            try:
                key = self.key(f"waiting/{dist.get_rank()}")
                store.set(key, record)
                store.add(self.key("waiting/n"), 1)
                self._written += [key, self.key("waiting/n")]
                posted.append(key)
            except RuntimeError:
                pass

        def take_back():
            if posted:
                store = _store()
                try:
                    store.delete_key(posted[0])
                    store.add(self.key("waiting/n"), -1)
                except (RuntimeError, AttributeError):
                    pass
        return stuck, take_back

    def waiting_peer(self, store, at: tuple, doing: str | None = None) -> str | None:
        """For a rank blocked in the collective ``at`` ((group name, its
        position there)): a record of a rank of this root that waits in a step
        check this rank has not issued, and has not issued ``at``: it will not
        (it waits for this rank's check), so the ranks diverged."""
        n = self.key("waiting/n")
        if self.prefix is None or not store.check([n]) or int(store.get(n)) <= 0:
            return None
        me = dist.get_rank()
        for r in self.members:
            key = self.key(f"waiting/{r}")
            if r == me or not store.check([key]):
                continue
            peer = json.loads(store.get(key))
            if peer["check"] <= self.issued or peer["at"].get(at[0], 0) >= at[1]:
                continue
            summary = _summarize(tuple(sorted((me, r))), {r: peer["lines"], me: self.now(doing)})
            mine = f"#{at[1]} on its group" + (f": {doing}, on rank {me} alone" if doing else "")
            record = (f"rank {r} waits in the step check at {PHASES[peer['phase']]} of unit "
                      f"'{self.fqn or '<root>'}' and has not issued the collective this rank "
                      f"waits for ({mine}): the ranks diverged. What they "
                      f"began:\n{summary}\n")
            # Say so, and give the waiting rank a few slices to read it (if this
            # rank exits, the store, hosted by rank 0, may go with it).
            stop(f"rank {me} stopped: {record}", self)
            deadline = time.monotonic() + 3 * SLICE.total_seconds()
            try:
                while time.monotonic() < deadline and not store.check([self.key(f"stopped/{r}")]):
                    time.sleep(0.05)
            except RuntimeError:  # it read it and exited, and the store went with rank 0
                pass
            return record
        return None

    def left_key(self, what) -> str:
        return f"{self.prefix}/left/{self.left_together}/{what}"

    def left(self, position: int, where: str) -> None:
        """This rank left its last step half-done (an exception inside forward
        or backward) after its ``position``-th collective. If every rank of the
        checks' groups left it after the same collective, they are in step:
        return (the caller drops the step, as with one rank). Otherwise (a rank
        that did not leave it waits in a collective, sees this rank's word in
        the store and stops; or the positions differ) raise. Bounded: a rank
        that says nothing within AGREE_WAIT seconds counts as not having left."""
        if job().unsettled is not None:  # (the forward raised before its first collective)
            settle()
        me = dist.get_rank()
        store = _store()
        if store is None:
            self._left_error(where, position, "the others cannot be asked (no store)")
        try:
            mine = self.left_key(me)
            self._written += [mine, self.left_key("count")]
            store.set(mine, str(position))
            store.add(self.left_key("count"), 1)  # what the others' waits look for
            keys = [self.left_key(r) for r in self.members]
            deadline = time.monotonic() + AGREE_WAIT
            while True:
                try:
                    store.wait(keys, SLICE)
                    break
                except RuntimeError:  # a slice went by: did a rank stop instead?
                    record = self._stop_record(store)
                    if record is not None:
                        self._left_error(where, position, record)
                    if time.monotonic() > deadline:
                        silent = [r for r in self.members if not store.check([self.left_key(r)])]
                        self._left_error(where, position, f"{_ranks(silent)} did not leave it "
                                         f"(no word within {AGREE_WAIT:.0f} s)")
            said = dict(zip(self.members, (int(v) for v in store.multi_get(keys))))
            if len(set(said.values())) == 1:  # in step: the last rank to read deletes the words
                self._written.append(self.left_key("read"))
                if store.add(self.left_key("read"), 1) == len(self.members):
                    for key in keys + [self.left_key("count"), self.left_key("read")]:
                        store.delete_key(key)
        except RuntimeError as e:  # (DivergenceError is one: let it through)
            if isinstance(e, DivergenceError):
                raise
            self._left_error(where, position, f"the store failed: {_first_line(e)}")
        if len(set(said.values())) > 1:
            by: dict[int, list[int]] = {}
            for r, p in said.items():
                by.setdefault(p, []).append(r)
            self._left_error(where, position, "every rank left it, at different collectives: "
                             + "; ".join(f"{_ranks(rs)} after #{p}"
                                         for p, rs in sorted(by.items())))
        self.left_together += 1  # every rank alike: in step, the next word goes elsewhere

    def _stop_record(self, store) -> str | None:
        """A record a rank posted on stopping on this root or one of its groups."""
        for key in [self.key("stopped")] + [_pg_stop_key(k) for k in self.pg_keys]:
            if store.check([key]):
                return store.get(key).decode(errors="replace")
        return None

    def _left_error(self, where: str, position: int, why: str) -> None:
        stop(f"rank {rank()} left a step half-done ({where}) after collective #{position} and "
             "stopped communicating", self)
        raise unit_error(
            self.fqn, f"this rank left its last step half-done: an exception was raised inside "
            f"its forward or backward ({where}) after some of the step's collectives, and not "
            f"every rank left it at the same point ({why}). "
            "The other ranks wait for the rest, so the ranks' collectives can no longer be "
            "matched: every rank raises a DivergenceError.",
            "Let an exception raised inside forward or backward end the job (or raise it on "
            "every rank alike). To skip a bad batch on one rank, decide before the forward, "
            "or raise between forward and backward on every rank alike (see the README, "
            "'When ranks diverge').", exc=DivergenceError)

    # ----------------------------------------------------------------------
    def _issue(self, vec: list[int], lines, defer: bool = False) -> None:
        """All-reduce ``vec`` over each group, then compare (every rank sees
        every mismatch of its groups): at once, or (``defer``) at ``settle``,
        before the phase's first collective. gloo: async works waited in
        slices; CUDA: see [Note: step check on CUDA]."""
        n = len(vec)
        issued, unread, rt = [], [], None
        for i, (pg, ranks, device) in enumerate(self.pgs):
            count = self._counts[i]
            self._counts[i] = count + 1
            check = (vec, lines, ranks, f"{self.pg_keys[i]}/{count}")
            t = torch.tensor(vec + [-v for v in vec], dtype=torch.int64)
            if device.type == "cuda":
                rt = rt or self._runtime(device)
                t = rt.to_device(t, device)  # (from pinned memory: no sync)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)  # on the current stream
                host = rt.host_empty(2 * n, torch.int64, pin=True)
                rt.device_to_host(host, t)
                unread.append((host, check))
                continue
            issued.append((dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg, async_op=True),
                           t, check))
        arrived = (rt, rt.current_stream().record_event()) if unread else None  # type: ignore[union-attr]
        if defer:  # see settle
            self._pending = (issued, unread, arrived, vec, lines)
            job().unsettled = self._ref
            return
        self._finish(issued, unread, arrived, vec, lines)

    def _runtime(self, device: torch.device):
        if self._rt is None:
            raise RuntimeError(f"fsdp_compose: the step check of '{self.fqn or '<root>'}' has a "
                               f"group on {device} but no stream runtime (a bug: please report)")
        return self._rt

    def settle(self) -> None:
        """Wait for the step check issued at the phase's start and compare:
        before the phase's first collective (``next_op``), so that its round
        trip overlaps the root's bookkeeping between the two."""
        job().unsettled = None
        pending, self._pending = self._pending, None
        if pending is not None:
            self._finish(*pending)

    def _finish(self, issued: list, unread: list, arrived, vec: list[int], lines) -> None:
        results = []
        if issued:
            stuck, take_back = self._post_waiting(vec, lines) if vec[0] != LAZY_INIT \
                else (None, None)
            for work, _, _ in issued:
                try:
                    wait(work, stuck=stuck)
                except CollectiveStopped as e:
                    raise collective_error(self.fqn, f"the step check at {PHASES[vec[0]]}", e) \
                        from e
            if take_back is not None:
                take_back()
            results = [(t.tolist(), check) for _, t, check in issued]
        if unread:
            self._wait_event(*arrived, vec)  # type: ignore[call-arg]
            results += [(host.tolist(), check) for host, check in unread]
        self._compare(results)

    def _wait_event(self, rt, event, vec: list[int]) -> None:
        """Until ``event`` (recorded after the check's copies to the host) has
        completed: polled, reading the store every slice for a peer's record
        (a rank blocked on the GPU cannot answer), then synchronised (it is
        done: this orders the host's read after the copies)."""
        t0 = slice_end = time.monotonic()
        while not event.query():
            now = time.monotonic()
            if now - t0 > 0.05:  # (spin at first: the GPU is usually a few ms behind)
                time.sleep(0.001)
            if now > slice_end + SLICE.total_seconds():
                slice_end = now
                record = peer_record()
                if record is not None:
                    raise collective_error(self.fqn, f"the step check at {PHASES[vec[0]]}",
                                           CollectiveStopped(record))
        with rt.intended_sync("the step check, compared before its phase's first collective"):
            event.synchronize()

    def _compare(self, results: list) -> None:
        """``results``: [(all-reduced [max, -min], check)] of one check over
        each group. Raise if any group's ranks reported different things
        (the lazy init's _AGREED fields aside: their max is kept)."""
        bad = []
        for out, check in results:
            n = len(check[0])
            if check[0][0] == LAZY_INIT:
                agreed = [out[i] for i in _AGREED]
                self._agreed = agreed if not self._agreed else \
                    [max(a, b) for a, b in zip(self._agreed, agreed)]
                out = [0 if i % n in _AGREED else v for i, v in enumerate(out)]
            if out[:n] != [-v for v in out[n:]]:
                bad.append(check)
        if not bad:
            return
        vec, lines = bad[0][0], bad[0][1]
        summary = _explain(self, [(ranks, count) for _, _, ranks, count in bad], lines())
        ranks = bad[0][2]
        what = "lazy init" if vec[0] == LAZY_INIT else "the start of a forward or backward"
        fix = _LAYOUT_FIX if vec[0] == LAZY_INIT else _FIX
        err = unit_error(
            self.fqn, f"the ranks diverged. At the step check ({what}: one all-reduce of each "
            f"rank's step fingerprint over ranks {list(ranks)}, before any collective of "
            f"the phase) they reported different things:\n{summary}\n{fix}",
            exc=DivergenceError)
        stop(f"rank {rank()} stopped: its step check at {PHASES[vec[0]]} of unit "
             f"'{self.fqn or '<root>'}' found the ranks diverged", self)
        raise err


_LAYOUT_FIX = ("Every rank must build the same model (the same parameters, shapes and "
               "dtypes, in the same units) before the first forward: look for a "
               "rank-dependent size, dtype or layer in the model's construction.")


_LINES, _LINE = 256, 400  # what a rank posts at most: lines, characters per line


def _explain(root: StepChecks, checks: list[tuple], lines: list[str]) -> str:
    """The lines that differ between ranks, and which ranks said what, for the
    first of ``checks`` ([(group ranks, check count)], the groups where this
    rank saw a mismatch), under ``root``'s prefix. Every rank posts its lines
    to the store for each of them; the first rank of each group summarises
    (bounded waits: a rank that never posts is reported as silent)."""
    me = dist.get_rank()
    mine = "\n".join(f"  rank {me}: {line}" for line in lines)
    store = _store()
    if store is None:
        return mine
    prefixes = [root.key(f"check/{c}") for _, c in checks]
    posted = json.dumps([line[:_LINE] for line in lines[:_LINES]])  # bounded, at any scale
    try:
        for prefix in prefixes:
            root._written.append(f"{prefix}/{me}")
            store.set(f"{prefix}/{me}", posted)
        for (ranks, _), prefix in zip(checks, prefixes):
            if ranks[0] == me:
                root._written.append(f"{prefix}/summary")
                store.set(f"{prefix}/summary", _summarize(ranks, _posted(store, prefix, ranks)))
        key = f"{prefixes[0]}/summary"
        store.wait([key], EXPLAIN_WAIT + SLICE)
        return store.get(key).decode()
    except RuntimeError:  # the store's host is gone, or a summary never came
        return mine + "\n  (the other ranks' lines could not be read)"


def _posted(store, prefix: str, ranks: tuple) -> dict[int, list[str]]:
    keys = [f"{prefix}/{r}" for r in ranks]
    try:
        store.wait(keys, EXPLAIN_WAIT)
        return {r: json.loads(v) for r, v in zip(ranks, store.multi_get(keys))}
    except RuntimeError:  # some never posted: read the others one by one
        return {r: json.loads(store.get(k)) for r, k in zip(ranks, keys) if store.check([k])}


def _summarize(ranks: tuple, got: dict[int, list[str]], most: int = 3) -> str:
    """The first ``most`` lines that differ (the first line, what the ranks
    began, always), each with which ranks said what."""
    out = []
    width = max((len(v) for v in got.values()), default=0)
    shown = 0
    for i in range(width):
        said: dict[str, list[int]] = {}
        for r in ranks:
            if r in got:
                v = got[r]
                said.setdefault(v[i] if i < len(v) else "(nothing)", []).append(r)
        if len(said) < 2:
            if i == 0 and said:
                out.append(f"  every rank: {next(iter(said))}")
            continue
        for line, who in said.items():
            out.append(f"  {_ranks(who)}: {line}")
        shown += 1
        if shown == most:
            break
    silent = [r for r in ranks if r not in got]
    if silent:
        out.append(f"  {_ranks(silent)}: no answer (exited, or stuck elsewhere)")
    if not out:
        out.append("  (every rank's description is the same: the settings' hashes differ)")
    return "\n".join(out)


def _ranks(rs: list[int]) -> str:
    if len(rs) > 8:
        return f"ranks {rs[0]}..{rs[-1]} ({len(rs)} ranks)"
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))
