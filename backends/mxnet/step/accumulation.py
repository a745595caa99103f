"""Gradient accumulation (``grad_req='add'``) and ``zero_grad`` under mixprec's casts.

Gluon accumulates with ``grad_req='add'`` on the parameters, several backward passes and one
``trainer.step``. Under the policies that keep parameters in low precision (O2-bf16, and
O3-bf16 and its compensated presets, which update float32 working values) MXNet would add
each backward's gradient into the bfloat16 gradient buffer: a sum in bfloat16, or none at
all where the gradient comes through ``amp_cast`` (a float32 island). :class:`Accumulation`
takes the sum in float32 instead, in the masters' gradient buffers:

- before each recorded forward pass of the net the accumulating parameters are marked
  ``'write'`` for MXNet (``Parameter.grad_req`` still says ``'add'``; MXNet reads the mark
  when it records, so it must come before the forward), so each backward writes its own
  bfloat16 gradient;
- at ``scale_loss`` exit each fresh bfloat16 gradient is added, in float32, into the master's
  gradient (one ``amp_cast`` and one add per parameter and micro-batch) and marked used;
- ``step`` reads the masters' sums (instead of casting the model's gradients into them);
- ``net.collect_params().zero_grad()`` (and ``Parameter.zero_grad``) clears the masters'
  gradients with the model's.

So two micro-batches give exactly the float32 sum of their two bfloat16 gradients, which is
what the float32 Trainer accumulates up to the bfloat16 rounding of each micro-batch's
gradient. A backward outside ``scale_loss`` cannot be seen in time: ``step`` refuses it
(:class:`~mixprec.errors.StepOrderError` naming ``scale_loss``) before anything changes, as
it refuses ``'add'`` on some parameters and ``'write'`` on others.

Two MXNet 1.9 facts shape accumulation under mixprec's casts:

- ``amp_cast``'s backward ignores ``req=kAddTo``: a parameter that reaches the graph through
  an ``amp_cast`` (every parameter O1's graph pass casts to low precision) gets a gradient of
  exactly zero under ``grad_req='add'`` (MXNet's own ``amp.convert_hybrid_block`` has the same
  bug). O1's graph pass feeds such parameters through an ``identity`` node
  (:func:`mixprec_mxnet.o1.graph.protect_accumulation`), whose backward accumulates
  correctly; the ``amp_cast`` then writes into an internal buffer.
- ``ndarray.reset_arrays``, which ``ParameterDict.zero_grad`` calls, has no bfloat16 kernel
  (``Unknown type enum 12`` at the next step). :func:`install_zero_grad` makes
  ``ParameterDict.zero_grad`` zero bfloat16 gradients with ``zeros_like`` and hands every
  other array to MXNet's own method unchanged. With ``Parameter.zero_grad`` these are the
  class-level patches of the backend: ``collect_params()`` builds a new ``ParameterDict`` on
  every call, so there is no instance to patch.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from mxnet import autograd, gluon, nd

from mixprec.errors import StepOrderError, WrapError
from mixprec.kit import BFLOAT16, FLOAT32, is_low_precision

from ..dtypes import cast, dtype_name, mx_dtype
from ..gluon_private import consume_fresh_grad, has_fresh_grad, has_grad

__all__ = ["Accumulation", "GradEdits", "check_grad_req", "install_zero_grad"]

_BF16 = mx_dtype(BFLOAT16)

#: model parameter -> its separate master, for ``zero_grad`` (weak: a dropped Trainer's
#: parameters leave it).
_MASTERS: weakref.WeakKeyDictionary[gluon.Parameter, gluon.Parameter] = weakref.WeakKeyDictionary()


def check_grad_req(plan: Iterable[tuple[gluon.Parameter, str]], policy_label: str) -> None:
    """Refuse ``grad_req='add'`` on some trainable parameters and ``'write'`` on others where
    the policy keeps parameters in low precision (each step reads either every master's sum
    or every model gradient; a mixture is nearly always a forgotten parameter)."""
    plan = list(plan)
    if not any(is_low_precision(dtype) for _, dtype in plan):
        return
    reqs = {p.name: p.grad_req for p, _ in plan if p.grad_req != "null"}
    added = [n for n, req in reqs.items() if req == "add"]
    written = [n for n, req in reqs.items() if req == "write"]
    if added and written:
        raise WrapError(
            f"grad_req='add' on {', '.join(added[:3])} but 'write' on "
            f"{', '.join(written[:3])}: under policy {policy_label} mixprec accumulates in "
            "float32 for every parameter or for none. Set it on all of them, "
            "net.collect_params().setattr('grad_req', 'add'), or on none"
        )


class Accumulation:
    """The float32 sums of ``grad_req='add'`` for the parameters a Trainer keeps in low
    precision (see the module docstring)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[gluon.Parameter, gluon.Parameter]] = []
        self._added: set[int] = set()  # ids of model data whose gradients went into masters
        self.edits = GradEdits()  # the user's edits after allreduce_grads()

    def track(self, pairs: Iterable[tuple[gluon.Parameter, gluon.Parameter]]) -> None:
        """The (model parameter, separate float32 master) pairs, once the masters exist."""
        self.pairs = [
            (p, m) for p, m in pairs if m is not p and is_low_precision(dtype_name(p.dtype))
        ]
        for param, master in self.pairs:
            _MASTERS[param] = master

    def accumulating(self) -> list[tuple[gluon.Parameter, gluon.Parameter]]:
        """The tracked pairs whose parameter has ``grad_req='add'`` now."""
        return [(p, m) for p, m in self.pairs if p.grad_req == "add"]

    def before_forward(self) -> None:
        """Have MXNet write, not add, the low-precision gradients of the forward pass about
        to be recorded."""
        for param, _ in self.accumulating():
            autograd.mark_variables(param.list_data(), param.list_grad(), "write")

    def after_backward(self) -> None:
        """Add each fresh low-precision gradient, in float32, into its master's gradient
        (not recorded: ``scale_loss`` usually exits inside ``autograd.record()``)."""
        with autograd.pause():
            for param, master in self.accumulating():
                for data, grad, total in zip(
                    param.list_data(), param.list_grad(), master.list_grad(), strict=True
                ):
                    if has_fresh_grad(data):
                        nd.elemwise_add(total, cast(grad, FLOAT32), out=total)
                        consume_fresh_grad(data)
                        self._added.add(id(data))

    def added(self, data: nd.NDArray) -> bool:
        """Whether ``data``'s gradient went into its master's sum since the last step."""
        return id(data) in self._added

    def check(self, params: Sequence[gluon.Parameter], policy_label: str) -> None:
        """Before a step: refuse a mixture of ``'add'`` and ``'write'``, and accumulating
        gradients that a backward outside ``scale_loss`` wrote (nothing changes)."""
        check_grad_req([(p, dtype_name(p.dtype)) for p in params], policy_label)
        missed = [
            p.name
            for p, _ in self.accumulating()
            if any(has_fresh_grad(data) for data in p.list_data())
        ]
        if missed:
            raise StepOrderError(
                f"grad_req='add' on {', '.join(missed[:3])}: under policy {policy_label} "
                "mixprec sums the micro-batches' gradients in float32 as each backward "
                "leaves trainer.scale_loss(loss), but a backward ran outside it. Write "
                "`with trainer.scale_loss(loss) as scaled: autograd.backward(scaled)` for "
                "every micro-batch (then zero_grad() and accumulate again)"
            )

    def stepped(self) -> None:
        """The step read the sums: the next ones start their own record."""
        self._added.clear()
        self.edits.clear()


class GradEdits:
    """Edits of the model's gradients between ``allreduce_grads()`` and ``update()``.

    ``gluon.Trainer`` sums the gradients in place, so after ``allreduce_grads()`` the user's
    ``param.grad()`` holds what ``update()`` applies: zeroing it, clipping it by hand or
    writing an inf into it is how Gluon users edit a step. Under a policy with separate
    float32 masters the step applies the masters' gradients, so such an edit used to be
    neither checked nor applied (issue 37). Now the Trainer's explicit ``allreduce_grads()``
    (and ``unscale()``) :meth:`publish` the masters' reduced gradients into the model's
    gradients (rounded to their dtype, as the model sees them) and keep a float32 copy of
    what they wrote; :meth:`take` then finds every element the user changed since and writes
    it into the master's gradient, so the overflow check sees it (an inf skips the step) and
    the update applies it. Elements the user left alone keep the master's float32 value, and
    an edit of ``trainer.master_grads()`` (the documented clipping path) is kept as it is.

    Cost: on the explicit path only (``trainer.step()`` reduces inside the step and publishes
    nothing): one cast and one copy per gradient at publish, a cast, a comparison and a
    ``where`` per gradient at take.
    """

    def __init__(self) -> None:
        self._published: list[tuple[nd.NDArray, nd.NDArray, nd.NDArray]] = []

    def publish(self, pairs: Iterable[tuple[gluon.Parameter, gluon.Parameter]]) -> None:
        """Write each separate master's gradient into its model gradient (every context)."""
        self._published = []
        with autograd.pause():
            for param, master in pairs:
                if master is param:
                    continue
                for grad, total in zip(param.list_grad(), master.list_grad(), strict=True):
                    if grad is total:
                        continue
                    nd.amp_cast(total, dtype=grad.dtype, out=grad)
                    self._published.append((grad, cast(grad, FLOAT32).copy(), total))

    def take(self) -> None:
        """Move the user's edits of the published model gradients into the masters'."""
        with autograd.pause():
            for grad, written, total in self._published:
                now = cast(grad, FLOAT32)
                changed = now != written  # an inf, a NaN, a zero, a clipped value
                if total.dtype == now.dtype:
                    nd.where(changed, now, total, out=total)
                else:  # a low-precision master gradient (O3: no float32 masters)
                    merged = nd.where(changed, now, cast(total, FLOAT32))
                    nd.amp_cast(merged, dtype=total.dtype, out=total)
        self._published = []

    def clear(self) -> None:
        """Forget what was published (the step read the masters)."""
        self._published = []


def _zero_masters(params: Iterable[gluon.Parameter]) -> None:
    for param in params:
        master = _MASTERS.get(param)
        if master is not None and has_grad(master):
            for grad in master.list_grad():
                nd.zeros_like(grad, out=grad)


def _zero_grad(original: Any, self: gluon.ParameterDict) -> None:
    rest = False
    params = list(self.values())
    for param in params:
        if param.grad_req == "null" or not has_grad(param):
            continue
        if dtype_name(param.dtype) == BFLOAT16:
            for grad in param.list_grad():
                nd.zeros_like(grad, out=grad)
        else:
            rest = True
    _zero_masters(params)
    if rest:
        original(_WithoutBfloat16(self))


class _WithoutBfloat16:
    """A view of a ``ParameterDict`` whose ``values()`` leave out bfloat16 parameters."""

    def __init__(self, params: gluon.ParameterDict) -> None:
        self._params = params

    def values(self) -> list[gluon.Parameter]:
        return [p for p in self._params.values() if dtype_name(p.dtype) != BFLOAT16]


def install_zero_grad() -> None:
    """Make ``ParameterDict.zero_grad`` handle bfloat16 gradients, and it and
    ``Parameter.zero_grad`` clear the masters' gradients too (once per process)."""
    current = gluon.ParameterDict.zero_grad
    if getattr(current, "_mixprec", False):
        return

    def zero_grad(self: gluon.ParameterDict) -> None:
        _zero_grad(current, self)

    zero_grad.__doc__ = current.__doc__
    zero_grad._mixprec = True  # type: ignore[attr-defined]
    gluon.ParameterDict.zero_grad = zero_grad  # type: ignore[method-assign]

    one = gluon.Parameter.zero_grad

    def zero_one_grad(self: gluon.Parameter) -> None:
        one(self)
        _zero_masters([self])

    zero_one_grad.__doc__ = one.__doc__
    gluon.Parameter.zero_grad = zero_one_grad  # type: ignore[method-assign]
