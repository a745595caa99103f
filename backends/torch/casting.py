"""Parameter and boundary casting (O2/O3), module islands, and the hooks of a wrapped model.

For each module of a wrapped model, :func:`plan_model` decides once, at wrap time:

- its *dtype*: the dtype a module rule pins it to (``Policy.module_dtype``), else the dtype
  of its parent (a pin covers everything inside the module), else ``policy.param`` at the
  root. Its own parameters and floating buffers are cast to that dtype in place
  (``param.data = ...``), so the ``Parameter`` objects (and what optimizers, DDP and tied
  modules hold) stay the same;
- whether it is an *island*: pinned to a dtype. Its forward pre-hook casts floating inputs to
  the pinned dtype and turns autocast off inside it; its post-hook turns autocast back on
  and, when no autocast runs around it (O2/O3), casts floating outputs back to the dtype
  around it. So a float32 BatchNorm in an O2 float16 network receives float32 and hands
  float16 to the next layer, in train and in eval mode;
- whether it pushes a decision context (it matches a module rule, and the op-casting mode is
  on) so ``Policy.decide`` sees the module an op runs in.

The root gets the *boundary*: floating inputs are cast to the root's dtype when that is a
low-precision dtype (O2/O3), the op-casting region (:mod:`mixprec_torch.autocast`) runs
around the forward, and floating outputs are cast to ``policy.output``.

The modules a user may call on their own (the root's children, and every module that
holds others: ``model.encoder``, ``model.encoder.layer[3]``, ``self.net``) get an *entry*
where they would run differently without that boundary (all of them under O1's op casting;
those whose parameters are low precision under O2/O3). When such a module
is called from outside the model's forward (``model.encoder(x)``, ``self.net(x)`` in a
LightningModule's ``training_step``), it opens the
same region, pushes its nearest ruled ancestor's decision context, turns autocast off under
a pinned ancestor, casts its inputs to its own dtype and its outputs to ``policy.output``,
exactly as the root would. Inside the model's forward an entry reads one counter
(:attr:`ModelCasting.depth`) and, when its parameters are low precision, casts a float32
input the model made itself (a positional encoding cached in ``forward``, a float mask) to
their dtype: under O2 such a tensor would otherwise meet them in a matmul and fail. Called
during backward (``torch.utils.checkpoint`` recomputing it, :mod:`mixprec_torch.recompute`),
an entry opens the same region and casts as inside the forward. A hooked module takes
PyTorch's slower call path (measured on this CPU: 2.5 µs a call without hooks, 8.3 µs with
an entry's two), so leaves deeper down (a single ``Linear`` inside a block, most of a
model's modules) get no entry: such a leaf called on its own runs as PyTorch runs it.

Every hook is a bound method of a :class:`ModelCasting` stored on the model, so
``copy.deepcopy(model)`` copies hooks and plan consistently; pickling them raises
:class:`~mixprec.errors.CheckpointError` (:mod:`mixprec_torch.copies`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch import nn

from mixprec.dtypes import is_low_precision
from mixprec.policy import Policy

from .autocast import DecisionContext, OpCasting, context_stack, disable_autocast, recomputation
from .copies import CopyOnly
from .dtypes import cast_floating, holds_wide_float, torch_dtype
from .param_dtypes import apply_param_dtypes, lowp_param, planned_dtypes, recast_error
from .reentrant import ReentrantCheck, plain_function_context
from .sites import ModuleSite, class_names, plan_model
from .torch_private import in_backward
from .tracing import TracedForward

__all__ = ["ModelCasting", "ModuleSite", "cast_floating", "class_names", "plan_model"]


class _HooksLocal(threading.local):
    def __init__(self) -> None:
        # (module, undo steps) per running forward with hooks, innermost last
        self.stack: list[tuple[nn.Module, list[Any]]] = []


_hooks_local = _HooksLocal()


class ModelCasting(CopyOnly):
    """The casting plan of one wrapped model, and its forward hooks.

    :param model: the root module.
    :param policy: the resolved policy.
    :param casting: the op-casting plan (None when no op is cast).
    :param cast_params: whether parameters and boundaries follow the plan (False under FSDP2,
        which casts parameters and boundaries itself).
    """

    def __init__(
        self,
        model: nn.Module,
        policy: Policy,
        casting: OpCasting | None,
        *,
        cast_params: bool = True,
    ) -> None:
        self.policy = policy
        self.casting: OpCasting | None = None
        self.set_op_casting(casting)
        self.sites = plan_model(model, policy)
        self.cast_params = cast_params
        self.output_dtype = torch_dtype(policy.output)
        root = self.sites[0]
        self.input_dtype = (
            torch_dtype(root.dtype) if cast_params and is_low_precision(root.dtype) else None
        )
        self._handles: list[Any] = []
        self._traced: list[tuple[nn.Module, TracedForward, Any]] = []
        self._sentinel: tuple[str, nn.Parameter, torch.dtype] | None = None
        self.reentrant = ReentrantCheck(policy.label)
        """Repairs (or warns about) plain functions under reentrant checkpointing."""
        self._plain: tuple[bool, DecisionContext | None] = (False, None)
        """(known, context) of the forward's plain functions: set by :meth:`install`."""
        self.depth = 0
        """Forwards of this model running now, through the root or an entry (an int, not a
        thread-local: a wrapped model trains on one thread, and a copy must deep-copy)."""

    def set_op_casting(self, casting: OpCasting | None) -> None:
        """Use ``casting`` for the forward's op-casting region (None or inactive: no region)."""
        self.casting = casting if casting is not None and casting.active else None

    def planned_dtype(self) -> dict[int, str]:
        """id(param) -> the dtype the plan gives it (every floating parameter)."""
        return planned_dtypes(self.sites)

    def apply_param_dtypes(self) -> None:
        """Cast each module's own parameters (and their grads) and floating buffers in place."""
        if self.cast_params:
            apply_param_dtypes(self.sites)

    # ------------------------------------------------------------------ hooks

    @property
    def autocast_on(self) -> bool:
        return self.casting is not None and self.casting.autocast is not None

    @property
    def mode_on(self) -> bool:
        return self.casting is not None and bool(self.casting.table)

    def is_island(self, site: ModuleSite) -> bool:
        """Pinned, and either autocast runs around it or its params differ from around it."""
        return site.pin is not None and (
            self.autocast_on or (self.cast_params and site.pin != site.outer)
        )

    def install(self, model: nn.Module) -> None:
        """Register the root's boundary hooks and every island/context hook."""
        root = self.sites[0]
        self._sentinel = lowp_param(model, self.sites) if self.cast_params else None
        self._root_island = self.is_island(root)
        self._root_context = self.mode_on and root.has_rule
        self._plain = plain_function_context(
            self.sites, root_island=self._root_island, root_context=self._root_context
        )
        if self._root_island:
            self.input_dtype = torch_dtype(root.dtype)
        handles = self._handles
        handles.append(
            model.register_forward_pre_hook(self._root_pre, with_kwargs=True, prepend=True)
        )
        handles.append(model.register_forward_hook(self._root_post, always_call=True))
        by_name = {site.name: site for site in self.sites}
        if self.casting is not None:  # torch.compile: the region as with blocks
            self._trace_forward(model, region=True, island=self._root_island and self.autocast_on)
        if self.casting is not None and self.mode_on:
            for site in self.sites:
                if site.has_rule:  # the mode only looks decisions up while a forward runs
                    self.casting.decisions.prepare(DecisionContext(site.name, site.classes))
        for site in self.sites[1:]:
            module = site.module
            island, context = self.is_island(site), self.mode_on and site.has_rule
            if island and self.autocast_on:
                self._trace_forward(module, region=False, island=True)
            if island or context:
                hooks = _SiteHooks(self, site, island=island, context=context)
                handles.append(module.register_forward_pre_hook(hooks.pre, with_kwargs=True))
                handles.append(module.register_forward_hook(hooks.post, always_call=True))
            if _entry_point(site) and (
                self.casting is not None or (self.cast_params and is_low_precision(site.dtype))
            ):
                # registered after the site's own hooks, pre-hook prepended: the entry's
                # pre-hook runs first and its post-hook last, so it wraps them
                entry = _EntryHooks(self, site, _ancestors(site, by_name))
                handles.append(
                    module.register_forward_pre_hook(entry.pre, with_kwargs=True, prepend=True)
                )
                handles.append(module.register_forward_hook(entry.post, always_call=True))

    def _trace_forward(self, module: nn.Module, *, region: bool, island: bool) -> None:
        """Give ``module`` a :class:`TracedForward` (what it does under ``torch.compile``)."""
        assert self.casting is not None
        previous = vars(module).get("forward")  # an instance attribute of its own, if any
        traced = TracedForward(self.casting, module.forward, region=region, island=island)
        module.forward = traced  # type: ignore[method-assign]
        self._traced.append((module, traced, previous))

    def remove(self) -> None:
        """Remove every hook :meth:`install` registered, and every :class:`TracedForward`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, traced, previous in self._traced:
            if vars(module).get("forward") is traced:
                if previous is None:
                    del module.forward
                else:
                    module.forward = previous  # type: ignore[method-assign]
        self._traced.clear()

    def _root_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._sentinel is not None and self._sentinel[1].dtype != self._sentinel[2]:
            recast_error(self.policy, *self._sentinel)
        undo: list[Any] = []
        try:
            if self.casting is not None and not torch.compiler.is_compiling():
                # (compiling: the root's TracedForward opens the region instead)
                self.casting.enter()
                undo.append(self.casting.exit)
            if self._root_island or self._root_context:
                undo.extend(_enter_site(self, self.sites[0], island=self._root_island))
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        self.depth += 1
        undo.append(self.leave)
        _hooks_local.stack.append((module, undo))
        dtype = self.input_dtype
        if dtype is not None:
            return cast_floating(args, dtype), cast_floating(kwargs, dtype)
        return None

    def leave(self) -> None:
        """One forward of this model (root or entry) ended."""
        self.depth -= 1

    def _root_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        _undo(module)
        if output is None:
            return None
        # only the op-casting mode is lost in a reentrant recomputation (autocast is restored)
        if not torch.compiler.is_compiling() and self.reentrant.due and self.mode_on:
            (known, context), casting = self._plain, self.casting
            restore = (
                functools.partial(recomputation, casting, context)
                if known and casting is not None
                else None
            )
            self.reentrant.after_forward(output, restore)
        return cast_floating(output, self.output_dtype)


def _undo(module: nn.Module) -> None:
    """Run the undo steps the pre-hook of ``module`` pushed (nothing if it pushed none)."""
    stack = _hooks_local.stack
    if stack and stack[-1][0] is module:
        for step in reversed(stack.pop()[1]):
            step()


def _enter_site(owner: ModelCasting, site: ModuleSite, *, island: bool) -> list[Any]:
    """Push the site's decision context and/or turn autocast off; return the undo steps."""
    undo: list[Any] = []
    casting = owner.casting
    if casting is not None and casting.table and site.has_rule:
        contexts = context_stack()
        contexts.append(DecisionContext(site.name, site.classes))
        undo.append(contexts.pop)
    if island and casting is not None and casting.autocast is not None:
        if not torch.compiler.is_compiling():  # else the island's TracedForward does it
            undo.append(disable_autocast(casting.device_types))
    return undo


class _SiteHooks(CopyOnly):
    """Forward pre/post hooks of one island or context module."""

    def __init__(
        self, owner: ModelCasting, site: ModuleSite, *, island: bool, context: bool
    ) -> None:
        self.owner = owner
        self.site = site
        self.island = island
        self.context = context
        self.pin = torch_dtype(site.pin) if island and site.pin is not None else None
        self.cast_back = (
            torch_dtype(site.outer)
            if island and not owner.autocast_on and site.pin != site.outer and owner.cast_params
            else None
        )

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        _hooks_local.stack.append((module, _enter_site(self.owner, self.site, island=self.island)))
        if self.pin is not None:
            return cast_floating(args, self.pin), cast_floating(kwargs, self.pin)
        return None

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        _undo(module)
        if self.cast_back is not None and output is not None:
            return cast_floating(output, self.cast_back)
        return None


def _entry_point(site: ModuleSite) -> bool:
    """Whether users plausibly call this module on its own: a child of the root, or a
    module holding others (a block, an encoder)."""
    return "." not in site.name or next(site.module.children(), None) is not None


def _ancestors(site: ModuleSite, by_name: dict[str, ModuleSite]) -> list[ModuleSite]:
    """The sites above ``site``, nearest first, root last."""
    out: list[ModuleSite] = []
    name = site.name
    while name:
        name = name.rpartition(".")[0]
        out.append(by_name[name])
    return out


class _EntryHooks:
    """The boundary of one module called from outside its model's forward.

    Opens what the model's forward would have open around this module (the op-casting
    region, the nearest ruled ancestor's decision context, autocast off under a pinned
    ancestor), casts floating inputs to the module's dtype and outputs to ``policy.output``.
    """

    def __init__(self, owner: ModelCasting, site: ModuleSite, ancestors: list[ModuleSite]) -> None:
        self.owner = owner
        self.input = (
            torch_dtype(site.dtype) if owner.cast_params and is_low_precision(site.dtype) else None
        )
        ruled = [a for a in ancestors if a.has_rule] if owner.mode_on else []
        self.context = DecisionContext(ruled[0].name, ruled[0].classes) if ruled else None
        self.autocast_off = any(owner.is_island(a) for a in ancestors) and owner.autocast_on
        self.recomputing = False
        """Whether the running entry is an activation checkpoint's recomputation."""

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        owner = self.owner
        if owner.depth:  # inside the model's forward: the root's boundary holds already,
            return self._inner(args, kwargs)  # but a float32 tensor made inside it may not
        if torch.compiler.is_compiling():
            return _entry_pre_eagerly(self, module, args, kwargs)
        return self._pre(module, args, kwargs)

    def _inner(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Inside the model's forward (or its recomputation): a float32 or float64 tensor the
        model made itself (a positional encoding cached in forward, a float mask) reaching a
        module whose parameters are low precision is cast to their dtype, as the root's
        boundary casts the inputs; otherwise it would meet those parameters in the first
        matmul ("expected m1 and m2 to have the same dtype"). Nothing is cast, and only the
        top level is looked at, when every input already has a low-precision dtype."""
        dtype = self.input
        if dtype is None or not (holds_wide_float(args) or holds_wide_float(kwargs.values())):
            return None
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        owner = self.owner
        # Called during backward: torch.utils.checkpoint recomputing this module. It ran
        # inside the forward's region, so it gets the region, context and autocast state
        # back, but no boundary casts (the forward had none here): the recomputed tensors
        # must match the saved ones in dtype, and the gradients those of the forward.
        self.recomputing = in_backward()
        undo: list[Any] = []
        try:
            casting = owner.casting
            if casting is not None:
                casting.enter()
                undo.append(casting.exit)
                if self.context is not None:
                    contexts = context_stack()
                    contexts.append(self.context)
                    undo.append(contexts.pop)
                if self.autocast_off:
                    undo.append(disable_autocast(casting.device_types))
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        owner.depth += 1
        undo.append(owner.leave)
        _hooks_local.stack.append((module, undo))
        if self.recomputing:  # cast as inside the forward it recomputes
            return self._inner(args, kwargs)
        if self.input is not None:
            return cast_floating(args, self.input), cast_floating(kwargs, self.input)
        return None

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        stack = _hooks_local.stack
        if not (stack and stack[-1][0] is module and self.owner.depth):
            return None  # the pre-hook entered nothing (the site's own hooks popped theirs)
        if torch.compiler.is_compiling():
            return _entry_post_eagerly(self, module, args, output)
        return self._post(module, args, output)

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        _undo(module)
        if output is None or self.recomputing:
            return None
        return cast_floating(output, self.owner.output_dtype)


# A module compiled on its own (``torch.compile(model.encoder)``, not the wrapped root) runs
# its entry hooks eagerly: one graph break each, and its forward compiles inside the region
# they open (a compiled root opens it in its TracedForward, without a break).
_EAGER_ENTRY = (
    "mixprec: a module of a wrapped model compiled on its own opens its boundary eagerly; "
    "compile the wrapped model itself for no graph break"
)
_entry_pre_eagerly = torch.compiler.disable(_EntryHooks._pre, reason=_EAGER_ENTRY)
_entry_post_eagerly = torch.compiler.disable(_EntryHooks._post, reason=_EAGER_ENTRY)
