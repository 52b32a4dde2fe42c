"""The ping-pong protocol of the Gluon forwards' two consumer warpgroups (attn/kernels/gluon_pipeline.py),
checked as a model on the CPU: every interleaving of the TMA producer and both consumers ends with every
agent done and both turn barriers idle, for programs of 0 to 6 key blocks and rings of 2 and 3 slots.

The model follows the kernels' order of blocking operations per program (gluon_softmax_fwd._consumer and
gluon_weighted_fwd._consumer with PINGPONG, gluon_pipeline.producer / stream_ring); tests/test_gluon_compile.py
checks that the compiled SASS holds the turn waits and passes where this model puts them.

- producer: per key block i, wait until both consumers freed K_{i-STAGES} (ring slot reuse), load K_i, wait
  until both freed V_{i-STAGES}, load V_i.
- consumer w: group 0 waits for K_0 (and warpgroup 1 for its turn), issues S_0, passes the turn, frees K_0;
  group j (1 <= j < n) waits for K_j and V_{j-1}, then its turn, issues, passes, frees K_j and V_{j-1};
  group n waits for V_{n-1}, then its turn, issues, passes (warpgroup 0 only), frees V_{n-1}. A wgmma wait
  needs only the warpgroup's own wgmmas, so it never blocks in the model.
- turn barrier b (named barriers 14 and 15, 256 threads): each warpgroup contributes 128 threads, by
  bar.sync (blocks until the barrier completes) or bar.arrive (does not block); the barrier completes at
  two contributions. A completion without a waiter (two arrivals: a pass lost), one warpgroup contributing
  twice to one completion, or a barrier left with a contribution when every agent is done is an error;
  so is a state where no agent can move before all are done (a hang).

Negative checks: protocols with one wait or pass out of place must fail the same check (the checker can fail).
"""

from __future__ import annotations

from collections import deque

import pytest

WAIT_BAR = {0: 14, 1: 15}  # the barrier each warpgroup waits on
PASS_BAR = {0: 15, 1: 14}  # the barrier each warpgroup passes the turn on


def consumer_ops(w: int, n: int, first_wait=(False, True), last_pass=(True, False)) -> list[tuple]:
    """Consumer warpgroup w's blocking operations and signals for a program of n key blocks, in program
    order. first_wait / last_pass: whether warpgroup 0 / 1 waits before group 0, passes after group n
    (the kernels: (False, True), (True, False))."""
    if n == 0:
        return []
    ops = [("ready", "K", 0)]
    if first_wait[w]:
        ops.append(("sync", WAIT_BAR[w]))
    ops += [("arrive", PASS_BAR[w]), ("free", "K", 0)]
    for j in range(1, n):
        ops += [("ready", "K", j), ("ready", "V", j - 1), ("sync", WAIT_BAR[w]), ("arrive", PASS_BAR[w]),
                ("free", "K", j), ("free", "V", j - 1)]
    ops += [("ready", "V", n - 1), ("sync", WAIT_BAR[w])]
    if last_pass[w]:
        ops.append(("arrive", PASS_BAR[w]))
    ops.append(("free", "V", n - 1))
    return ops


def producer_ops(n: int, stages: int) -> list[tuple]:
    ops = []
    for i in range(n):
        ops += [("empty", "K", i - stages), ("load", "K", i), ("empty", "V", i - stages), ("load", "V", i)]
    return ops


def check(n: int, stages: int, **protocol) -> str | None:
    """None if every interleaving ends cleanly, else a description of the first bad state found."""
    programs = (producer_ops(n, stages), consumer_ops(0, n, **protocol), consumer_ops(1, n, **protocol))
    # state: (pcs, loaded {(op, i)}, freed {(op, i, w)}, barriers {id: (contributors, waiting)})
    start = ((0, 0, 0), frozenset(), frozenset(), (((), ()), ((), ())))
    barrier_index = {14: 0, 15: 1}
    seen, queue = {start}, deque([start])
    while queue:
        pcs, loaded, freed, bars = queue.popleft()
        if all(pc == len(prog) for pc, prog in zip(pcs, programs)):
            if any(contributors for contributors, _ in bars):
                return f"n={n} STAGES={stages}: a turn barrier holds a contribution at the end: {bars}"
            continue
        moves = []
        for agent, (pc, prog) in enumerate(zip(pcs, programs)):
            if pc == len(prog):
                continue
            w = agent - 1
            if w >= 0 and any(w in waiting for _, waiting in bars):
                continue  # blocked in bar.sync
            op = prog[pc]
            kind = op[0]
            new_loaded, new_freed, new_bars = loaded, freed, list(bars)
            if kind == "empty":  # the producer's wait for a slot: both consumers freed its previous tile
                _, tile, i = op
                if i >= 0 and not ((tile, i, 0) in freed and (tile, i, 1) in freed):
                    continue
            elif kind == "load":
                new_loaded = loaded | {(op[1], op[2])}
            elif kind == "ready":
                if (op[1], op[2]) not in loaded:
                    continue
            elif kind == "free":
                new_freed = freed | {(op[1], op[2], w)}
            else:  # a turn barrier: sync or arrive
                b = barrier_index[op[1]]
                contributors, waiting = bars[b]
                if w in contributors:
                    return f"n={n} STAGES={stages}: warpgroup {w} contributes twice to barrier {op[1]}"
                contributors = contributors + (w,)
                waiting = waiting + ((w,) if kind == "sync" else ())
                if len(contributors) == 2:  # complete: release the waiters
                    if not waiting:
                        return f"n={n} STAGES={stages}: barrier {op[1]} completed by two arrivals (a pass lost)"
                    contributors, waiting = (), ()
                new_bars[b] = (contributors, waiting)
            new_pcs = tuple(p + (a == agent) for a, p in enumerate(pcs))
            moves.append((new_pcs, new_loaded, new_freed, tuple(new_bars)))
        if not moves:
            return f"n={n} STAGES={stages}: a hang at pcs {pcs} of {[len(p) for p in programs]}, barriers {bars}"
        for state in moves:
            if state not in seen:
                seen.add(state)
                queue.append(state)
    return None


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("n", range(7))
def test_the_pingpong_protocol_never_hangs_and_leaves_both_barriers_idle(n, stages):
    assert check(n, stages) is None


@pytest.mark.parametrize("protocol,expected", [
    (dict(first_wait=(True, True)), "a hang"),  # warpgroup 0 waits before group 0: nobody starts
    (dict(first_wait=(False, False)), "contributes twice"),  # warpgroup 1 does not wait before group 0
    (dict(last_pass=(True, True)), "holds a contribution at the end"),  # warpgroup 1 passes after its last group
    (dict(last_pass=(False, False)), "a hang"),  # warpgroup 0 does not pass after its last group
])
def test_the_checker_finds_a_protocol_with_a_wait_or_pass_out_of_place(protocol, expected):
    found = [check(n, 2, **protocol) for n in range(1, 5)]
    assert any(result is not None and expected in result for result in found), found
