"""The conformance tests. Collected by :mod:`mixprec.testing.pytest_plugin`, never directly.

Each test receives ``backend`` (a :class:`~mixprec.testing.cases.BackendUnderTest`) and
the parameters its ``@cases`` generator lists. Test ids, minus the leading backend name,
are what ``conformance_xfail.txt`` lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

import pytest

from mixprec.errors import MixprecError
from mixprec.numerics.loss_scale import DynamicScale, LossScale
from mixprec.policy.ops import OP_FAMILIES
from mixprec.testing.cases import (
    OVERFLOW_SEQUENCE,
    BackendUnderTest,
    cases,
    classic_trainer_cases,
    computing_in,
    listed_dtype_cases,
    no_cases,
    op_cases,
    policy,
    refused_lowbit_cases,
    refused_state_cases,
    saved_dtype_cases,
    state_cases,
    strategy_cases,
    trace_cases,
    trainer_cases,
    unlisted_dtype_cases,
    unseen_op_cases,
)
from mixprec.testing.floats import round_to
from mixprec.testing.fp8 import (
    FP8_DATA,
    FP8Quantiser,
    fp8_operand_cases,
    fp8_refused_cases,
    reference_quantise,
)
from mixprec.testing.lowbit import (
    LowBitQuantiser,
    lowbit_codec_cases,
    lowbit_data,
    reference_lowbit,
)
from mixprec.testing.protocol import ConformanceTrainer

Values = Mapping[str, list[float]]


def _trainer(backend: BackendUnderTest, policy_name: str, seed: int = 0) -> ConformanceTrainer:
    assert backend.adapter is not None
    return backend.adapter.make_trainer(policy(policy_name), seed=seed)


def _bits(values: list[float]) -> list[str]:
    # compare floats bit for bit: NaN == NaN, and -0.0 != 0.0
    return [float(v).hex() for v in values]


def _differences(expected: Values, actual: Values) -> list[str]:
    if set(expected) != set(actual):
        return [f"names differ: {sorted(expected)} vs {sorted(actual)}"]
    out = []
    for name in sorted(expected):
        want, got = _bits(expected[name]), _bits(actual[name])
        if want != got:
            bad = [i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b]
            first = bad[0] if bad else min(len(want), len(got))
            out.append(
                f"{name}: {len(bad) or 'length'} element(s) differ, first at [{first}]: "
                f"{expected[name][first : first + 1]} vs {actual[name][first : first + 1]}"
            )
    return out


def _assert_same(expected: Values, actual: Values, what: str) -> None:
    diffs = _differences(expected, actual)
    assert not diffs, f"{what} changed:\n  " + "\n  ".join(diffs)


# ------------------------------------------------------------------------------------------
# The backend loads, and reports what it can do
# ------------------------------------------------------------------------------------------


@cases(no_cases)
def test_backend_builds(backend: BackendUnderTest) -> None:
    """The backend was asked for, so it must load: a missing one fails, never skips."""
    if backend.error is not None:
        pytest.fail(
            f"mixprec backend {backend.name!r} was requested but could not be built "
            f"(load_backend, capabilities() or conformance_adapter() failed):\n{backend.error}",
            pytrace=False,
        )


@cases(no_cases)
def test_capabilities_describe_the_device(backend: BackendUnderTest) -> None:
    """capabilities() names the backend and lists float32 for the adapter's device."""
    caps = backend.capabilities
    assert caps is not None and caps.backend == backend.name
    device = backend.device_capability
    assert "float32" in backend.compute_dtypes, f"{device.device} must list float32"
    assert set(device.fast_dtypes) <= set(device.compute_dtypes), (
        f"fast_dtypes {device.fast_dtypes} must be among compute_dtypes {device.compute_dtypes}"
    )
    preferred = caps.preferred_lowp(backend.device)
    assert preferred is None or preferred in device.fast_dtypes
    unseen = {entry.op for entry in caps.unseen_ops}
    assert unseen <= set(OP_FAMILIES), (
        f"unseen_ops outside OP_FAMILIES: {unseen - set(OP_FAMILIES)}"
    )
    both = unseen & set(backend.ops())
    assert not both, f"ops both supported and declared unseen: {sorted(both)}"


@cases(listed_dtype_cases, ("dtype",))
def test_listed_dtype_computes_linear(backend: BackendUnderTest, dtype: str) -> None:
    """Every dtype the device lists can run a linear layer, in that dtype (or, where the
    backend declares that the machine has no such kernel, as a float32 island)."""
    assert backend.adapter is not None
    expected = backend.expected_dtype("linear", dtype)
    assert backend.adapter.op_dtype(policy(computing_in(dtype)), "linear", dtype) == expected


@cases(unlisted_dtype_cases, ("dtype",))
def test_unlisted_dtype_is_refused(backend: BackendUnderTest, dtype: str) -> None:
    """A dtype the device does not list is refused with a MixprecError (preferably
    UnsupportedDtypeError) when an op or a trainer asks for it, not run badly."""
    assert backend.adapter is not None
    chosen = policy(computing_in(dtype))
    with pytest.raises(MixprecError):
        backend.adapter.op_dtype(chosen, "linear", "float32")
    with pytest.raises(MixprecError):
        backend.adapter.make_trainer(chosen)


# ------------------------------------------------------------------------------------------
# Every op family runs in the dtype Policy.decide gives
# ------------------------------------------------------------------------------------------


@cases(op_cases, ("policy_name", "op"))
def test_op_dtype_matches_decide(backend: BackendUnderTest, policy_name: str, op: str) -> None:
    """For each input dtype the device lists, the op computes in ``policy.decide``'s dtype
    (and is refused where the policy bans it)."""
    assert backend.adapter is not None
    chosen = policy(policy_name)
    classes = backend.op_module_class(op)  # a backend whose op is a module: its class rules
    wrong = []
    for input_dtype in backend.compute_dtypes:
        try:
            expected = chosen.decide(op, (input_dtype,), module_class=classes).dtype
        except MixprecError:  # banned: the backend must refuse too
            try:
                got = backend.adapter.op_dtype(chosen, op, input_dtype)
            except MixprecError:
                continue
            wrong.append(f"inputs {input_dtype}: ran in {got}, but the policy bans {op!r}")
            continue
        expected = backend.expected_dtype(op, expected)
        got = backend.adapter.op_dtype(chosen, op, input_dtype)
        if got != expected:
            why = chosen.explain(op, (input_dtype,), module_class=classes)
            wrong.append(
                f"inputs {input_dtype}: ran in {got}, policy.decide says {expected}\n    {why}"
            )
    assert not wrong, f"{op} under {policy_name}:\n  " + "\n  ".join(wrong)


@cases(unseen_op_cases, ("op",))
def test_rules_on_unseen_ops_are_refused(backend: BackendUnderTest, op: str) -> None:
    """A backend that cannot see an op (``capabilities().unseen_ops``: JAX's ``x + y``)
    refuses a policy that casts it, globally or inside a module rule, instead of silently
    running what the framework does natively (:mod:`mixprec.engine.visibility`)."""
    assert backend.adapter is not None
    base = policy("O0")
    for chosen in (
        base.with_ops(fp32=[op]),
        base.with_module("*", match="path", ops={op: "fp32"}),
    ):
        with pytest.raises(MixprecError):
            backend.adapter.make_trainer(chosen)


# ------------------------------------------------------------------------------------------
# Loss scaling: the same trace as the core state machine; a skipped step changes nothing
# ------------------------------------------------------------------------------------------


@cases(trace_cases, ("policy_name",))
def test_scaler_trace_matches_core(backend: BackendUnderTest, policy_name: str) -> None:
    """For a fixed overflow sequence, the loss scale and skip count after every step equal
    those of the policy's loss-scale state machine driven directly."""
    chosen = policy(policy_name)
    trainer = _trainer(backend, policy_name)
    state: LossScale = chosen.loss_scale
    expected, actual = [], []
    skipped = 0
    assert trainer.loss_scale() == state.scale, "the first step must use the initial scale"
    for step, overflow in enumerate(OVERFLOW_SEQUENCE):
        loss = trainer.step(inject_inf=overflow)
        assert overflow or math.isfinite(loss), f"step {step}: the loss itself is {loss}"
        state = state.update(overflow).state
        skipped += overflow
        expected.append((step, overflow, state.scale, skipped))
        actual.append((step, overflow, trainer.loss_scale(), trainer.skipped_steps()))
    assert actual == expected, "(step, injected inf, loss scale, skipped steps) differ:\n" + (
        "\n".join(
            f"  backend {a}\n  core    {e}" for a, e in zip(actual, expected, strict=True) if a != e
        )
    )


@cases(trainer_cases, ("policy_name",))
def test_skipped_step_leaves_state_untouched(backend: BackendUnderTest, policy_name: str) -> None:
    """A step with an inf gradient changes no weight, master or optimizer state; the next
    finite step does."""
    trainer = _trainer(backend, policy_name)
    for _ in range(3):
        trainer.step()
    before = (trainer.params(), trainer.master_params(), trainer.optimizer_state())
    assert before[2], "optimizer_state() is empty: use a stateful optimizer (momentum, Adam)"
    skipped = trainer.skipped_steps()
    trainer.step(inject_inf=True)
    assert trainer.skipped_steps() == skipped + 1
    _assert_same(before[0], trainer.params(), "model params")
    _assert_same(before[1], trainer.master_params(), "master params")
    _assert_same(before[2], trainer.optimizer_state(), "optimizer state")
    trainer.step()
    assert _differences(before[1], trainer.master_params()), "a finite step changed nothing"


# ------------------------------------------------------------------------------------------
# Master weights and checkpoints
# ------------------------------------------------------------------------------------------


@cases(classic_trainer_cases, ("policy_name",))
def test_masters_are_exact(backend: BackendUnderTest, policy_name: str) -> None:
    """Each model param equals its float32 master rounded to the param's dtype, and the
    masters keep more precision than the params (they are not upcast low-precision values)."""
    chosen = policy(policy_name)
    trainer = _trainer(backend, policy_name)
    for _ in range(4):
        trainer.step()
    params, masters = trainer.params(), trainer.master_params()
    assert set(params) == set(masters), f"{sorted(params)} vs {sorted(masters)}"
    if not chosen.uses_masters:
        _assert_same(params, masters, "params without masters vs master_params()")
        return
    assert chosen.master == "float32"
    off_grid = 0
    for name, master in masters.items():
        rounded = [round_to(chosen.param, m) for m in master]
        assert [round_to("float32", m) for m in master] == master, f"{name}: master not float32"
        if params[name] == master:  # a float32 param (a pinned module) is its own master
            continue
        assert not _differences({name: rounded}, {name: params[name]}), (
            f"{name}: the model param is not its master rounded to {chosen.param}"
        )
        off_grid += rounded != master
    assert off_grid, f"every master is representable in {chosen.param}: masters look upcast"


@cases(strategy_cases, ("policy_name",))
def test_compensated_weights_round_to_the_params(
    backend: BackendUnderTest, policy_name: str
) -> None:
    """Under ``master=kahan`` ``master_params()`` reports ``w + c`` (float32), which rounds
    to nearest onto the bfloat16 param and keeps bits the param cannot; under
    ``master=stochastic`` it is the bfloat16 param itself, and the params stay on the
    bfloat16 grid (:mod:`mixprec.numerics.compensated`)."""
    chosen = policy(policy_name)
    trainer = _trainer(backend, policy_name)
    for _ in range(4):
        trainer.step()
    params, best = trainer.params(), trainer.master_params()
    assert set(params) == set(best), f"{sorted(params)} vs {sorted(best)}"
    for name, values in params.items():
        on_grid = [round_to("bfloat16", v) for v in values]
        assert not _differences({name: on_grid}, {name: values}), f"{name}: not bfloat16"
    if chosen.master_strategy == "stochastic":
        _assert_same(params, best, "params vs master_params() under master=stochastic")
        return
    off_grid = 0
    for name, values in best.items():
        rounded = [round_to("bfloat16", v) for v in values]
        assert not _differences({name: rounded}, {name: params[name]}), (
            f"{name}: the param is not weight + compensation rounded to bfloat16"
        )
        off_grid += rounded != values
    assert off_grid, "weight + compensation is on the bfloat16 grid: no compensation kept"


@cases(state_cases, ("policy_name",))
def test_bfloat16_state_stays_on_the_grid(backend: BackendUnderTest, policy_name: str) -> None:
    """Under ``state=bfloat16`` every optimizer state value is a bfloat16 value between
    steps, and the state still moves step after step: the update runs in float32 and is
    rounded stochastically, not to nearest (:mod:`mixprec.numerics.compensated`)."""
    trainer = _trainer(backend, policy_name)
    for _ in range(3):
        trainer.step()
    before = trainer.optimizer_state()
    assert before, "optimizer_state() is empty: use a stateful optimizer (momentum, Adam)"
    for name, values in before.items():
        on_grid = [round_to("bfloat16", v) for v in values]
        assert not _differences({name: on_grid}, {name: values}), f"{name}: not bfloat16"
    trainer.step()
    assert _differences(before, trainer.optimizer_state()), "a step left the state as it was"


@cases(refused_state_cases, ("policy_name",))
def test_unsupported_state_dtype_is_refused(backend: BackendUnderTest, policy_name: str) -> None:
    """A backend that does not declare ``"bfloat16"`` in ``state_dtypes`` refuses
    ``state=bfloat16`` with a MixprecError instead of silently keeping float32 state."""
    with pytest.raises(MixprecError):
        _trainer(backend, policy_name)


@cases(refused_lowbit_cases, ("policy_name",))
def test_unsupported_lowbit_state_is_refused(backend: BackendUnderTest, policy_name: str) -> None:
    """A backend whose ``state_dtypes`` does not list a low-bit format refuses a policy that
    names it with a MixprecError instead of silently keeping float32 state."""
    with pytest.raises(MixprecError):
        _trainer(backend, policy_name)


@cases(lowbit_codec_cases, ("state", "signed", "data"))
def test_lowbit_codes_match_the_reference(
    backend: BackendUnderTest, state: str, signed: bool, data: str
) -> None:
    """The backend's low-bit codec gives the codes (packed as it stores them), the block
    absmax and the decoded values of :mod:`mixprec.numerics.lowbit`'s scheme bit for bit:
    short last blocks, all-zero blocks, exact ties on the midpoints (the lower code),
    subnormal and huge values."""
    assert backend.adapter is not None
    values = lowbit_data(data, state, signed)
    want_codes, want_absmax, want_decoded = reference_lowbit(state, signed, values)
    quantiser = cast("LowBitQuantiser", backend.adapter)
    got_codes, got_absmax, got_decoded = quantiser.lowbit_quantize(state, signed, values)
    codes = {"codes": [float(c) for c in want_codes]}
    _assert_same(codes, {"codes": [float(c) for c in got_codes]}, f"{state} codes")
    _assert_same({"absmax": want_absmax}, {"absmax": list(got_absmax)}, f"{state} absmax")
    _assert_same({"decoded": want_decoded}, {"decoded": list(got_decoded)}, f"{state} values")


@cases(trainer_cases, ("policy_name",))
def test_checkpoint_resumes_bit_identical(backend: BackendUnderTest, policy_name: str) -> None:
    """Restoring a checkpoint into a fresh trainer and continuing gives bit-identical
    params, masters, optimizer state, loss scale and skip count to never stopping."""
    if isinstance(policy(policy_name).loss_scale, DynamicScale):
        policy_name += "+trace"  # a small interval, so the scaler state moves within the test
    original = _trainer(backend, policy_name)
    for overflow in (False, True, False, False, False):
        original.step(inject_inf=overflow)
    blob = original.checkpoint()
    resumed = _trainer(backend, policy_name)
    resumed.restore(blob)

    def compare(when: str) -> None:
        for what, read in (
            ("params", lambda t: t.params()),
            ("masters", lambda t: t.master_params()),
            ("optimizer state", lambda t: t.optimizer_state()),
            ("loss scale", lambda t: {"": [t.loss_scale()]}),
            ("skipped steps", lambda t: {"": [float(t.skipped_steps())]}),
        ):
            _assert_same(read(original), read(resumed), f"{what} {when} ({policy_name})")

    compare("right after restore")
    for overflow in (False, True, False, False):
        losses = [original.step(inject_inf=overflow), resumed.step(inject_inf=overflow)]
        assert len(set(_bits(losses))) == 1, f"losses differ after resuming: {losses}"
    compare("after resuming")


@cases(saved_dtype_cases, ("policy_name",))
def test_saved_params_are_float32(backend: BackendUnderTest, policy_name: str) -> None:
    """The saved model file holds float32 values (the masters), whatever the param dtype."""
    trainer = _trainer(backend, policy_name)
    trainer.step()
    assert trainer.saved_param_dtypes() == {"float32"}


# ------------------------------------------------------------------------------------------
# FP8: the quantised operands equal the reference; other recipes are refused
# ------------------------------------------------------------------------------------------


@cases(fp8_operand_cases, ("recipe", "fmt", "data", "scale"))
def test_fp8_operands_match_the_reference(
    backend: BackendUnderTest, recipe: str, fmt: str, data: str, scale: float | None
) -> None:
    """The backend's FP8 operand (format values and scales) equals
    :mod:`mixprec.numerics.fp8.recipes`'s arithmetic bit for bit: saturation, subnormals, ties
    to even, NaN for non-finite values, mxfp8's short last block."""
    assert backend.adapter is not None
    rows = FP8_DATA[data]
    want_q, want_s = reference_quantise(rows, recipe, fmt, scale)
    got_q, got_s = cast("FP8Quantiser", backend.adapter).fp8_quantise(recipe, fmt, rows, scale)
    _assert_same({"scales": want_s}, {"scales": list(got_s)}, f"{recipe} scales")
    want = {f"row {i}": row for i, row in enumerate(want_q)}
    _assert_same(want, {f"row {i}": list(r) for i, r in enumerate(got_q)}, f"{recipe} values")


@cases(fp8_refused_cases, ("policy_name",))
def test_unlisted_fp8_recipe_is_refused(backend: BackendUnderTest, policy_name: str) -> None:
    """An FP8 recipe the device does not list is refused with a MixprecError (preferably
    UnsupportedDtypeError), never trained as if the fp8 item were not there."""
    with pytest.raises(MixprecError):
        _trainer(backend, policy_name)


# ------------------------------------------------------------------------------------------
# The backend's own list of known gaps
# ------------------------------------------------------------------------------------------


@cases(no_cases)
def test_xfail_file_is_current(backend: BackendUnderTest) -> None:
    """Every entry of conformance_xfail.txt names at least one test of this suite."""
    stale = [
        f"line {e.line}: {e.pattern}"
        for e in backend.xfails
        if not any(e.matches(test_id) for test_id in backend.test_ids)
    ]
    assert not stale, f"{backend.xfail_file} lists tests that do not exist:\n  " + "\n  ".join(
        stale
    )
