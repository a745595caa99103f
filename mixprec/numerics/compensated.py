"""Compensated bfloat16 weights: master-weight strategies that keep no float32 copy.

A policy's ``master`` is a dtype (``"float32"``: classic master copies), None (the optimizer
updates the low-precision weights directly), or one of the strategies named here, which
keep bfloat16 weights only and still do not lose small updates to rounding:

``kahan``
    Each weight ``w`` (bfloat16) has a bfloat16 *compensation* ``c`` of the same shape. A step
    reads the float32 value ``v = float32(w) + float32(c)``, lets the optimizer compute its
    update on ``v`` in float32 (``v' = v + u``), and stores ``w = round_nearest_bf16(v')``,
    ``c = round_nearest_bf16(v' - float32(w))``. The rounding error of the weight is carried
    to the next step instead of being lost, so ``w + c`` holds about 16 significant bits
    (Kahan summation; the optimi library's compensated optimizers). A checkpoint's weights
    are ``float32(w) + float32(c)``, the best value the strategy knows; the optimizer state
    holds ``c`` exactly, and loading restores ``w = round_nearest_bf16(saved - c)``, which is
    the same ``w`` bit for bit (the float32 sum differs from ``w + c`` by far less than half
    a bfloat16 step).

``stochastic``
    Each step computes ``v' = float32(w) + u`` in float32 and stores ``w =
    round_stochastic_bf16(v')``: of the two bfloat16 neighbours of ``v'`` the upper (in
    magnitude) is chosen with probability equal to the distance from the lower one in units
    of the bfloat16 spacing, so the rounding is unbiased and small updates survive on
    average (Zamirai et al., "Revisiting BFloat16 Training"; torchao's bf16 AdamW). In bits:
    add a uniform random integer in ``[0, 2**16)`` to the float32 bit pattern, then clear its
    low 16 bits. The random stream is seeded (``seed`` on wrap, 0 by default), and its state
    is part of the optimizer's checkpoint, so a resumed run draws the same numbers.

Both need bfloat16 params (a float16 compensation would underflow, and float16's narrow
range makes stochastic rounding an overflow hazard); the policy checks that.

Optimizer state in bfloat16 (``state="bfloat16"``)
    Under either strategy the policy item ``state`` may keep the optimizer's per-parameter
    floating state (Adam's ``exp_avg`` and ``exp_avg_sq``, a momentum buffer: every floating
    tensor of a parameter's shape, never the ``step`` counters) in bfloat16 *between*
    steps; None (the default) leaves it as the optimizer allocates it. A step widens each
    state tensor ``s`` exactly to float32, lets the optimizer update it in float32 with the
    weights (``s' = f(s, g)``), and stores ``s = round_stochastic_bf16(s')``, drawn from the
    same seeded random stream as the weights' stochastic rounding (after the weights', so a
    checkpoint of that stream resumes it bit for bit). Stochastic, not nearest: Adam's
    second moment moves by ``(1 - beta2) * (g**2 - v)`` per step, which is below half a
    bfloat16 spacing of ``v`` once ``|g**2 - v| < 2**-8 * v / (1 - beta2)`` (``v / 2`` at
    ``beta2 = 0.999``), so nearest rounding would freeze ``v`` far from ``g**2``;
    unbiased rounding keeps its expected value on the float32 trajectory. With Adam this
    makes weights plus optimizer state 8 bytes per parameter under kahan (2 weight, 2
    compensation, 2 + 2 moments) and 6 under stochastic, against 14 for ``O2-bf16``.
"""

from __future__ import annotations

from typing import Final

from mixprec.dtypes import BFLOAT16, FLOAT32, canonical_dtype
from mixprec.errors import PolicyError, WrapError
from mixprec.numerics.lowbit import describe_lowbit, parse_state_format

__all__ = [
    "KAHAN",
    "MASTER_STRATEGIES",
    "STATE_DTYPES",
    "STOCHASTIC",
    "check_seed",
    "check_state",
    "check_strategy",
    "describe_state",
    "describe_strategy",
    "is_strategy",
]

KAHAN: Final = "kahan"
STOCHASTIC: Final = "stochastic"
#: The compensated master-weight strategies a policy's ``master`` may name.
MASTER_STRATEGIES: tuple[str, ...] = (KAHAN, STOCHASTIC)
#: The dtypes a policy's ``state`` may keep the optimizer state in between steps.
STATE_DTYPES: tuple[str, ...] = (BFLOAT16,)

_DESCRIPTIONS = {
    KAHAN: "bfloat16 weights + bfloat16 Kahan compensation, update computed in float32",
    STOCHASTIC: "bfloat16 weights, float32 update rounded stochastically (seeded)",
}


def is_strategy(master: object) -> bool:
    """True when ``master`` names a compensated strategy (any case), not a dtype or None."""
    return isinstance(master, str) and master.strip().lower() in MASTER_STRATEGIES


def check_strategy(master: str, param: str) -> str:
    """The canonical strategy name, after checking that it fits ``param``.

    :raises PolicyError: ``param`` is not bfloat16.
    """
    name = master.strip().lower()
    if param != BFLOAT16:
        raise PolicyError(
            f"master={name} keeps compensated bfloat16 weights, but param={param}. Use "
            f"param='bfloat16' (preset 'O3-bf16-{'kahan' if name == KAHAN else 'sr'}'), or "
            "master='float32' for classic float32 master copies"
        )
    return name


def describe_strategy(master: str | None) -> str:
    """One line saying what ``master`` keeps, for reports: a strategy, a dtype or none."""
    if master is None:
        return "no master copy: the optimizer updates the params"
    if master in _DESCRIPTIONS:
        return _DESCRIPTIONS[master]
    return f"{master} master copies of the low-precision params"


def check_state(state: object, master: str | None, param: str = "float32") -> str | None:
    """The canonical ``state`` item: None (the optimizer's own dtype), ``"bfloat16"`` or a
    low-bit format (:mod:`mixprec.numerics.lowbit`: ``"int8"``, ``"int4"``, ``"fp8"``,
    with settings in its canonical form).

    :param master: the policy's canonical ``master`` (a strategy, a dtype or None).
    :param param: the policy's canonical ``param`` dtype.
    :raises PolicyError: ``state`` is neither a dtype of :data:`STATE_DTYPES` nor a low-bit
        format; ``"bfloat16"`` without a compensated strategy; a low-bit format where the
        optimizer would not update float32 tensors (low-precision params, no master).
    """
    if state is None or (isinstance(state, str) and state.strip().lower() == "none"):
        return None
    fmt = parse_state_format(state) if isinstance(state, str) else None
    if fmt is not None:
        if master is None and param != FLOAT32:
            raise PolicyError(
                f"state={fmt} quantizes the float32 optimizer state, but with param={param} "
                "and no master the optimizer updates the low-precision params themselves. "
                "Keep float32 masters (master='float32', presets 'O2', 'O2-bf16'), a "
                "compensated strategy ('O3-bf16-kahan', 'O3-bf16-sr') or float32 params "
                f"('O0,state={fmt.name}')"
            )
        return str(fmt)
    try:
        dtype = canonical_dtype(state)
    except (ValueError, TypeError):  # PolicyError and friends: reworded below
        dtype = None
    if dtype not in STATE_DTYPES:
        raise PolicyError(
            f"state={state!r} is not a format the optimizer state can be kept in; use "
            f"state='int8', 'int4' or 'fp8' (quantized, under any master strategy), "
            "state='bfloat16' (with master=kahan or master=stochastic) or state=None "
            "(as the optimizer allocates it)"
        )
    if master not in MASTER_STRATEGIES:
        raise PolicyError(
            f"state={dtype} keeps the optimizer state in bfloat16 between steps, which only "
            f"the compensated strategies support, but master={master}. Use master='kahan' "
            "or 'stochastic' (presets 'O3-bf16-kahan,state=bfloat16', "
            "'O3-bf16-sr,state=bfloat16'), a low-bit format (state='int8'), or drop state"
        )
    return dtype


def describe_state(state: str | None) -> str:
    """One line saying how the optimizer state is kept between steps, for reports."""
    if state is None:
        return "as the optimizer allocates it"
    fmt = parse_state_format(state)
    if fmt is not None:
        return describe_lowbit(fmt)
    return f"{state} between steps (stochastic rounding, seeded), float32 inside step()"


def check_seed(seed: object) -> int:
    """The ``seed`` a backend's ``wrap``/``Trainer`` was given, checked before anything
    changes: it seeds the stochastic rounding (``master=stochastic``, ``state="bfloat16"``).

    :raises WrapError: not a non-negative int.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise WrapError(
            f"seed must be a non-negative int (it seeds master=stochastic's rounding), got "
            f"{seed!r}; pass e.g. seed=0"
        )
    return seed
