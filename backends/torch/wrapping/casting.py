"""Parameter and boundary casting (O2/O3), module islands, and the forwards of a wrapped model.

For each module of a wrapped model, :func:`plan_model` decides once, at wrap time:

- its *dtype*: the dtype a module rule pins it to (``Policy.module_dtype``), else the dtype
  of its parent (a pin covers everything inside the module), else ``policy.param`` at the
  root. Its own parameters and floating buffers are cast to that dtype in place
  (``param.data = ...``), so the ``Parameter`` objects (and what optimizers, DDP and tied
  modules hold) stay the same;
- whether it is an *island*: pinned to a dtype. Its forward pre-hook casts floating inputs
  to the pinned dtype and turns autocast off inside it; its post-hook turns autocast back on
  and, when no autocast runs around it (O2/O3), casts floating outputs back to the dtype
  around it. So a float32 BatchNorm in an O2 float16 network receives float32 and hands
  float16 to the next layer, in train and in eval mode (under ``torch.compile`` its
  :class:`~mixprec_torch.o1.tracing.TracedForward` turns autocast off instead);
- whether its hooks open its decision context's region (it matches a module rule, and O1's
  kernels decide some ops) so ``Policy.decide`` sees the module an op runs in;
- whether it is an *entry*: a module users plausibly call on their own (a child of the
  root, or a module holding others), which then runs inside the model's boundary.

The root gets the *boundary*: floating inputs are cast to the root's dtype when that is a
low-precision dtype (O2/O3), the op-casting region (:mod:`mixprec_torch.o1.autocast`) runs
around the forward, and floating outputs are cast to ``policy.output``. The boundary and the
entries are ``forward`` attributes, not hooks (:mod:`mixprec_torch.wrapping.boundaries`).

Inside the model's forward, and in a checkpoint's recomputation, an entry whose parameters
are low precision casts a float32 input the model made itself (a positional encoding cached
in ``forward``, a float mask) to their dtype
(:func:`~mixprec_torch.wrapping.boundaries.made_inside`): under O2 such a tensor would otherwise
meet them in a matmul and fail.

Every forward holds the :class:`ModelCasting` stored on the model, so
``copy.deepcopy(model)`` copies forwards and plan consistently; pickling them raises
:class:`~mixprec.errors.CheckpointError` (:mod:`mixprec_torch.copies`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.kit import Policy, is_low_precision

from ..copies import CopyOnly
from ..dtypes import cast_floating, torch_dtype
from ..o1.autocast import DecisionContext, OpCasting
from ..o1.autocast_kernels import install as install_kernels
from ..o1.regions import Region
from ..o1.tracing import TracedForward, disable_autocast
from ..sites import ModuleSite, class_names, plan_model
from .boundaries import EntryHooks, ModuleForward, hooks_local, open_region, undo
from .param_dtypes import apply_param_dtypes, lowp_param, planned_dtypes, recast_error

__all__ = ["ModelCasting", "ModuleSite", "cast_floating", "class_names", "plan_model"]


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
        self._traced: list[tuple[nn.Module, Any, Any]] = []
        self._sentinel: tuple[str, nn.Parameter, torch.dtype] | None = None
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

    # ------------------------------------------------------------------ forwards

    @property
    def autocast_on(self) -> bool:
        return self.casting is not None and self.casting.autocast is not None

    @property
    def intercepts(self) -> bool:
        """Whether O1's kernels decide some ops in this model's regions."""
        return self.casting is not None and self.casting.intercepts

    def context_region(self, site: ModuleSite) -> Region | None:
        """The region a module with rules of its own opens (None: it opens none)."""
        if self.casting is None or not self.intercepts or not site.has_rule:
            return None
        return self.casting.region(DecisionContext(site.name, site.classes))

    def is_island(self, site: ModuleSite) -> bool:
        """Pinned, and either autocast runs around it or its params differ from around it."""
        return site.pin is not None and (
            self.autocast_on or (self.cast_params and site.pin != site.outer)
        )

    def install(self, model: nn.Module) -> None:
        """Give the root its boundary (:mod:`mixprec_torch.wrapping.boundaries`), and register every
        island, context and entry module's hooks or forward."""
        root = self.sites[0]
        self._sentinel = lowp_param(model, self.sites) if self.cast_params else None
        root_island = self.is_island(root)
        if self.casting is not None:
            install_kernels(self.casting)
        if root_island:
            self.input_dtype = torch_dtype(root.dtype)
        self._replace_forward(
            model,
            ModuleForward(
                self,
                model.forward,
                root=True,
                entry_input=self.input_dtype,
                island=root_island,
                region=self.context_region(root),
            ),
        )
        by_name = {site.name: site for site in self.sites}
        handles = self._handles
        for site in self.sites[1:]:
            module = site.module
            island, region = self.is_island(site), self.context_region(site)
            if island and self.autocast_on:  # torch.compile: autocast off as a with block
                assert self.casting is not None
                self._replace_forward(
                    module, TracedForward(self.casting.device_types, module.forward)
                )
            if island or region is not None:
                hooks = _SiteHooks(self, site, island=island, region=region)
                handles.append(module.register_forward_pre_hook(hooks.pre, with_kwargs=True))
                handles.append(module.register_forward_hook(hooks.post, always_call=True))
            if not _entry_point(site) or not (
                self.casting is not None or (self.cast_params and is_low_precision(site.dtype))
            ):
                continue
            above = _ancestors(site, by_name)
            ruled = [a for a in above if a.has_rule]
            entry_input = (
                torch_dtype(site.dtype)
                if self.cast_params and is_low_precision(site.dtype)
                else None
            )
            entry_region = self.context_region(ruled[0]) if ruled else None
            off = any(self.is_island(a) for a in above) and self.autocast_on
            if island or region is not None:
                # registered after the site's own hooks, pre-hook prepended: the entry's
                # pre-hook runs first and its post-hook last, so it wraps them
                entry = EntryHooks(self, entry_input, entry_region, off)
                handles.append(
                    module.register_forward_pre_hook(entry.pre, with_kwargs=True, prepend=True)
                )
                handles.append(module.register_forward_hook(entry.post, always_call=True))
            else:
                self._replace_forward(
                    module,
                    ModuleForward(
                        self,
                        module.forward,
                        entry=True,
                        entry_input=entry_input,
                        entry_region=entry_region,
                        entry_off=off,
                    ),
                )

    def _replace_forward(self, module: nn.Module, forward: Any) -> None:
        """Make ``forward`` the module's ``forward`` attribute (undone by :meth:`remove`)."""
        previous = vars(module).get("forward")  # an instance attribute of its own, if any
        module.forward = forward  # type: ignore[method-assign]
        self._traced.append((module, forward, previous))

    def remove(self) -> None:
        """Remove every hook :meth:`install` registered, and put back every forward it
        replaced."""
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

    def check_params(self) -> None:
        """Raise if a parameter was cast after ``wrap`` (``model.float()``)."""
        if self._sentinel is not None and self._sentinel[1].dtype != self._sentinel[2]:
            recast_error(self.policy, *self._sentinel)

    def leave(self) -> None:
        """One forward of this model (root or entry) ended."""
        self.depth -= 1


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


def _enter_site(owner: ModelCasting, region: Region | None, *, island: bool) -> list[Any]:
    """Open the site's context region and/or turn autocast off; return the undo steps."""
    undo: list[Any] = []
    casting = owner.casting
    if region is not None:
        undo.append(open_region(region))
    if island and casting is not None and casting.autocast is not None:
        if not torch.compiler.is_compiling():  # else its TracedForward does it
            undo.append(disable_autocast(casting.device_types))
    return undo


class _SiteHooks(CopyOnly):
    """Forward pre/post hooks of one island or context module."""

    def __init__(
        self, owner: ModelCasting, site: ModuleSite, *, island: bool, region: Region | None
    ) -> None:
        self.owner = owner
        self.island = island
        self.region = region
        self.pin = torch_dtype(site.pin) if island and site.pin is not None else None
        self.cast_back = (
            torch_dtype(site.outer)
            if island and not owner.autocast_on and site.pin != site.outer and owner.cast_params
            else None
        )

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hooks_local.stack.append((module, _enter_site(self.owner, self.region, island=self.island)))
        if self.pin is not None:
            return cast_floating(args, self.pin), cast_floating(kwargs, self.pin)
        return None

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        undo(module)
        if self.cast_back is not None and output is not None:
            return cast_floating(output, self.cast_back)
        return None
