"""Checkpoints: ``model.state_dict()`` holds exact float32 values whatever the opt level.

Two hooks on each wrapped model:

- a state-dict post-hook puts each parameter's float32 master in place of the
  low-precision parameter (exact values, never upcast float16), and upcasts what has no
  master (O3's parameters, cast buffers) to float32, using the buffer's original float32
  value when the buffer was not changed since wrap. A parameter that no longer equals its
  master rounded to its dtype was changed outside ``optimizer.step()`` (an EMA update, a
  re-initialisation): its own value, upcast, is saved instead of the stale master;
- a load pre-hook writes the incoming values into the masters first; PyTorch's loader then
  copies them into the model parameters, casting to their dtype.

So a wrapped model loads a plain float32 state dict, and a plain model loads a wrapped
model's state dict. ``optimizer.state_dict()`` carries the loss-scaler state, the step
tracker and the resolved policy under the ``"mixprec"`` key
(:func:`optimizer_state_dict` and :func:`load_optimizer_state_dict`, the ``state_dict`` and
``load_state_dict`` of the patched optimizer class). ``mixprec.torch.save`` is ``torch.save``
written atomically (temporary file, fsync, rename), sealed with a SHA-256 checksum of the
file in its zip comment; ``mixprec.torch.load`` checks the sizes, then the checksum, then
calls ``torch.load`` (:func:`save`, :func:`load`).

**DCP** (``torch.distributed.checkpoint``). torch's ``get_state_dict`` keys the optimizer
state by the model's parameter names, which it finds by looking up the optimizer's
parameters in the model: the float32 masters are not there (``KeyError``), and the
``"mixprec"`` entry is dropped. :func:`get_state_dict` and :func:`set_state_dict` are the same
functions for wrapped models (plain, DDP, FSDP2): the model part is torch's
(``get_model_state_dict``: the masters' exact values through the hooks above, DTensor shards
under FSDP2), the optimizer part is the wrapped optimizer's own state dict with each index
replaced by the name of the model parameter its master stands for, the ``"mixprec"`` entry
kept. DCP's dummy step (torch's ``_init_optim_state``: zero gradients, every ``lr`` 0, one
``step()`` on an optimizer without state, so that ``dcp.load`` has tensors to load into) is
recognised by the step (:func:`is_dcp_init_step`): the optimizer's own update runs, nothing is
counted, checked or scaled.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import warnings
import zipfile
from typing import IO, Any

import torch
from torch import nn

from mixprec.errors import CheckpointError, MixprecError, MixprecWarning, WrapError
from mixprec.kit import LossScaler, MasterWeights, Policy, Stage, atomic_path

from ..copies import CopyOnly
from ..torch_private import dcp_init_optimizer_state, load_strict, tensor_version
from .optimizer_state import Iteration, StepCompensation, base_class, optimizer_state

__all__ = [
    "ModelCheckpoint",
    "get_state_dict",
    "is_dcp_init_step",
    "load",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "save",
    "set_state_dict",
]

_STATE_KEY = "mixprec"
"""The optimizer state dict's entry for mixprec's part."""
_FORMAT = 1


class ModelCheckpoint(CopyOnly):
    """The state-dict hooks of one wrapped model.

    :param model: the root module.
    :param masters: the wrap call's master map (a parameter that is its own master has no
        separate float32 copy).
    :param buffers: (qualified module name, buffer name) -> the buffer's float32 value from
        before it was cast at wrap time.
    :param compensation: under ``master=kahan|stochastic``, the strategy: it saves the best
        float32 value it knows (weight + compensation) and splits a loaded one.
    """

    def __init__(
        self,
        model: nn.Module,
        masters: MasterWeights[torch.Tensor],
        buffers: dict[tuple[str, str], torch.Tensor],
        compensation: StepCompensation | None = None,
    ) -> None:
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        self.masters = masters
        self.compensation = compensation
        modules = dict(model.named_modules(remove_duplicate=False))
        self.buffers: dict[str, tuple[nn.Module, str, torch.Tensor, torch.Tensor, int]] = {}
        for (mname, bname), original in buffers.items():
            module = modules[mname]
            current = _buffer(module, bname)
            if current is None:
                continue
            key = f"{mname}.{bname}" if mname else bname
            self.buffers[key] = (module, bname, original, current, tensor_version(current))
        self._handles = [
            model.register_state_dict_post_hook(_Hook(self, "save_hook")),
            model.register_load_state_dict_pre_hook(_Hook(self, "load_hook")),
        ]

    def _after_deepcopy(self, new: ModelCheckpoint) -> None:
        # a copied tensor starts a new version count: a buffer unchanged since wrap here is
        # unchanged in the copy too, so the copy still saves its float32 original
        for name, (_mod, _bname, _original, cast, version) in self.buffers.items():
            mod, bname, original, copied, _ = new.buffers[name]
            if _buffer(_mod, _bname) is cast and tensor_version(cast) == version:
                new.buffers[name] = (mod, bname, original, copied, tensor_version(copied))
            else:
                new.buffers[name] = (mod, bname, original, copied, -1)

    def _master_of(self, param: nn.Parameter) -> torch.Tensor:
        """The master of ``param``; ``param`` itself when it has none, or when this hook was
        deep-copied with its model (the copy's parameters are new objects, not in the map)."""
        try:
            return self.masters.master_for(param)
        except WrapError:
            return param

    def save_hook(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        for name, param in self.params.items():
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
                continue  # absent, or keep_vars=True: the caller asked for the live objects
            best = None if self.compensation is None else self.compensation.best(param)
            if best is not None:
                state_dict[key] = best
                continue
            master = self._master_of(param)
            if master is not param and _rounds_to(master, param):
                state_dict[key] = master.detach()
            elif value.is_floating_point() and value.dtype != torch.float32:
                state_dict[key] = value.float()
        for name, (mod, bname, original, cast, version) in self.buffers.items():
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            current = _buffer(mod, bname)
            if (
                current is cast
                and tensor_version(current) == version
                and _unchanged(cast, original)
            ):
                state_dict[key] = original
            elif value.is_floating_point() and value.dtype != torch.float32:
                state_dict[key] = value.float()

    def load_hook(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise CheckpointError(
                "load_state_dict(..., assign=True) would replace the parameters mixprec "
                "converted (and the optimizer's masters would stop tracking them); load "
                "without assign=True: values are copied and cast into the wrapped model"
            )
        # before any master or param moves; PyTorch passes strict=True to every hook
        check_loadable(module, state_dict, prefix, strict=load_strict() is not False)
        with torch.no_grad():
            for name, param in self.params.items():
                master = self._master_of(param)
                value = state_dict.get(prefix + name)
                if not isinstance(value, torch.Tensor):
                    continue
                if self.compensation is not None and value.shape == param.shape:
                    # the working masters have no storage between steps: split the value
                    # into the bfloat16 weight (which the loader copies next) and its
                    # compensation instead
                    weight = self.compensation.split_loaded(param, value)
                    if weight is not None:
                        state_dict[prefix + name] = weight
                        continue
                if master is param:
                    continue
                if value.shape == master.shape:  # a mismatch is reported by the loader
                    master.copy_(value)
            for name, entry in list(self.buffers.items()):
                value = state_dict.get(prefix + name)
                mod, bname, original, cast, _ = entry
                if isinstance(value, torch.Tensor) and value.shape == original.shape:
                    fresh = value.detach().to(device=original.device, dtype=original.dtype).clone()
                    # the loader copies the value into the buffer next, bumping its version once
                    self.buffers[name] = (mod, bname, fresh, cast, tensor_version(cast) + 1)

    def remove(self) -> None:
        """Remove the two state-dict hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def check_loadable(module: nn.Module, state_dict: Any, prefix: str, strict: bool) -> None:
    """Refuse, before anything is copied, a state dict PyTorch's loader would refuse only
    after copying every other entry: a shape that differs from the model's, a value that is
    no tensor, and (``strict``) a missing or unexpected key. PyTorch raises its
    ``RuntimeError`` at the end, with the matching entries already written into the model
    (and, under mixprec, their masters).

    Keys are those of ``module.state_dict()``; what PyTorch's own loaders forgive is
    forgiven: a missing ``num_batches_tracked`` of a checkpoint saved before it existed
    (BatchNorm fills it in), and everything under a module that overrides
    ``_load_from_state_dict`` (it may read other keys).

    :raises CheckpointError: naming the first mismatches and the fix.
    """
    expected = module.state_dict(prefix=prefix, keep_vars=True)
    own = _custom_loaders(module, prefix)
    problems: list[str] = []
    for key, current in expected.items():
        if key not in state_dict:
            if strict and not _forgiven_missing(key, own, state_dict):
                problems.append(f"missing {key!r}")
            continue
        value = state_dict[key]
        if key.endswith("_extra_state") or not isinstance(current, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif not _is_lazy(current) and (value.shape != current.shape):
            problems.append(
                f"{key!r} has shape {list(value.shape)}, the model's {list(current.shape)}"
            )
    if strict:
        problems += [
            f"unexpected {key!r}"
            for key in state_dict
            if isinstance(key, str)
            and key.startswith(prefix)
            and key not in expected
            and not any(key.startswith(p) for p in own)
        ]
    if problems:
        shown = "; ".join(problems[:6]) + (
            f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
        )
        raise CheckpointError(
            f"the state dict does not match the model ({shown}); nothing was loaded: the "
            "model's parameters and float32 masters are unchanged. Load the checkpoint of "
            "this architecture; strict=False skips missing and unexpected keys (a shape "
            "mismatch never loads)"
        )


def _is_lazy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a lazy module's parameter or buffer without a shape yet."""
    return isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)  # type: ignore[attr-defined]


def _custom_loaders(module: nn.Module, prefix: str) -> list[str]:
    """The key prefixes of submodules whose class overrides ``_load_from_state_dict`` (other
    than BatchNorm's, whose one addition :func:`_forgiven_missing` knows)."""
    plain = (nn.Module._load_from_state_dict, _NORM_LOAD)
    return [
        f"{prefix}{name}." if name else prefix
        for name, sub in module.named_modules()
        if type(sub)._load_from_state_dict not in plain
    ]


_NORM_LOAD = nn.modules.batchnorm._NormBase._load_from_state_dict


def _forgiven_missing(key: str, own: list[str], state_dict: Any) -> bool:
    """Whether PyTorch's loader itself fills in or reads around a missing ``key``."""
    if any(key.startswith(p) for p in own):
        return True
    if key.endswith(".num_batches_tracked") or key == "num_batches_tracked":
        owner = key.rpartition(".")[0]
        version = getattr(state_dict, "_metadata", {}).get(owner, {}).get("version")
        return version is None or version < 2  # BatchNorm adds it for older checkpoints
    return False


class _Hook(CopyOnly):
    """A hook object (torch marks state-dict hooks with an attribute; methods take none)."""

    def __init__(self, owner: ModelCheckpoint, method: str) -> None:
        self.owner = owner
        self.method = method

    def __call__(self, *args: Any) -> None:
        getattr(self.owner, self.method)(*args)


def _buffer(module: nn.Module, name: str) -> torch.Tensor | None:
    """The module's buffer ``name`` (None when it was set to None or is no longer a tensor)."""
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _rounds_to(master: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``param`` still equals ``master`` rounded to the param's dtype."""
    if master.shape != param.shape:
        return False
    return bool(torch.equal(master.detach().to(param.dtype), param.detach()))


# ------------------------------------------------------------------------------------------
# The optimizer's state dict


def optimizer_state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict plus mixprec's: scaler, step tracker, resolved policy."""
    sd: dict[str, Any] = base_class(self).state_dict(self)
    st = getattr(self, "_mixprec", None)
    if st is not None:
        sd[_STATE_KEY] = {
            "format": _FORMAT,
            "scaler": st.group.scaler.state_dict(),
            "tracker": {"steps": st.tracker.steps},
            "policy": st.group.policy.to_dict(),
        }
        if st.group.compensation is not None:
            sd[_STATE_KEY]["compensation"] = st.group.compensation.state_dict()
        if st.group.fp8 is not None:
            sd[_STATE_KEY]["fp8"] = st.group.fp8.state_dict()
    return sd


def load_optimizer_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load an optimizer state dict; mixprec's part (if any) restores scaler and tracker.

    A plain PyTorch state dict (no ``"mixprec"`` entry) loads too; the scaler then keeps its
    current state. The ``"mixprec"`` entry is checked whole before anything is loaded: a
    malformed one raises :class:`CheckpointError` with the optimizer state, the scale and
    the step count unchanged.
    """
    state_dict = dict(state_dict)
    extra = state_dict.pop(_STATE_KEY, None)
    st = getattr(self, "_mixprec", None)
    steps = None
    if extra is not None and st is not None:
        if not isinstance(extra, dict):
            raise CheckpointError(
                f"the optimizer state dict's 'mixprec' entry is a {type(extra).__name__}, not "
                f"a dict; {_HINT}"
            )
        saved_policy = extra.get("policy")
        if saved_policy is not None:
            saved = _saved_policy(saved_policy)
            if saved != st.group.policy:
                warnings.warn(
                    f"the checkpoint was saved under policy {saved} but this optimizer is "
                    f"wrapped with {st.group.policy}; training continues with the current "
                    "policy. Wrap with the saved policy (optimizer.state_dict()['mixprec']"
                    "['policy']) to resume exactly",
                    MixprecWarning,
                    stacklevel=2,
                )
        steps = _check_entry(extra, st.group.scaler, st.tracker.steps)
        if st.group.compensation is not None and "compensation" in extra:
            st.group.compensation.check_state_dict(extra["compensation"])
        if st.group.fp8 is not None and "fp8" in extra:
            st.group.fp8.check_state_dict(extra["fp8"])
    if st is not None:
        _check_finite_state(state_dict.get("state"))
        if st.group.lowbit is not None:
            st.group.lowbit.check_state_dict(
                self, state_dict.get("state"), state_dict.get("param_groups")
            )
    base = base_class(self)
    base.load_state_dict(self, state_dict)
    if st is not None and st.group.compensation is not None:
        st.group.compensation.adopt_state(self)  # torch cast a bfloat16 state to float32
    if st is not None and st.group.lowbit is not None:
        st.group.lowbit.adopt(self)  # a float32 state quantized, absmax back to float32
    if extra is not None and st is not None and steps is not None:
        st.group.scaler.load_state_dict(extra["scaler"])
        if st.group.compensation is not None and "compensation" in extra:
            st.group.compensation.load_state_dict(extra["compensation"])
        if st.group.fp8 is not None and "fp8" in extra:
            st.group.fp8.load_state_dict(extra["fp8"])
        st.tracker.reset()
        st.tracker.steps = steps
        st.iteration = Iteration()  # what the step in progress had found no longer applies


_HINT = "save it with optimizer.state_dict() of an optimizer wrapped by mixprec.torch.wrap"


def _check_entry(extra: dict[str, Any], scaler: LossScaler, steps: int) -> int:
    """Check the ``"mixprec"`` entry without changing anything; return the saved step count."""
    hint = _HINT
    if "scaler" not in extra:
        raise CheckpointError(
            f"the optimizer state dict's 'mixprec' entry has no 'scaler' (it holds "
            f"{sorted(map(str, extra))}); {hint}"
        )
    try:
        # a probe scaler takes the state first, so a malformed one raises before any change
        LossScaler(scaler.state.fresh()).load_state_dict(extra["scaler"])
    except CheckpointError as err:
        raise CheckpointError(f"the optimizer state dict's 'mixprec' entry: {err}") from err
    tracker = extra.get("tracker", {"steps": steps})
    saved = tracker.get("steps", steps) if isinstance(tracker, dict) else None
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 0:
        raise CheckpointError(
            f"the optimizer state dict's 'mixprec' entry has tracker {tracker!r}; expected "
            f"{{'steps': <non-negative int>}}; {hint}"
        )
    return saved


def _check_finite_state(state: Any) -> None:
    """Refuse optimizer state holding an inf or NaN (a damaged checkpoint): loaded, Adam's
    moments would put it into the weights at the next step, which the guard cannot see (it
    checks gradients). One host read per state tensor, at load time only."""
    if not isinstance(state, dict):
        return  # PyTorch's own loader names a malformed state
    for index, values in state.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if (
                isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and not bool(torch.isfinite(value).all())
            ):
                raise CheckpointError(
                    f"the optimizer state dict holds an inf or NaN (parameter {index}, "
                    f"{key!r}); loaded, it would reach the weights at the next step. The "
                    "checkpoint is damaged: load an earlier one (nothing was loaded)"
                )


def _saved_policy(data: Any) -> Policy:
    try:
        return Policy.from_dict(data)
    except (MixprecError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(
            f"the optimizer state dict's 'mixprec' entry holds a malformed policy ({err}); {_HINT}"
        ) from err


# ---------------------------------------------------------------------- save and load

#: The zip comment :func:`save` writes: this tag and the SHA-256 (hex) of every byte of the
#: file before the comment. ``torch.load`` reads the file as it reads any other.
_SEAL = b"mixprec-sha256:"
_SEAL_SIZE = len(_SEAL) + 64
#: The zip format's end-of-central-directory record: its signature and fixed size.
_EOCD = b"PK\x05\x06"
_EOCD_SIZE = 22
_CHUNK = 1 << 20


def save(obj: Any, f: str | os.PathLike[str] | IO[bytes], **kwargs: Any) -> None:
    """``torch.save(obj, f)``, atomic and sealed with a checksum.

    Atomic when ``f`` is a path: a temporary file in the same folder is written, fsynced and
    renamed over ``f``, so a save that is killed or fails half-way leaves the previous
    checkpoint whole (:mod:`mixprec.atomic`). The file is torch's own zip format with a
    SHA-256 of its bytes in the zip comment: ``torch.load`` reads it as any checkpoint, and
    :func:`load` refuses it when a byte changed. A file object gets the same bytes (built in
    memory first).

    Example::

        mixprec.torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")
        state = mixprec.torch.load("ckpt.pt")

    :raises CheckpointError: ``_use_new_zipfile_serialization=False`` (the legacy format
        has no place for the checksum); nothing is written.
    """
    if isinstance(f, (str, os.PathLike)):
        with atomic_path(f) as tmp:
            torch.save(obj, tmp, **kwargs)
            with open(tmp, "r+b") as out:
                _seal(out)
    else:
        buffer = io.BytesIO()
        torch.save(obj, buffer, **kwargs)
        _seal(buffer)
        f.write(buffer.getvalue())


def load(
    f: str | os.PathLike[str] | IO[bytes],
    map_location: Any = None,
    *,
    weights_only: bool = True,
    **kwargs: Any,
) -> Any:
    """``torch.load`` of a file :func:`save` wrote, once its sizes and checksum hold.

    Before anything is read whole: the zip comment must hold :func:`save`'s checksum, and
    every record of the zip must be stored (never compressed, so nothing inflates) and lie
    within the file. Then the file is hashed in chunks and compared; only a whole, unchanged
    file reaches ``torch.load``, through the same open file (a file replaced in between is
    not read). ``weights_only=True`` (torch's default since 2.6) is kept unless given.

    Example::

        state = mixprec.torch.load("ckpt.pt", map_location="cpu")
        model.load_state_dict(state["model"])

    :param f: a path, or a seekable binary file object.
    :param map_location, kwargs: as ``torch.load``.
    :raises CheckpointError: a file :func:`save` did not write (no checksum: a plain
        ``torch.save`` file, or one from before checksums), one cut short or damaged
        (a flipped byte anywhere), or one whose zip records are compressed or reach past
        its end; nothing is loaded.
    """
    if isinstance(f, (str, os.PathLike)):
        name = os.fspath(f)
        try:
            source: IO[bytes] = open(f, "rb")
        except OSError as err:
            raise CheckpointError(f"cannot read the checkpoint {name!r}: {err}") from None
        with source:
            _check_sealed(source, name)
            source.seek(0)
            return torch.load(source, map_location, weights_only=weights_only, **kwargs)
    name = str(getattr(f, "name", "the file object"))
    if not (hasattr(f, "seekable") and f.seekable()):
        raise CheckpointError(
            f"mixprec.torch.load needs a path or a seekable file, and {name!r} cannot seek: its "
            "size and checksum are checked before it is read; read it into io.BytesIO first"
        )
    if f.tell() != 0:
        raise CheckpointError(
            f"{name!r} is at byte {f.tell()}; mixprec.torch.load reads a checkpoint that starts "
            "its file (its checksum covers the whole file): seek(0), or load from a path"
        )
    _check_sealed(f, name)
    f.seek(0)
    return torch.load(f, map_location, weights_only=weights_only, **kwargs)


def _digest(f: IO[bytes], start: int, end: int) -> bytes:
    """SHA-256 of bytes ``[start, end)`` of ``f``, read in chunks."""
    digest = hashlib.sha256()
    f.seek(start)
    left = end - start
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest().encode("ascii")


def _seal(f: IO[bytes]) -> None:
    """Write the checksum into the zip comment of the torch checkpoint in ``f``."""
    size = f.seek(0, os.SEEK_END)
    f.seek(size - _EOCD_SIZE if size >= _EOCD_SIZE else 0)
    tail = f.read(_EOCD_SIZE)
    if len(tail) != _EOCD_SIZE or tail[:4] != _EOCD or tail[-2:] != b"\0\0":
        raise CheckpointError(
            "mixprec.torch.save writes torch's zip format, whose comment carries the "
            "checksum, and torch.save wrote another (_use_new_zipfile_serialization=False?); "
            "save without that option. Nothing was written"
        )
    f.seek(size - 2)
    f.write(struct.pack("<H", _SEAL_SIZE))
    digest = _digest(f, 0, size)  # everything up to the comment, its length included
    f.seek(size)
    f.write(_SEAL + digest)
    f.truncate()


def _check_sealed(f: IO[bytes], name: str) -> None:
    """Refuse ``f`` unless it is a whole file :func:`save` wrote."""
    size = f.seek(0, os.SEEK_END)
    damaged = (
        f"checkpoint {name!r} is damaged (a changed byte, a cut or an edit): it does not match "
        "the checksum mixprec.torch.save wrote into it. Load an earlier copy, or save again"
    )
    if size < _EOCD_SIZE + _SEAL_SIZE:
        raise CheckpointError(
            f"checkpoint {name!r} holds {size} bytes, too few for a checkpoint "
            "mixprec.torch.save wrote: it is cut short or not a checkpoint"
        )
    f.seek(size - _EOCD_SIZE - _SEAL_SIZE)
    tail = f.read(_EOCD_SIZE + _SEAL_SIZE)
    record, seal = tail[:_EOCD_SIZE], tail[_EOCD_SIZE:]
    if tail[-_EOCD_SIZE:][:4] == _EOCD and tail[-2:] == b"\0\0":  # a zip with no comment
        raise CheckpointError(
            f"checkpoint {name!r} has no mixprec checksum: mixprec.torch.save did not write it "
            "(a plain torch.save, or a mixprec before checksums). If you trust it, load it "
            "with torch.load(path, weights_only=True), then save it again with "
            "mixprec.torch.save"
        )
    sealed = record[:4] == _EOCD and record[-2:] == struct.pack("<H", _SEAL_SIZE)
    if not (sealed and seal.startswith(_SEAL)):
        raise CheckpointError(damaged)
    if _digest(f, 0, size - _SEAL_SIZE) != seal[len(_SEAL) :]:
        raise CheckpointError(damaged)
    _check_records(f, name, size)  # whole as written: a record that inflates was written so


def _check_records(f: IO[bytes], name: str, size: int) -> None:
    """Every record stored (nothing to inflate) and inside the file, read from the central
    directory alone, before any record is read."""
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
    except Exception as err:  # any way a directory fails to parse: not torch's zip
        raise CheckpointError(
            f"checkpoint {name!r} is damaged: its zip directory cannot be read ({err}). Load "
            "an earlier copy, or save again"
        ) from None
    total = 0
    for info in infos:
        total += info.file_size
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.compress_size != info.file_size
            or info.header_offset + info.file_size > size
            or total > size
        ):
            raise CheckpointError(
                f"checkpoint {name!r} holds a record ({info.filename!r}, {info.file_size} "
                f"bytes) that is compressed or reaches past the file's {size} bytes; "
                "mixprec.torch.save stores every record as it is. It is damaged or not one of "
                "mixprec's checkpoints"
            )


def _unchanged(cast: torch.Tensor, original: torch.Tensor) -> bool:
    """Whether ``cast`` still holds ``original`` rounded to its dtype. The version counter
    alone does not tell: the CPU batch-norm kernel updates low-precision running statistics
    in place without bumping it."""
    return bool(torch.equal(cast, original.to(device=cast.device, dtype=cast.dtype)))


# ------------------------------------------------------------------------------------------
# DCP: torch.distributed.checkpoint's state dicts


def is_dcp_init_step(st: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether this ``step()`` is DCP's dummy step (``_init_optim_state``): an optimizer with
    no state, no backward pass since its last step, every ``lr`` 0 and every gradient zero.
    The step then runs only the optimizer's own update (it creates the state DCP loads into
    and, with ``lr`` 0, moves nothing) and counts nothing."""
    if optimizer.state or st.tracker.stage is not Stage.READY or st.tracker.backwards:
        return False
    groups = optimizer.param_groups
    if not all("lr" in g and float(g["lr"]) == 0.0 for g in groups):
        return False
    grads = [p.grad for g in groups for p in g["params"] if p.requires_grad]
    return bool(grads) and all(
        grad is not None and not bool(torch.count_nonzero(grad)) for grad in grads
    )


def _param_names(st: Any, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Per param group, the name of the model parameter each of its entries stands for."""
    model_of = {id(m): p for p, m in st.group.masters.copied_pairs()}
    names = st.group.names
    out = []
    for group in optimizer.param_groups:
        row = []
        for entry in group["params"]:
            param = model_of.get(id(entry), entry)
            name = names.get(id(param))
            if name is None:
                raise CheckpointError(
                    "a parameter of the optimizer is in none of the wrapped models; "
                    "get_state_dict/set_state_dict need every optimizer parameter to be a "
                    "model parameter (or its master)"
                )
            row.append(name)
        out.append(row)
    return out


def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, options: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's ``get_state_dict`` for a wrapped model (plain, DDP or FSDP2) and its optimizer.

    :returns: ``(model_state_dict, optimizer_state_dict)``: the model's by torch's
        ``get_model_state_dict`` (exact float32 masters), the optimizer's keyed by parameter
        name as torch's, with the float32 masters' state and the ``"mixprec"`` entry (loss
        scale, counts, policy). An optimizer without state gets it first through DCP's own
        dummy step (not counted), so the dicts serve as ``dcp.load`` templates.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    st = optimizer_state(optimizer, "get_state_dict")
    if not optimizer.state:
        dcp_init_optimizer_state(optimizer)
    model_sd: dict[str, Any] = get_model_state_dict(model, options=options)
    sd = optimizer.state_dict()
    names = _param_names(st, optimizer)
    flat = [name for row in names for name in row]
    state = {flat[index]: values for index, values in sd["state"].items()}
    groups = []
    for row, group in zip(names, sd["param_groups"], strict=True):
        groups.append({**group, "params": list(row)})
    out = {"state": state, "param_groups": groups}
    if _STATE_KEY in sd:
        out[_STATE_KEY] = sd[_STATE_KEY]
    return model_sd, out


def set_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    model_state_dict: dict[str, Any] | None = None,
    optim_state_dict: dict[str, Any] | None = None,
    options: Any = None,
) -> None:
    """DCP's ``set_state_dict`` for what :func:`get_state_dict` returned (after ``dcp.load``).

    The model's part goes through torch's ``set_model_state_dict`` (into the masters, then the
    parameters); the optimizer's is matched by parameter name, group by group, and loaded with
    the wrapped optimizer's ``load_state_dict`` (the ``"mixprec"`` entry restores the loss
    scale and the counts).

    :raises CheckpointError: a group whose parameter names differ from the optimizer's;
        nothing of the optimizer is loaded then.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    st = optimizer_state(optimizer, "set_state_dict")
    converted = None
    if optim_state_dict is not None:
        names = _param_names(st, optimizer)
        saved_groups = optim_state_dict.get("param_groups", [])
        if [list(g.get("params", [])) for g in saved_groups] != names:
            raise CheckpointError(
                "the optimizer state dict's param groups name other parameters than this "
                "optimizer's (or in another order); nothing was loaded. Build the optimizer as "
                "it was when the checkpoint was saved"
            )
        index = {name: i for i, name in enumerate(n for row in names for n in row)}
        saved_state = optim_state_dict.get("state", {})
        groups = []
        for row, group in zip(names, saved_groups, strict=True):
            groups.append({**group, "params": [index[name] for name in row]})
        converted = {
            "state": {index[name]: saved_state[name] for name in index if name in saved_state},
            "param_groups": groups,
        }
        if _STATE_KEY in optim_state_dict:
            converted[_STATE_KEY] = optim_state_dict[_STATE_KEY]
    if model_state_dict is not None:
        set_model_state_dict(model, model_state_dict, options=options)
    if converted is not None:
        optimizer.load_state_dict(converted)
