"""The precision policy: which dtype each op, module and tensor role uses.

A :class:`Policy` is a frozen, hashable value. It names a dtype for each *role* (``param``,
``compute``, ``output``, ``master``, ``reduce``), a loss-scale configuration, global op
lists (:class:`OpRules`) and module rules (:class:`ModuleRule`). Backends ask it one
question per op at trace time, :meth:`Policy.decide`, and :meth:`Policy.explain` prints how
the answer came about.

How an op's dtype is decided, first match wins:

1. an op rule inside a matching module rule (a path rule's before a class rule's);
2. the dtype a matching *path* rule pins;
3. the dtype a matching *class* rule pins;
4. the global op lists: ``lowp`` → ``compute``, ``fp32`` → float32, ``promote`` → the
   widest floating input, ``passthrough`` (and ops in no list) → the first floating input
   (``param`` when there is none), ``banned`` → :class:`PolicyError` with advice.

Two rules of the same step that match and disagree are ambiguous: :class:`PolicyError`
names both. The chain itself lives in :mod:`mixprec.policy.precedence`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mixprec.dtypes import POLICY_DTYPES, canonical_dtype, holds
from mixprec.errors import PolicyError
from mixprec.numerics.compensated import (
    MASTER_STRATEGIES,
    check_state,
    check_strategy,
    describe_state,
    describe_strategy,
    is_strategy,
)
from mixprec.numerics.fp8.recipes import FP8Recipe, check_fp8, describe_fp8
from mixprec.numerics.loss_scale import DynamicScale, LossScaleConfig, NoScale, StaticScale
from mixprec.policy.forms import format_policy, policy_from_mapping
from mixprec.policy.grammar import toml_dumps
from mixprec.policy.precedence import Decision, consult, pinned_dtype, winner
from mixprec.policy.precedence import explain as explain_chain
from mixprec.policy.presets import builtin_preset_name, builtin_preset_names, preset_fields
from mixprec.policy.rules import LIST_NAMES, ListName, ModuleRule, OpRules, with_rule

__all__ = [
    "LIST_NAMES",
    "Decision",
    "FP8Recipe",
    "ListName",
    "LossScaleConfig",
    "ModuleRule",
    "OpRules",
    "Policy",
    "builtin_preset",
]

_CACHE_LIMIT = 1 << 16


def _role_dtype(role: str, value: object) -> str:
    dtype = canonical_dtype(value)
    if dtype not in POLICY_DTYPES:
        raise PolicyError(
            f"{role}={value!r} is not a dtype a policy can use; choose one of "
            f"{', '.join(POLICY_DTYPES)}"
        )
    return dtype


def _master_dtype(value: object) -> str:
    try:
        return _role_dtype("master", value)
    except PolicyError as exc:
        raise PolicyError(
            f"master={value!r} is neither a dtype nor a master-weight strategy; use 'float32' "
            f"(master copies), 'none', or one of {', '.join(MASTER_STRATEGIES)} "
            f"(compensated bfloat16 weights). {exc}"
        ) from None


@dataclass(frozen=True)
class Policy:
    """What runs in which precision, how the loss is scaled, and where masters live.

    Build one with :func:`mixprec.get_policy` (``"O2"``, ``"bf16-mixed"``, a key-grammar
    string, a dict or a TOML file). Fields:

    - ``param``: dtype of the weights the forward pass reads;
    - ``compute``: dtype of low-precision ops (``"auto"`` until a backend resolves it);
    - ``output``: dtype of the model's outputs;
    - ``master``: dtype of the optimizer's copy of the weights, None for no copy, or a
      compensated bfloat16 strategy, ``"kahan"`` or ``"stochastic"``
      (:mod:`mixprec.numerics.compensated`), which keeps no float32 copy;
    - ``reduce``: dtype of gradient communication;
    - ``state``: None (the optimizer's state as it allocates it), ``"bfloat16"``: under
      a compensated ``master`` the optimizer's per-parameter state is kept in bfloat16
      between steps, rounded stochastically (:mod:`mixprec.numerics.compensated`), or a
      low-bit format, ``"int8"``, ``"int4"`` or ``"fp8"`` with its settings
      (``"int8(block=128)"``): the state is kept quantized block-wise between steps under
      any master strategy whose optimizer updates float32 tensors
      (:mod:`mixprec.numerics.lowbit`);
    - ``fp8``: None, or the :class:`~mixprec.numerics.fp8.recipes.FP8Recipe` (``"tensorwise"``,
      ``"rowwise"``, ``"delayed"``, ``"mxfp8"``) under which the ``linear`` family runs as an
      FP8 GEMM on top of a bfloat16 or float16 compute dtype (:mod:`mixprec.numerics.fp8.recipes`);
    - ``loss_scale``: :class:`~mixprec.NoScale`, :class:`~mixprec.StaticScale` or
      :class:`~mixprec.DynamicScale` (its configuration only: it is stored reset);
    - ``ops``: the global :class:`OpRules`; ``modules``: the :class:`ModuleRule` s;
    - ``name``: the preset it came from, for display only (not compared).

    :raises PolicyError: an unknown dtype, a master copy that is pointless (same dtype as
        ``param``) or narrower than ``param``, a compensated strategy without bfloat16
        params, a ``state`` without a compensated strategy, an ``fp8`` recipe that is
        unknown or on a compute dtype other than bfloat16/float16, or two module rules for
        the same pattern.
    """

    param: str
    compute: str
    output: str
    master: str | None
    reduce: str
    loss_scale: LossScaleConfig
    ops: OpRules
    modules: tuple[ModuleRule, ...]
    name: str | None = field(default=None, compare=False)
    state: str | None = None
    fp8: FP8Recipe | None = None
    _decisions: dict[tuple[Any, ...], Decision] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for role in ("param", "output", "reduce"):
            set_(self, role, _role_dtype(role, getattr(self, role)))
        if self.compute != "auto":
            set_(self, "compute", _role_dtype("compute", self.compute))
        master = self.master
        if isinstance(master, str) and master.lower() == "none":
            master = None
        if is_strategy(master):
            master = check_strategy(str(master), self.param)
        elif master is not None:
            master = _master_dtype(master)
            if master == self.param:
                raise PolicyError(
                    f"master={master} with param={self.param} is pointless: the params "
                    "already are their own master copy. Set master=None, or use low-precision "
                    f"params (param='bfloat16' or 'float16') with master='{master}'"
                )
            if not holds(master, self.param):
                raise PolicyError(
                    f"master={master} is narrower than param={self.param}: a master copy must "
                    f"hold every param value exactly. Use master='float32'"
                )
        set_(self, "master", master)
        set_(self, "state", check_state(self.state, master, self.param))
        set_(self, "fp8", check_fp8(self.fp8, self.compute))
        if not isinstance(self.loss_scale, NoScale | StaticScale | DynamicScale):
            raise PolicyError(
                f"loss_scale must be NoScale(), StaticScale(s) or DynamicScale(...), got "
                f"{self.loss_scale!r}; get_policy(..., loss_scale='dynamic') parses strings"
            )
        set_(self, "loss_scale", self.loss_scale.fresh())
        if not isinstance(self.ops, OpRules):
            raise PolicyError(
                f"ops must be an OpRules, got {type(self.ops).__name__}; build one with "
                "OpRules(fp32=[...], ...) or edit a preset with policy.with_ops(...)"
            )
        modules = tuple(self.modules)
        seen: dict[tuple[str, str], ModuleRule] = {}
        for rule in modules:
            if not isinstance(rule, ModuleRule):
                raise PolicyError(
                    f"modules must hold ModuleRule objects, got {rule!r}; build one with "
                    "ModuleRule('class', '*BatchNorm*', 'float32') or use policy.with_module(...)"
                )
            if rule.key in seen:
                raise PolicyError(
                    f"two module rules for the same pattern: {seen[rule.key]} and {rule}; "
                    "keep one (with_module replaces the rule for a pattern)"
                )
            seen[rule.key] = rule
        set_(self, "modules", modules)

    # ------------------------------------------------------------------ deciding

    def decide(
        self,
        op: str,
        input_dtypes: Iterable[str] = (),
        module: str | None = None,
        module_class: str | Sequence[str] | None = None,
    ) -> Decision:
        """The dtype ``op`` runs in, and the rule that chose it.

        :param op: a neutral op family or a ``"<backend>:<native>"`` name.
        :param input_dtypes: the dtypes of the op's inputs; non-floating ones are ignored.
        :param module: the qualified name of the module the op runs in.
        :param module_class: its class name, or its class names along the MRO.
        :raises PolicyError: the op is unknown or banned, a module rule match is ambiguous,
            or the policy is still ``auto``.

        Answers are cached per policy, so backends may call this for every op they trace.
        """
        key = (op, tuple(input_dtypes), module, _classes(module_class))
        try:
            return self._decisions[key]
        except KeyError:
            pass
        outcome = winner(consult(self, *key))
        if isinstance(outcome, PolicyError):
            raise outcome
        if len(self._decisions) >= _CACHE_LIMIT:
            self._decisions.clear()
        self._decisions[key] = outcome
        return outcome

    def explain(
        self,
        op: str,
        input_dtypes: Iterable[str] = (),
        module: str | None = None,
        module_class: str | Sequence[str] | None = None,
    ) -> str:
        """The chain of rules :meth:`decide` consults for this op, and which one wins (and,
        under ``fp8``, whether the ``linear`` family runs as an FP8 GEMM there)."""
        text = explain_chain(self, op, tuple(input_dtypes), module, _classes(module_class))
        if op == "linear" and self.fp8 is not None:
            recipe = self.fp8_for(module, module_class)
            note = describe_fp8(self.fp8, self.compute)
            if recipe is None:
                note = f"{note}\n  Here a rule decides: no FP8."
            text = f"{text}\n{note}"
        return text

    def fp8_for(
        self, module: str | None, module_class: str | Sequence[str] | None
    ) -> FP8Recipe | None:
        """The FP8 recipe a linear layer at ``module`` runs under, or None.

        A layer runs in FP8 when the policy has an ``fp8`` recipe and the ``linear`` family
        there is decided by the global op lists (not a module rule) and comes out in the
        compute dtype. So ``path:lm_head=bfloat16``, a class rule or ``fp32+=linear`` keep
        layers out of FP8. A backend also keeps out the layers inside a module a rule pins
        (the pin covers everything inside it).
        """
        if self.fp8 is None:
            return None
        decision = self.decide("linear", (self.compute,), module, module_class)
        if decision.source in ("global", "default") and decision.dtype == self.compute:
            return self.fp8
        return None

    # ------------------------------------------------------------------ modules

    def module_dtype(
        self, module: str | None, module_class: str | Sequence[str] | None
    ) -> str | None:
        """The dtype a module rule pins this module to (path rules first), or None."""
        return pinned_dtype(self, module, _classes(module_class))

    def param_dtype_for(self, module: str | None, module_class: str | Sequence[str] | None) -> str:
        """The dtype of this module's own params: the pinned dtype, else ``param``."""
        return self.module_dtype(module, module_class) or self.param

    # ------------------------------------------------------------------ editing

    def with_ops(
        self,
        *,
        lowp: Iterable[str] = (),
        fp32: Iterable[str] = (),
        promote: Iterable[str] = (),
        passthrough: Iterable[str] = (),
        banned: Iterable[str] = (),
    ) -> Policy:
        """A copy with ops moved between the global lists (each named op leaves its old one)."""
        lists = dict(lowp=lowp, fp32=fp32, promote=promote, passthrough=passthrough, banned=banned)
        given = {name: ops for name, ops in lists.items() if ops}
        return dataclasses.replace(self, ops=self.ops.edited(**given), name=None)

    def with_module(
        self,
        pattern: str,
        dtype: str | None = None,
        *,
        match: Literal["class", "path"] = "class",
        ops: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    ) -> Policy:
        """A copy with a module rule added, or replacing the rule for the same pattern.

        ``policy.with_module("*LayerNorm*", "float32")`` pins every LayerNorm;
        ``policy.with_module("decoder.*", match="path", ops={"softmax": "fp32"})`` keeps
        softmax in float32 inside the decoder only.
        """
        rule = ModuleRule(match, pattern, dtype, ops or ())
        return dataclasses.replace(self, modules=with_rule(self.modules, rule), name=None)

    # ------------------------------------------------------------------ facts

    @property
    def casts_ops(self) -> bool:
        """True when some op rule casts (O1-style); False when every op passes through."""
        casting = ("lowp", "fp32", "promote")
        return any(getattr(self.ops, n) for n in casting) or any(
            lst in casting for rule in self.modules for _, lst in rule.ops
        )

    @property
    def uses_masters(self) -> bool:
        """True when the optimizer keeps a master copy of the weights (a dtype ``master``)."""
        return self.master is not None and not is_strategy(self.master)

    @property
    def master_strategy(self) -> str | None:
        """``"kahan"`` or ``"stochastic"`` for compensated bfloat16 weights, else None."""
        return self.master if is_strategy(self.master) else None

    def describe_master(self) -> str:
        """One line saying how the weights are kept: master copies, a strategy, or none."""
        return describe_strategy(self.master)

    def describe_state(self) -> str:
        """One line saying how the optimizer state is kept between steps."""
        return describe_state(self.state)

    @property
    def is_resolved(self) -> bool:
        """False while ``compute`` is ``"auto"`` (see :func:`mixprec.resolve_auto`)."""
        return self.compute != "auto"

    @property
    def label(self) -> str:
        """The policy's name for messages: its preset name, or its key-grammar spec."""
        return repr(self.name or str(self))

    # ------------------------------------------------------------------ formats

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data (JSON-safe); :meth:`from_dict` reads it back."""
        d: dict[str, Any] = {} if self.name is None else {"name": self.name}
        d.update(
            param=self.param,
            compute=self.compute,
            output=self.output,
            master=self.master,
            reduce=self.reduce,
            state=self.state,
            fp8=None if self.fp8 is None else str(self.fp8),
            loss_scale=self.loss_scale.state_dict(),
            ops=self.ops.lists(),
            modules=[rule.to_dict() for rule in self.modules],
        )
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Policy:
        """Read :meth:`to_dict`'s form, or a partial one on a built-in ``"base"`` preset.

        See :func:`mixprec.policy.forms.policy_from_mapping` for the keys. A partial mapping on a
        plugin's preset is read by :func:`mixprec.get_policy`, which loads plugins; this
        method never does.
        """
        return policy_from_mapping(d, _builtin_base)

    def to_toml(self) -> str:
        """The policy as a TOML document that :func:`mixprec.load_toml` reads back."""
        data = self.to_dict()
        data["master"] = data["master"] or "none"  # TOML has no null
        data["state"] = data["state"] or "none"
        data["fp8"] = data["fp8"] or "none"
        data["modules"] = [
            {key: value for key, value in rule.items() if value not in (None, {})}
            for rule in data["modules"]
        ]
        header = f"mixprec policy {str(self)!r}\nread it back with mixprec.load_toml(path)"
        return toml_dumps(data, header=header)

    def __str__(self) -> str:
        """The preset name, or a key-grammar string; ``get_policy(str(p)) == p``
        (:func:`mixprec.policy.forms.format_policy`)."""
        return format_policy(self)


def _classes(module_class: str | Sequence[str] | None) -> str | tuple[str, ...] | None:
    if module_class is None or isinstance(module_class, str):
        return module_class
    return tuple(module_class)


@functools.cache
def _builtin(name: str) -> Policy:
    return Policy(**preset_fields(name), name=name)


def builtin_preset(name: str) -> Policy | None:
    """The built-in preset or alias called ``name`` (any case), or None.

    Plugin presets are :func:`mixprec.engine.spec.preset`'s (it loads plugins).
    """
    spelled = builtin_preset_name(name)
    return None if spelled is None else _builtin(spelled)


def _builtin_base(name: str) -> Policy:
    found = builtin_preset(name)
    if found is None:
        names = builtin_preset_names()
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise PolicyError(
            f"unknown built-in preset {name!r} as 'base'.{hint} Policy.from_dict knows the "
            f"built-in presets ({', '.join(names)}); mixprec.get_policy(mapping) also reads "
            "a mapping on a plugin's preset."
        )
    return found
