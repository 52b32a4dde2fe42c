"""Which kernel tier runs a launch: the portable Triton kernels, or on Hopper the Gluon kernels.

The portable kernels run everywhere Triton does (every CUDA GPU, and the CPU interpreter the tests
use). On an sm_90 GPU whose Triton has the Gluon Hopper API (`gluon_pipeline.gluon_api_available`)
a launch that a Gluon kernel serves may run that kernel instead. `ATTNLAB_GLUON` chooses:

* `auto` (default): the first launch of a tuning key times both tiers on the call's own arguments
  (after each has compiled and tuned) and the faster one serves that key from then on; with tile
  configs pinned (`ATTNLAB_AUTOTUNE=0`, bitwise-reproducible runs) the portable tier, untimed;
* `1`: the Gluon kernel wherever it serves the launch;
* `0`: the portable kernels only.

A launch that a Gluon kernel does not serve (segments, key lengths, a window, dropout, other head
dims or dtypes, another GPU) always runs the portable kernel. Timing never runs inside a
CUDA-graph capture: a key first seen there runs the portable tier, untimed and unremembered.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from attn.kernels.env import autotune_pinned, interpreting, setting

GLUON_ENV = "ATTNLAB_GLUON"
GLUON_MODES = ("auto", "1", "0")
GLUON_DEFAULT = "auto"


GLUON_EXP2_ENV = "ATTNLAB_GLUON_EXP2"
GLUON_EXP2_MODES = ("mufu", "poly", "half")


def gluon_exp2_degree(dtype: torch.dtype) -> int:
    """The Gluon softmax forward's exp2 in its key blocks without masked scores, by ATTNLAB_GLUON_EXP2:
    `mufu` (default) 0, MUFU.EX2; `poly` the polynomial on the FMA pipes for every score (degree 3 for
    bf16 P, 4 for fp16), `half` for every other score (the negated degree). On an H100 both forms were
    slower than MUFU.EX2 for every cap (docs/gluon.md), hence the default. A ValueError naming the
    variable otherwise."""
    raw = setting(GLUON_EXP2_ENV, "mufu")
    if raw not in GLUON_EXP2_MODES:
        raise ValueError(f"{GLUON_EXP2_ENV} must be one of {GLUON_EXP2_MODES}, got {raw!r}")
    degree = 3 if dtype == torch.bfloat16 else 4
    return {"mufu": 0, "poly": degree, "half": -degree}[raw]


GLUON_SCHEDULE_ENV = "ATTNLAB_GLUON_SCHEDULE"
GLUON_SCHEDULES = ("unordered", "pingpong")


def gluon_pingpong() -> bool:
    """Whether the Gluon forwards (softmax family, threshold, sigmoid) run their two consumer warpgroups in
    ping-pong, by ATTNLAB_GLUON_SCHEDULE: `unordered` (default) leaves them unsynchronised with each other;
    `pingpong` makes them take turns at issuing their wgmmas (FlashAttention-3's ordering, named barriers:
    attn/kernels/gluon_pipeline.py). Opt-in: on an H100 it gained 0.3-3.7 % forward for the caps and
    sigmoid, and its bitwise comparison with `unordered` has not run for every form (docs/gluon.md). A
    ValueError naming the variable otherwise."""
    raw = setting(GLUON_SCHEDULE_ENV, "unordered")
    if raw not in GLUON_SCHEDULES:
        raise ValueError(f"{GLUON_SCHEDULE_ENV} must be one of {GLUON_SCHEDULES}, got {raw!r}")
    return raw == "pingpong"


GLUON_DQ_ENV = "ATTNLAB_GLUON_DQ"
GLUON_DQ_FORMS = ("auto", "separate", "one_pass")


def gluon_dq_form() -> str:
    """How the Gluon softmax backward (and the threshold's and sigmoid's, where WEIGHTED_ONE_PASS_OFFERED lists
    them) gets dq, by ATTNLAB_GLUON_DQ: "separate" (the query-block dQ kernel), "one_pass" (the key-block kernel
    adds each tile's dS K to an fp32 dq by TMA reduce-add; attn/kernels/gluon_softmax_bwd.py,
    gluon_weighted_bwd.py) or "auto" (default: the backward plans time both per tuning key and keep the faster,
    "separate" where nothing is timed; `choose_gluon_dq_form`). A ValueError naming the variable for anything
    else."""
    raw = setting(GLUON_DQ_ENV, GLUON_DQ_FORMS[0])
    if raw not in GLUON_DQ_FORMS:
        raise ValueError(f"{GLUON_DQ_ENV} must be one of {GLUON_DQ_FORMS}, got {raw!r}")
    return raw


GLUON_PERSISTENT_ENV = "ATTNLAB_GLUON_PERSISTENT"
GLUON_PERSISTENT_MODES = ("auto", "0", "1")


def gluon_persistent_mode() -> str:
    """Which grid the Gluon forwards (softmax family, threshold, sigmoid, differential threshold) and the
    backwards of the families in PERSISTENT_BACKWARDS_OFFERED (all four) launch, by
    ATTNLAB_GLUON_PERSISTENT: "0" a program per work item (query block or key block, batch x head), "1" the
    persistent kernels (a program per SM running work items in turn, the next item's tiles loading while
    this one finishes: attn/kernels/gluon_pipeline.py), "auto" (default: the plans time both per tuning key
    and keep the faster, the per-item grid where nothing is timed; `choose_gluon_grid`). The ping-pong
    schedule runs per item. A ValueError naming the variable for anything else."""
    raw = setting(GLUON_PERSISTENT_ENV, GLUON_PERSISTENT_MODES[0])
    if raw not in GLUON_PERSISTENT_MODES:
        raise ValueError(f"{GLUON_PERSISTENT_ENV} must be one of {GLUON_PERSISTENT_MODES}, got {raw!r}")
    return raw


GLUON_DIFF_DKDV_ENV = "ATTNLAB_GLUON_DIFF_DKDV"
GLUON_DIFF_DKDV_FORMS = ("auto", "key_halves", "view_warpgroups", "view_exchange")


def gluon_diff_dkdv_form() -> str:
    """The differential threshold's Gluon key-block form by ATTNLAB_GLUON_DIFF_DKDV: "key_halves" (each consumer
    warpgroup half the keys, both views), "view_warpgroups" (a warpgroup per score view, all the keys),
    "view_exchange" (as view_warpgroups, dP^T and dV computed once: gluon_diff_bwd.VIEW_EXCHANGE), "auto" (default:
    the plan times the offered forms per tuning key and keeps the fastest, the key halves where nothing is timed;
    `choose_gluon_diff_dkdv_form`). A ValueError naming the variable for anything else."""
    return _switch(GLUON_DIFF_DKDV_ENV, GLUON_DIFF_DKDV_FORMS)


GLUON_DIFF_DQ_ENV = "ATTNLAB_GLUON_DIFF_DQ"
GLUON_DIFF_DQ_FORMS = ("auto", "rows", "view_warpgroups")


def gluon_diff_dq_form() -> str:
    """The differential threshold's Gluon query-block form by ATTNLAB_GLUON_DIFF_DQ: "rows" (each consumer
    warpgroup its own 64 query rows, both views), "view_warpgroups" (a warpgroup per score view on the same rows),
    "auto" (default: the plan times the offered forms per tuning key and key-block form and keeps the faster,
    the rows form where nothing is timed; `choose_gluon_diff_dq_form`). A ValueError naming the variable for
    anything else."""
    return _switch(GLUON_DIFF_DQ_ENV, GLUON_DIFF_DQ_FORMS)


def _switch(env: str, values: tuple[str, ...]) -> str:
    """The variable's value among `values` (the first when unset); a ValueError naming it for anything else."""
    raw = setting(env, values[0])
    if raw not in values:
        raise ValueError(f"{env} must be one of {values}, got {raw!r}")
    return raw


def gluon_mode() -> str:
    """ATTNLAB_GLUON's value (GLUON_DEFAULT when unset); a ValueError naming the variable for anything else."""
    raw = setting(GLUON_ENV, GLUON_DEFAULT)
    if raw not in GLUON_MODES:
        raise ValueError(f"{GLUON_ENV} must be one of {GLUON_MODES}, got {raw!r}")
    return raw


def gluon_usable(device: torch.device) -> bool:
    """Whether the Gluon sm_90 kernels can run on `device`: a CUDA device of capability 9.0 and a
    Triton with the Gluon Hopper API they are written against (never under the interpreter)."""
    if device.type != "cuda" or interpreting():
        return False
    return _gluon_usable_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gluon_usable_on(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    from attn.kernels.gluon_pipeline import gluon_api_available

    return gluon_api_available()[0]


def gluon_candidate(device: torch.device) -> bool:
    """Whether a launch plan on `device` should offer a Gluon tier at all: the switch is not 0 and the
    device runs the Gluon kernels."""
    return gluon_mode() != "0" and gluon_usable(device)


def tiered(choice: "TierChoice", key: tuple, portable: Callable, gluon: Callable) -> Callable:
    """A plan's launch function whose calls `choice` serves from `portable` or `gluon` (both take the
    plan's call arguments) for tuning key `key`."""
    def launch(*args):
        return choice.pick(key, portable, gluon, args)(*args)
    return launch


def timing_allowed() -> bool:
    """Whether a choice may time its candidates now: not under pinned configs (ATTNLAB_AUTOTUNE=0: runs
    that must repeat bitwise), nor inside a CUDA-graph capture."""
    return not (autotune_pinned() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()))


class TimedChoice:
    """Per tuning key, which of a few implementations of one launch serves it: each timed once per key on
    the call's own arguments (after a first call that compiles and tunes it outside the timing), the
    fastest kept. `choose(key, impls, args, untimed)` returns the implementation; `untimed` names the one
    that serves, unremembered, while timing is not allowed (`timing_allowed`)."""

    label = ""  # after the name in `report`'s keys

    def __init__(self, name: str):
        self.name = name
        self.chosen: dict[tuple, str] = {}  # tuning key -> the chosen implementation's name
        self.timings: dict[tuple, dict[str, float]] = {}  # tuning key -> median ms per implementation

    def choose(self, key: tuple, impls: dict[str, Callable], args: tuple, untimed: str) -> Callable:
        chosen = self.chosen.get(key)
        if chosen is None:
            if not timing_allowed():
                return impls[untimed]
            chosen = self.chosen[key] = self._time(key, impls, args)
        return impls[chosen]

    def _time(self, key: tuple, impls: dict[str, Callable], args: tuple) -> str:
        from attn.kernels.runtime import median_ms

        times = {}
        for name, impl in impls.items():
            impl(*args)
            times[name] = median_ms(lambda: impl(*args))
        self.timings[key] = times
        return min(times, key=times.get)

    def report(self) -> dict[str, str]:
        """The choices so far with their timings, readable (for benchmark reports)."""
        def timed(key):
            return ", ".join(f"{name} {ms:.4f} ms" for name, ms in self.timings.get(key, {}).items())

        return {f"{self.name}{self.label}, {key}": f"{name} ({timed(key)})" for key, name in self.chosen.items()}


class TierChoice(TimedChoice):
    """Per tuning key, the tier that serves a kernel entry's launches (see the module docstring)."""

    label = " tier"

    def pick(self, key: tuple, portable: Callable, gluon: Callable, args: tuple) -> Callable:
        """The implementation to run `args` with: `portable` or `gluon`, both callables of `args`."""
        mode = gluon_mode()
        if mode != "auto":
            return gluon if mode == "1" else portable
        chosen = self.chosen.get(key)
        if chosen is not None:  # the common case, without building the candidates' mapping
            return gluon if chosen == "gluon" else portable
        return self.choose(key, {"portable": portable, "gluon": gluon}, args, "portable")


def choose_gluon_dq_form(choice: TimedChoice, key: tuple, separate: Callable, one_pass: Callable) -> Callable:
    """A plan's launch function for the Gluon softmax backward under ATTNLAB_GLUON_DQ=auto: `choice` times
    the two dq forms per tuning key and keeps the faster; "separate" while timing is not allowed and under
    torch.use_deterministic_algorithms (the one-pass form's reduce-adds sum dq in no fixed order)."""
    forms = {"separate": separate, "one_pass": one_pass}

    def launch(*args):
        if torch.are_deterministic_algorithms_enabled():
            return separate(*args)
        return choice.choose(key, forms, args, "separate")(*args)
    return launch


# The families (of "threshold", "sigmoid") whose Gluon backward plans offer the one-pass dQ form
# (gluon_weighted_bwd's `one_pass=True`): those whose GPU tests pass (tests/test_gluon_weighted_bwd_gpu.py -k
# one_pass: both) and whose one-pass form was faster somewhere (scripts/gpu_checks/check_gluon_weighted_bwd_gpu.py;
# docs/gluon.md): the sigmoid's (its two MUFU ops per score done once), not the threshold's (0.96-0.98x)
WEIGHTED_ONE_PASS_OFFERED: frozenset[str] = frozenset({"sigmoid"})


def choose_gluon_weighted_dq_form(choice: TimedChoice, key: tuple, separate: Callable, one_pass: Callable,
                                  family: str) -> Callable:
    """The threshold's or sigmoid's Gluon backward launch by ATTNLAB_GLUON_DQ (`gluon_dq_form`) where
    WEIGHTED_ONE_PASS_OFFERED holds `family`: "separate", "one_pass", or under "auto" the faster of the two per
    tuning key (`choose_gluon_dq_form`: "separate" where nothing is timed or algorithms must be deterministic);
    the separate form for a family not offered."""
    if family not in WEIGHTED_ONE_PASS_OFFERED:
        return separate
    mode = gluon_dq_form()
    if mode == "auto":
        return choose_gluon_dq_form(choice, key, separate, one_pass)
    return one_pass if mode == "one_pass" else separate


# The families whose Gluon backward plans offer the persistent grid: those whose bit-for-bit GPU tests against
# the per-item grid have passed (tests/test_gluon_weighted_bwd_gpu.py and tests/test_gluon_bwd_gpu.py
# and tests/test_gluon_diff_bwd_gpu.py -k persistent: all four; docs/gluon.md)
PERSISTENT_BACKWARDS_OFFERED = frozenset({"softmax", "threshold", "sigmoid", "diff_threshold"})


def choose_gluon_backward_grid(choice: TimedChoice, key: tuple, grid: Callable[[bool], Callable],
                               family: str) -> Callable:
    """`choose_gluon_grid` for the Gluon backward of `family` ("softmax", "threshold", "sigmoid",
    "diff_threshold") where PERSISTENT_BACKWARDS_OFFERED holds it, else its per-item grid."""
    if family not in PERSISTENT_BACKWARDS_OFFERED:
        return grid(False)
    return choose_gluon_grid(choice, key, grid, False)


# The differential threshold's key-block forms (gluon_diff_bwd.DKDV_FORMS) its backward plan offers, timing them
# per key: those whose GPU tests (tests/test_gluon_diff_bwd_gpu.py) pass and that win somewhere. The view
# warpgroups are faster at D = 128, slower at D = 64; the view exchange passes its tests but trails the view
# warpgroups at every measured shape, so it is not offered (docs/gluon.md)
DIFF_DKDV_FORMS_OFFERED = ("key_halves", "view_warpgroups")


def choose_gluon_diff_dkdv_form(choice: TimedChoice, key: tuple, form: Callable[[str], Callable]) -> Callable:
    """A plan's launch function for the Gluon differential threshold backward; `form(name)` gives the launch
    with the key-block form `name` (gluon_diff_bwd.DKDV_FORMS). The form `gluon_diff_dkdv_form` names where
    DIFF_DKDV_FORMS_OFFERED holds it (else the key halves), or under "auto" the fastest offered form as `choice`
    times them per tuning key ("key_halves" while timing is not allowed, or when it is the only one offered)."""
    return _choose_offered(choice, key, form, gluon_diff_dkdv_form(), DIFF_DKDV_FORMS_OFFERED, "key_halves")


# The differential threshold's query-block forms (gluon_diff_bwd.DQ_FORMS) its backward plan offers, timing them
# per key and key-block form: both pass tests/test_gluon_diff_bwd_gpu.py; the view warpgroups are faster after
# the key-block view warpgroups at D = 128, slower after the key halves (docs/gluon.md)
DIFF_DQ_FORMS_OFFERED = ("rows", "view_warpgroups")


def choose_gluon_diff_dq_form(choice: TimedChoice, key: tuple, form: Callable[[str], Callable]) -> Callable:
    """`choose_gluon_diff_dkdv_form` for the query-block form (gluon_diff_bwd.DQ_FORMS): the form
    `gluon_diff_dq_form` names where DIFF_DQ_FORMS_OFFERED holds it (else "rows"), or under "auto" the faster
    offered form as `choice` times them per key ("rows" while timing is not allowed)."""
    return _choose_offered(choice, key, form, gluon_diff_dq_form(), DIFF_DQ_FORMS_OFFERED, "rows")


def _choose_offered(choice: TimedChoice, key: tuple, form: Callable[[str], Callable], mode: str,
                    offered: tuple[str, ...], default: str) -> Callable:
    """The launch of form `mode` where `offered` holds it (else `default`), or under "auto" the fastest offered
    form as `choice` times them per key (`default` while timing is not allowed; one form offered: untimed)."""
    if mode != "auto":
        return form(mode if mode in offered else default)
    if len(offered) == 1:
        return form(offered[0])
    return timed_launch(choice, key, {name: form(name) for name in offered}, default)


def timed_launch(choice: TimedChoice, key: tuple, impls: dict[str, Callable], untimed: str) -> Callable:
    """A launch function that runs the implementation `choice` keeps for `key` (timing `impls` on the
    first call's arguments; `untimed` while timing is not allowed)."""
    def launch(*args):
        return choice.choose(key, impls, args, untimed)(*args)
    return launch


def choose_gluon_grid(choice: TimedChoice, key: tuple, grid: Callable[[bool], Callable], pingpong: bool) -> Callable:
    """A plan's launch function for a Gluon forward or backward with both grids (`gluon_persistent_mode`);
    `grid(persistent)` gives the launch on the per-item (False) or the persistent (True) grid. The ping-pong
    schedule runs per item; under "auto" `choice` times the two grids per tuning key and keeps the faster
    ("per_item" while timing is not allowed)."""
    mode = gluon_persistent_mode()
    if pingpong or mode != "auto":
        return grid(mode == "1" and not pingpong)
    return timed_launch(choice, key, {"per_item": grid(False), "persistent": grid(True)}, "per_item")
