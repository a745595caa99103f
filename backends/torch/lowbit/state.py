"""The optimizer's state kept quantized between steps, widened to float32 inside ``step()``.

Under a policy whose ``state`` is a low-bit format (:mod:`mixprec.numerics.lowbit`) every
parameter the format quantizes (at least ``min_size`` elements, not named by ``keep``) keeps,
between two steps, in ``optimizer.state[param]``:

- for each state key of :data:`~mixprec.kit.SIGNED_KEYS` / :data:`~mixprec.kit.UNSIGNED_KEYS`
  the optimizer has (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``):
  the codes under the same key (a flat ``uint8`` tensor, two codes a byte for ``int4``) and
  the blocks' float32 absmax under ``<key>.absmax``;
- ``"mixprec.state"``: the format and block size the codes were written with, as ints
  (``(0, 256)``: ``int8``, the index in ``LOWBIT_FORMATS``, and 256 elements a block), which
  a load checks.

So ``optimizer.state_dict()`` is small and loads through ``torch.load(weights_only=True)``,
and an unwrapped optimizer refuses it loudly (a ``uint8`` moment of another shape) instead of
training on it. :meth:`LowBitState.widen`, before the optimizer's own update, decodes the
codes into fresh float32 tensors of the parameter's shape under the original keys;
:meth:`LowBitState.narrow`, after it, encodes them again, first checking every block's
absmax is finite (a non-finite moment would decode as garbage): if one is not, the state
keeps the codes it had before this step and :class:`~mixprec.errors.PolicyError` names the
tensor. A skipped step never reaches either, so its quantized state stays bit for bit.

On the CPU, for torch's SGD, Adam and AdamW over float32 weights, :meth:`LowBitState.step_fused`
replaces the three (:mod:`.fused_step`: one pass per tensor, no float32 copy of the state; a
step whose moments could become inf or NaN is left to them, and so to the same refusal); the
codec itself runs in the C kernels there (:mod:`.codec`), which count the non-finite blocks
in the same pass.

Under FSDP2 (parameters and moments are ``DTensor`` s sharded by rows) each rank keeps the
codes and absmax of its own shard only, as 1-D ``DTensor`` s over the parameter's mesh
(:mod:`.shards`), and the tag adds the shard count; the fused step does not take them (the
generic path runs), and :meth:`LowBitState.narrow` agrees with the other ranks of the shard
group (one all-reduce) before it keeps or refuses the step, so every rank does the same.

Loading (:meth:`LowBitState.check_state_dict` before anything changes, then
:meth:`LowBitState.adopt`): codes written under another format or block size are refused;
a float32 state (a checkpoint of an unwrapped optimizer, or of ``state=None``) is quantized
(the documented way in: lossy as a step is); quantized state of a parameter the policy now
keeps in float32 (``min_size`` or ``keep`` changed) is decoded. :func:`float32_state_dict`
is the way back out: an optimizer state dict with every quantized tensor decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeGuard, TypeVar, cast

import torch

from mixprec.errors import CheckpointError, PolicyError, WrapError
from mixprec.kit import LOWBIT_FORMATS, SIGNED_KEYS, UNSIGNED_KEYS, StateFormat, state_map

from ..step.optimizer_state import optimizer_state
from ..torch_private import run_step_hooks
from . import fused_step, shards
from .codec import blocks_of, code_count, dequantize, encode, quantize
from .fused_step import FORMAT_KEY
from .fused_step import SUFFIX as _SUFFIX
from .shards import Layout, is_sharded, layout_of, local

__all__ = ["FORMAT_KEY", "LowBitState", "float32_state_dict", "supported_optimizer"]
_KEYS = {**{k: True for k in SIGNED_KEYS}, **{k: False for k in UNSIGNED_KEYS}}
_SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_F = TypeVar("_F", bound=Callable[..., Any])


def _eagerly(fn: _F) -> _F:
    """``fn`` run eagerly (a graph break) when a compiled step calls it: the fused step calls
    native code."""
    return cast(_F, torch.compiler.disable(fn, reason="mixprec: the fused low-bit step"))


def _tag(fmt: StateFormat) -> tuple[int, int]:
    """The format as the state holds it: (its index in ``LOWBIT_FORMATS``, the block size).
    Ints, not text: torch's ``load_state_dict`` rebuilds every iterable value of the state
    element by element, which turns a string into the text of a generator. A parameter
    FSDP2 shards adds the shard count (:func:`_tag_of`)."""
    return (LOWBIT_FORMATS.index(fmt.name), fmt.block)


def _tag_of(tag: tuple[int, int], lay: Layout | None) -> tuple[int, ...]:
    """The tag of one parameter's state: ``tag``, and under FSDP2 the shard count its codes
    were cut into (:mod:`.shards`: codes of another count belong to other rows)."""
    return tag if lay is None else (*tag, lay.shards)


def _shown(tag: object) -> str:
    """A tag as the policy text it stands for (``int8(block=256)``, ``int8(block=256) in 2
    shards``), or its repr."""
    found = _format_of(tag)
    if found is None:
        return repr(tag)
    text = f"{found[0]}(block={found[1]})"
    return text if found[2] is None else f"{text} in {found[2]} FSDP2 shards"


def _format_of(tag: object) -> tuple[str, int, int | None] | None:
    if (
        not isinstance(tag, tuple | list)
        or len(tag) not in (2, 3)
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in tag)
        or not 0 <= tag[0] < len(LOWBIT_FORMATS)
    ):
        return None
    return LOWBIT_FORMATS[tag[0]], tag[1], tag[2] if len(tag) == 3 else None


def supported_optimizer(optimizer: torch.optim.Optimizer, base: type, fmt: StateFormat) -> None:
    """Refuse an optimizer whose state the format cannot quantize.

    :raises WrapError: not ``torch.optim.Adam``, ``AdamW`` or ``SGD``.
    """
    if not issubclass(base, _SUPPORTED):
        raise WrapError(
            f"state={fmt} quantizes the state of torch.optim.Adam, AdamW and SGD (momentum), "
            f"but the optimizer is {type(optimizer).__name__}, whose state mixprec does not "
            "know how to quantize. Use one of those optimizers, or a policy without a low-bit "
            "state (drop state=...)"
        )


class LowBitState:
    """The quantized state of one ``wrap`` call's optimizers (see the module).

    :param fmt: the policy's low-bit format.
    :param names: id(tensor the optimizer updates) -> the parameter's qualified name.
    """

    def __init__(self, fmt: StateFormat, names: Mapping[int, str]) -> None:
        self.fmt = fmt
        self.tag = _tag(fmt)
        self.names = dict(names)
        self._held: list[_Codes] = []
        """The codes :meth:`widen` decoded, until :meth:`narrow` replaces them."""
        self._layouts: dict[int, Layout | None] = {}

    def _quantized(self, param: torch.Tensor) -> bool:
        # the whole parameter's size, also under FSDP2: every rank decides the same
        return self.fmt.quantizes(param.numel(), self.names.get(id(param)))

    def _layout(self, param: torch.Tensor) -> Layout | None:
        """Where the codes of a parameter FSDP2 shards live (:mod:`.shards`), None for a
        plain tensor."""
        key = id(param)
        if key not in self._layouts:
            self._layouts[key] = layout_of(param)
        return self._layouts[key]

    def _params(self, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        for group in optimizer.param_groups:
            yield from group["params"]

    # ------------------------------------------------------------------ the step

    def widen(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the update: every quantized state tensor decoded into float32."""
        self._held = []
        with torch.no_grad():
            for param in self._params(optimizer):
                state = optimizer.state.get(param)
                lay = self._layout(param)
                tag = _tag_of(self.tag, lay)
                if not state or tuple(state.get(FORMAT_KEY, ())) != tag:
                    continue
                for key, signed in _KEYS.items():
                    codes = state.get(key)
                    scale = state.pop(key + _SUFFIX, None)
                    if codes is None or scale is None:
                        continue
                    self._held.append((state, key, codes, scale, tag))
                    state[key] = self._decoded(codes, scale, signed, param, lay)
                del state[FORMAT_KEY]

    def _decoded(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        signed: bool,
        param: torch.Tensor,
        lay: Layout | None,
    ) -> torch.Tensor:
        """The float32 moment (of ``param``'s shape; a ``DTensor`` like it under FSDP2)."""
        if lay is not None:
            return shards.decode(codes, scale, lay, self.fmt, signed, param)
        return dequantize(codes, scale, self.fmt, signed, param.numel()).view(param.shape)

    def _encoded(
        self, value: torch.Tensor, signed: bool, lay: Layout | None
    ) -> tuple[torch.Tensor, torch.Tensor, bool | torch.Tensor]:
        """The codes, the absmax and whether every absmax is finite, of a float32 moment
        (this rank's shard of it under FSDP2)."""
        if lay is not None:
            return shards.encode_shard(value, lay, self.fmt, signed)
        return encode(value.detach().float(), self.fmt, signed)

    def narrow(self, optimizer: torch.optim.Optimizer) -> None:
        """After the update: every state tensor of a quantized parameter encoded again.

        :raises PolicyError: a state tensor holds inf or NaN; the state is left as before
            the step (codes and absmax).
        """
        encoded: list[_Codes] = []
        finite: list[bool | torch.Tensor] = []  # per tensor: from the kernels' pass, or lazy
        groups: dict[int, tuple[Any, torch.device]] = {}  # FSDP2's shard groups, in order
        with torch.no_grad():
            for param in self._params(optimizer):
                state = optimizer.state.get(param)
                if not state or not self._quantized(param):
                    continue
                lay = self._layout(param)
                if lay is not None:
                    group = lay.group()
                    groups.setdefault(id(group), (group, param.device))
                for key, signed in _KEYS.items():
                    value = state.get(key)
                    if not _is_moment(value, param):
                        continue
                    codes, scale, ok = self._encoded(value, signed, lay)
                    encoded.append((state, key, codes, scale, _tag_of(self.tag, lay)))
                    finite.append(ok)
            held, self._held = self._held, []
            if not encoded and not groups:
                return
            ok_here = _all_true(finite)
            if not _agreed(ok_here, list(groups.values())):
                for state, key, codes, scale, tag in held:  # the state as before the step
                    state[key] = codes
                    state[key + _SUFFIX] = scale
                    state[FORMAT_KEY] = tag
                if ok_here:  # another rank's shard: every rank refuses the step alike
                    raise self._non_finite_elsewhere()
                bad = next(i for i, ok in enumerate(finite) if not bool(ok))
                raise self._non_finite(optimizer, encoded[bad][0], encoded[bad][1])
        for state, key, codes, scale, tag in encoded:
            state[key] = codes
            state[key + _SUFFIX] = scale
            state[FORMAT_KEY] = tag

    @_eagerly
    def step_fused(self, optimizer: torch.optim.Optimizer) -> bool:
        """The whole update in one pass per tensor (:mod:`.fused_step`), in place of
        :meth:`widen`, the optimizer's own ``step`` (its hooks run around it as around that
        step) and :meth:`narrow`; False, with nothing changed, where the optimizer, its
        options, parameters or state do not qualify, or where a new moment could become inf
        or NaN (the caller takes the generic path, whose :meth:`narrow` refuses it).

        :raises PolicyError: a new moment is not finite all the same (the plan's bounds rule
            it out); its non-finite blocks keep their codes.
        """
        plan = fused_step.plan(
            optimizer, self.fmt, self.tag, self._quantized, _guard_squares(optimizer)
        )
        if plan is None:
            return False
        failed: fused_step.Moment | None = run_step_hooks(
            optimizer, lambda: fused_step.run(optimizer, plan)
        )
        if failed is not None:
            raise self._non_finite(optimizer, failed.state, failed.key)
        return True

    def _non_finite(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], key: str
    ) -> PolicyError:
        owners = (p for p in self._params(optimizer) if optimizer.state.get(p) is state)
        name = next((self.names.get(id(p), "?") for p in owners), "?")
        return PolicyError(
            f"state={self.fmt}: the optimizer's update made {key} of parameter {name!r} inf or "
            "NaN, which a quantized state cannot hold. Lower the learning rate or clip the "
            f"gradients, or keep this parameter's state in float32 (state={self.fmt.name}"
            f"(keep={name}))"
        )

    def _non_finite_elsewhere(self) -> PolicyError:
        return PolicyError(
            f"state={self.fmt}: the optimizer's update made a moment of another rank's shard "
            "inf or NaN (FSDP2), which a quantized state cannot hold; every rank kept its "
            "codes from before the step (that rank's error names the parameter). Lower the "
            "learning rate or clip the gradients, or keep that parameter's state in float32 "
            f"(state={self.fmt.name}(keep=<its name>))"
        )

    # ------------------------------------------------------------------ checkpoints

    def check_state_dict(
        self, optimizer: torch.optim.Optimizer, state: Any, groups: Any = None
    ) -> None:
        """Refuse a state dict's ``state`` written under another format or block size (or
        shard count), or with codes that do not fit its parameter, before anything is loaded.

        :param groups: the state dict's ``param_groups``, whose ``params`` name the state's
            keys in the optimizer's order (as torch's ``load_state_dict`` pairs them: ints,
            or the parameter names torch's DCP ``set_state_dict`` passes); else the keys are
            taken as positions.
        :raises CheckpointError: what is wrong and how to convert it; under FSDP2 on every
            rank of a shard group when one rank refuses its part (one all-reduce), so that
            no rank loads while another keeps its state.
        """
        shard_groups = self._shard_groups(optimizer)
        if not shard_groups:
            self._check_entries(optimizer, state, groups)
            return
        try:
            self._check_entries(optimizer, state, groups)
        except Exception:  # the other ranks wait in the agreement: join it, then raise
            _agreed(False, shard_groups)
            raise
        if not _agreed(True, shard_groups):
            raise CheckpointError(
                "another rank refused its part of the optimizer checkpoint (under FSDP2 each "
                "rank checks the codes of its own shards); nothing was loaded on any rank. "
                "That rank's error says what is wrong"
            )

    def _shard_groups(self, optimizer: torch.optim.Optimizer) -> list[tuple[Any, torch.device]]:
        """The shard groups of the quantized parameters FSDP2 shards (and their device), in
        the optimizer's order: the same on every rank."""
        found: dict[int, tuple[Any, torch.device]] = {}
        for param in self._params(optimizer):
            lay = self._layout(param)
            if lay is not None and self._quantized(param):
                group = lay.group()
                found.setdefault(id(group), (group, param.device))
        return list(found.values())

    def _check_entries(self, optimizer: torch.optim.Optimizer, state: Any, groups: Any) -> None:
        """:meth:`check_state_dict` on this rank."""
        if not isinstance(state, Mapping):
            return
        params = list(self._params(optimizer))
        owners = _owners(params, groups)
        for index, entry in state.items():
            if not isinstance(entry, Mapping) or FORMAT_KEY not in entry:
                continue
            tag = entry[FORMAT_KEY]
            found = _format_of(tag)
            param = owners.get(index) if isinstance(index, int | str) else None
            named = param is not None and id(param) in self.names
            where = f"state {index}" + (f" ({self.names[id(param)]!r})" if named else "")
            lay = None if param is None else self._layout(param)
            want = _tag_of(self.tag, lay)
            if found is None or tuple(tag) != want:
                raise CheckpointError(
                    f"the optimizer checkpoint's {where} was quantized as {_shown(tag)}, but "
                    f"this optimizer keeps its state as {_shown(want)} (policy "
                    f"state={self.fmt}). "
                    "Wrap with the checkpoint's state format, or convert the checkpoint: load "
                    "it into an optimizer wrapped with its format and save "
                    "mixprec.torch.float32_state_dict(optimizer), a float32 state that "
                    "loads under any format"
                )
            if param is None:
                continue
            for key, signed in _KEYS.items():
                codes, scale = entry.get(key), entry.get(key + _SUFFIX)
                if codes is None and scale is None:
                    continue
                if lay is None:
                    count, blocks = (
                        code_count(self.fmt, param.numel()),
                        blocks_of(self.fmt, param.numel()),
                    )
                    fits = f"{param.numel()} elements"
                else:  # this rank's part (the shard's padded rows)
                    count, blocks = lay.codes(self.fmt), lay.blocks(self.fmt)
                    fits = f"{lay.padded} elements on this rank (of {param.numel()})"
                if (
                    not isinstance(codes, torch.Tensor)
                    or not isinstance(scale, torch.Tensor)
                    or (lay is not None and not (is_sharded(codes) and is_sharded(scale)))
                    or codes.dtype != torch.uint8
                    or local(codes).numel() != count
                    or local(scale).numel() != blocks
                    or not scale.is_floating_point()
                ):
                    raise CheckpointError(
                        f"the optimizer checkpoint's {where} {key} does not fit its parameter "
                        f"of {fits} under {_shown(want)} (expected {count} uint8 codes and "
                        f"{blocks} float32 absmax"
                        + (", DTensors like the parameter" if lay is not None else "")
                        + "); the checkpoint belongs to another model or is damaged"
                    )
                codes, scale = local(codes), local(scale)  # this rank's part is checked
                if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
                    raise CheckpointError(
                        f"the optimizer checkpoint's {where} {key}.absmax holds inf, NaN or a "
                        "negative scale; the checkpoint is damaged. Load an earlier one"
                    )
                largest = _largest_code(codes, self.fmt)
                size = len(state_map(self.fmt.name, signed).values)
                if largest >= size:
                    raise CheckpointError(
                        f"the optimizer checkpoint's {where} {key} holds code {largest}, beyond "
                        f"the {size} values of {self.fmt.name}'s map; the checkpoint is damaged. "
                        "Load an earlier one"
                    )

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``load_state_dict`` (which casts every state tensor to the parameter's dtype):
        the codes back to ``uint8``; float32 state of quantized parameters encoded (a
        float32 checkpoint); quantized state of parameters now kept float32 decoded."""
        with torch.no_grad():
            for param in self._params(optimizer):
                state = optimizer.state.get(param)
                if not state:
                    continue
                if FORMAT_KEY in state:
                    # torch cast every state tensor to the parameter's dtype: the codes to
                    # float32 (exact: integers below 256), so back to uint8 (DTensors too)
                    for key in _KEYS:
                        if key + _SUFFIX in state:
                            state[key] = state[key].to(torch.uint8)
                            state[key + _SUFFIX] = state[key + _SUFFIX].float()
                    if not self._quantized(param):
                        self._decode(state, param)
                elif self._quantized(param):
                    self._encode(state, param)

    def _decode(self, state: dict[str, Any], param: torch.Tensor) -> None:
        lay = self._layout(param)
        for key, signed in _KEYS.items():
            scale = state.pop(key + _SUFFIX, None)
            if scale is not None and key in state:
                state[key] = self._decoded(state[key], scale, signed, param, lay).to(param.dtype)
        state.pop(FORMAT_KEY, None)

    def _encode(self, state: dict[str, Any], param: torch.Tensor) -> None:
        lay = self._layout(param)
        for key, signed in _KEYS.items():
            value = state.get(key)
            if _is_moment(value, param):
                if lay is None:
                    state[key], state[key + _SUFFIX] = quantize(value.float(), self.fmt, signed)
                else:
                    state[key], state[key + _SUFFIX], _ = self._encoded(value, signed, lay)
                state[FORMAT_KEY] = _tag_of(self.tag, lay)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """(bytes of optimizer state tensors, parameters) between steps, for reports: this
        rank's shards under FSDP2."""
        total = params = 0
        for param in self._params(optimizer):
            params += local(param).numel()
            for value in (optimizer.state.get(param) or {}).values():
                if isinstance(value, torch.Tensor) and local(value).numel() > 1:
                    part = local(value)
                    total += part.numel() * part.element_size()
        return total, params


def _owners(params: list[torch.Tensor], groups: Any) -> dict[Any, torch.Tensor]:
    """The parameter each key of a state dict's ``state`` stands for: paired through its
    ``param_groups`` as torch pairs them, else by position."""
    keys: list[Any] = list(range(len(params)))
    if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups):
        saved = [k for g in groups for k in g.get("params", ())]
        if len(saved) == len(params) and all(isinstance(k, int | str) for k in saved):
            keys = saved
    return dict(zip(keys, params, strict=True))


_Codes = tuple[dict[str, Any], str, torch.Tensor, torch.Tensor, tuple[int, ...]]
"""A state, a key, its codes, its absmax and the parameter's tag."""


def _agreed(ok: bool, groups: list[tuple[Any, torch.device]]) -> bool:
    """Whether every rank of each shard group (FSDP2) found its new moments finite: one
    all-reduce (MIN) per group, on the device of its parameters, so every rank keeps or
    refuses the step alike; ``ok`` where no parameter is sharded."""
    import torch.distributed as dist

    for group, device in groups:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    return ok


def _all_true(flags: list[bool | torch.Tensor]) -> bool:
    """Whether every flag holds: the kernels' bools at once, the twin's device flags with
    one sync for all."""
    if not all(f for f in flags if isinstance(f, bool)):
        return False
    lazy = [f for f in flags if isinstance(f, torch.Tensor)]
    return not lazy or bool(torch.stack(lazy).all())


def _largest_code(codes: torch.Tensor, fmt: StateFormat) -> int:
    """The largest code in ``codes`` (each nibble for 4 bits), 0 for none."""
    if not codes.numel():
        return 0
    codes = local(codes)
    if fmt.bits == 4:
        return int(torch.maximum(codes & 15, codes >> 4).max())
    return int(codes.max())


def _is_moment(value: object, param: torch.Tensor) -> TypeGuard[torch.Tensor]:
    return (
        isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape
    )


def float32_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every quantized state tensor decoded into float32 of
    its parameter's shape (a ``DTensor`` like it under FSDP2, which DCP can reshard): a
    checkpoint that loads under any state format, and into an
    unwrapped optimizer (the way back from a low-bit policy; load a quantized checkpoint
    into an optimizer wrapped with its format first).

    :raises WrapError: ``optimizer`` was not wrapped with a low-bit ``state``.
    """
    st = getattr(optimizer, "_mixprec", None)
    lowbit = None if st is None else st.group.lowbit
    if lowbit is None:
        raise WrapError(
            "float32_state_dict(optimizer) decodes a low-bit optimizer state, but this "
            "optimizer was not wrapped with a policy whose state is int8, int4 or fp8; its "
            "state_dict() is float32 already"
        )
    sd: dict[str, Any] = optimizer.state_dict()
    params = list(lowbit._params(optimizer))
    new_state: dict[Any, Any] = {}
    for index, entry in sd["state"].items():
        if not isinstance(entry, Mapping) or FORMAT_KEY not in entry:
            new_state[index] = entry
            continue
        entry = dict(entry)
        lowbit._decode(entry, params[index])
        new_state[index] = entry
    sd["state"] = new_state
    return sd


def _guard_squares(optimizer: torch.optim.Optimizer) -> fused_step.Squares | None:
    """The step guard's sum of squares of this step's gradients, where its native pass only
    read them (:meth:`mixprec_torch.cpu.grad_check.GuardPlan.squares_of`): the bound the
    fused step needs, without reading them again. The first ask makes the passes keep it
    (from the next step on)."""
    lay = optimizer_state(optimizer).layout
    guard = None if lay is None else lay.guard_plan
    if guard is None:
        return None
    guard.keep_squares = True
    squares: fused_step.Squares = guard.squares_of
    return squares
