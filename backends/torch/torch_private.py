"""Every private PyTorch name the backend uses, each behind one function, with the reason.

PyTorch may rename or drop a private name in any release. Keeping each one here means a
torch upgrade breaks one file, and ``tests/torch/test_torch_private.py`` (which calls
:func:`problems`) says which name changed instead of a step failing somewhere deep inside.
Public alternatives are used wherever they cost nothing (buffers are read with ``getattr`` and
replaced with ``setattr``, not through ``Module._buffers``); what stays here has no public
equivalent, or its public equivalent is slower on the per-step hot path.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "active_ddp_module",
    "compiled_inner",
    "dcp_init_optimizer_state",
    "dispatch_key",
    "excluding",
    "fake_tensor_mode",
    "foreach_add_",
    "foreach_copy_",
    "foreach_norm_float32",
    "foreach_zero_",
    "fsdp_mixed_precision",
    "has_scaled_mm",
    "in_backward",
    "is_scheduler_step_wrapper",
    "kernel_origin",
    "keys_after",
    "load_strict",
    "mark_step_hooked",
    "never_compiled",
    "next_sequence_nr",
    "non_finite_check_and_unscale_",
    "onednn_runs_bfloat16",
    "op_schema",
    "problems",
    "registered_by_torch",
    "run_step_hooks",
    "running_node_sequence_nr",
    "scaled_mm",
    "scheduler_step_wrapper",
    "sole_owner",
    "sparse_values",
    "tensor_version",
    "tensor_versions",
    "tracing_context",
]


def non_finite_check_and_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` to 1.0 if any is
    inf or NaN: one fused kernel per (device, dtype), no host sync.

    Why private: ``torch.amp.GradScaler`` uses this very kernel and it has no public name;
    the public route (``torch._foreach_mul_`` plus an ``isfinite`` reduction per tensor) is
    several kernels per tensor and a host sync, on every step.
    """
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i (casting), as one fused foreach call.

    Why private: torch has no public multi-tensor copy; the public ``copy_`` per tensor is
    one Python call and one kernel per parameter on every step (measured slower, see
    docs/architecture.md).
    """
    torch._foreach_copy_(dst, src)


def foreach_norm_float32(tensors: list[torch.Tensor], ord: float = 2.0) -> tuple[torch.Tensor, ...]:
    """The ``ord``-norm of each tensor, accumulated and returned in float32: one fused
    kernel per call, results on the device (no host sync). An inf or NaN element gives an
    inf or NaN norm, and so does a 2-norm whose sum of squares leaves float32's range.

    Why private: the step guard needs it on every step. The public route,
    ``torch.nn.utils.get_total_norm``, returns the norm in the gradients' own dtype (a float16
    model's total norm overflows at 65504, a false skip), and ``torch.linalg.vector_norm`` per
    tensor is one kernel and one Python call per parameter.
    """
    return tuple(torch._foreach_norm(tensors, ord, dtype=torch.float32))


def foreach_add_(tensors: list[torch.Tensor], value: float) -> None:
    """``t.add_(value)`` for every tensor, as one fused foreach call (the fused update's step
    counters, as torch's own Adam increments them).

    Why private: torch has no public multi-tensor add; one ``add_`` per parameter is one
    Python call and one kernel each, on every step.
    """
    torch._foreach_add_(tensors, value)


def foreach_zero_(tensors: list[torch.Tensor]) -> None:
    """``t.zero_()`` for every tensor, as one fused foreach call (what
    ``Optimizer.zero_grad(set_to_none=False)`` itself uses).

    Why private: no public multi-tensor zero exists.
    """
    torch._foreach_zero_(tensors)


def has_scaled_mm() -> bool:
    """Whether this torch build has :func:`scaled_mm` at all (else FP8 is emulated)."""
    return callable(getattr(torch, "_scaled_mm", None))


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` for FP8 ``a`` (row-major) and ``b`` (column-major),
    in ``out_dtype``: the FP8 GEMM (tensor cores on CUDA 8.9+, a float32 kernel on the CPU).

    Why private: torch's only FP8 GEMM is ``torch._scaled_mm`` (what torchao and Transformer
    Engine's torch path call); there is no public one. Where it is missing or refuses a
    device, recipe or shape, :mod:`mixprec_torch.fp8.numerics` emulates it exactly.
    """
    return torch._scaled_mm(  # type: ignore[no-any-return]
        a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype
    )


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter.

    Why private: the only way to tell that a buffer was not written since wrap (so the
    checkpoint can save its exact float32 original instead of the upcast low-precision
    value) without keeping a copy and comparing it on every save.
    """
    return int(tensor._version)


def tensor_versions(tensors: list[torch.Tensor]) -> list[int]:
    """The in-place modification counters of ``tensors``, in order.

    Why private: as :func:`tensor_version`; read for every master-backed parameter on each
    step to notice weights a user edited in place since the last master copy
    (:mod:`mixprec_torch.step.model_edits`), which costs one integer per parameter where keeping
    and comparing copies would cost the weights' memory and a pass over them.
    """
    return [t._version for t in tensors]


def onednn_runs_bfloat16() -> bool:
    """Whether this torch's oneDNN runs bfloat16 matmuls and convolutions at its effective ISA
    (False for a build without oneDNN).

    Why private: ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` is the only check that honours
    oneDNN's own ISA (``ONEDNN_MAX_CPU_ISA=AVX2`` makes it False on an AVX512-BF16 CPU); the
    public ``torch.backends.mkldnn.is_available()`` says only that oneDNN is built in.
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def sole_owner(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` is referenced by nothing but this one storage object: no tensor,
    view or other storage object (in Python or in C++, an autograd graph included) holds it.

    Why private: reusing a freed gradient's memory is safe only when nobody can read it any
    more (a user who kept ``g = master.grad`` before ``zero_grad()`` must find ``g``
    unchanged). Python's reference count cannot tell (views and C++ holders do not show in
    it); the storage's own use count, ``torch._C._storage_Use_Count``, is the only measure
    and has no public name.
    """
    return int(torch._C._storage_Use_Count(storage._cdata)) == 1


def sparse_values(tensor: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse COO tensor, coalesced or not.

    Why private: the public ``Tensor.values()`` refuses uncoalesced tensors, and coalescing
    a sparse gradient to read it would change what the optimizer receives.
    """
    return tensor._values()


def compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped, when ``module`` is its ``OptimizedModule``;
    None otherwise.

    Why private: ``OptimizedModule`` and its ``_orig_mod`` attribute are torch.compile's
    internals, and there is no public way to ask a compiled module for the original one.
    """
    if type(module).__name__ != "OptimizedModule":
        return None
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


# -------------------------------------------------------------------------------------------
# distributed wrappers: DDP, FSDP2, DCP


def active_ddp_module() -> Any:
    """The ``DistributedDataParallel`` whose forward is running now (None outside one).

    Why private: ``DistributedDataParallel._active_ddp_module`` is how DDP tells its own
    compiled-region optimizer which DDP runs; a wrapped model has no public way to learn the
    DDP around it, and its process group is where mixprec's overflow consensus must run.
    """
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def fsdp_mixed_precision(module: torch.nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` FSDP2's ``fully_shard`` gave ``module`` (None when
    ``module`` is not an ``FSDPModule``).

    Why private: FSDP2 keeps it only in the module's state (``FSDPModule._get_fsdp_state()``,
    field ``_mp_policy``); there is no public getter, and ``wrap`` must refuse a user's
    ``fully_shard(mp_policy=...)`` that computes in another dtype than the policy.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without distributed
        return None
    if not isinstance(module, FSDPModule):
        return None
    return getattr(module._get_fsdp_state(), "_mp_policy", None)


def dcp_init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """DCP's own initialisation of an optimizer without state: zero gradients, every ``lr``
    set to 0, one ``optimizer.step()`` (the step recognises it, see
    :func:`mixprec_torch.step.checkpoint.is_dcp_init_step`).

    Why private: ``torch.distributed.checkpoint.state_dict._init_optim_state`` is what
    ``get_state_dict``/``set_state_dict`` run; calling the same function keeps mixprec's
    state dicts shaped exactly like DCP's.
    """
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


# -------------------------------------------------------------------------------------------
# torch.optim's step protocol with LR schedulers and the profiler


def is_scheduler_step_wrapper(func: Any) -> bool:
    """Whether ``func`` is the wrapper an LR scheduler put on an optimizer's ``step``.

    Why private: ``LRScheduler`` marks its wrapper with ``_wrapped_by_lr_sched`` and counts
    calls through ``optimizer._opt_called`` (to warn about ``scheduler.step()`` before
    ``optimizer.step()``); no public API says whether a scheduler wrapped a step.
    """
    return bool(getattr(func, "_wrapped_by_lr_sched", False))


def scheduler_step_wrapper(
    optimizer: torch.optim.Optimizer, func: Callable[..., Any]
) -> Callable[..., Any]:
    """A step wrapper like the one an LR scheduler installs, around the class's ``func``.

    ``wrap`` swaps the optimizer's class; a scheduler created before that stored a wrapper
    around the *old* step on the instance, which would bypass the patched one. This builds
    the same wrapper (``_opt_called`` set on each call, ``_wrapped_by_lr_sched`` marking it)
    around the patched step, holding the optimizer weakly as torch does.
    """
    opt_ref = weakref.ref(optimizer)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return wrapper


def mark_step_hooked(func: Callable[..., Any]) -> None:
    """Tell ``torch.optim.Optimizer`` that ``func`` (a class's ``step``) needs no profiling
    wrapper of its own.

    Why private: ``Optimizer.__init__`` wraps a class's ``step`` for the profiler and the
    step hooks unless ``step.hooked`` is set; the patched step calls the base class's
    ``step``, which is wrapped already, so wrapping again would run the hooks twice.
    """
    func.hooked = True  # type: ignore[attr-defined]


def run_step_hooks(optimizer: torch.optim.Optimizer, update: Callable[[], Any]) -> Any:
    """Run ``update`` in place of the optimizer's own ``step``, as that step runs: inside
    the profiler's ``Optimizer.step#...`` range, after the step pre-hooks (global and the
    optimizer's own) and before the post-hooks.

    Why private-adjacent: ``Optimizer.profile_hook_step`` is the decorator torch wraps every
    optimizer class's ``step`` in; it is the only way to give hooks registered with
    ``register_step_pre_hook``/``register_step_post_hook`` (and the global ones) a step that
    does not call the class's own ``step``.
    """

    def step(opt: torch.optim.Optimizer) -> Any:
        return update()

    return torch.optim.Optimizer.profile_hook_step(step)(optimizer)


# In a compiled optimizer step the fused update is a graph break anyway (it calls native code);
# tracing a wrapper made per call would fail dynamo's guards on the decorator's ParamSpec.
run_step_hooks = torch.compiler.disable(
    run_step_hooks, reason="mixprec: the fused compensated update runs eagerly"
)


# -------------------------------------------------------------------------------------------
# The check the test suite runs against the installed torch


def in_backward() -> bool:
    """Whether this thread is running an autograd backward pass now.

    A module of a wrapped model called from outside its forward, during backward, is an
    activation checkpoint's recomputation (``torch.utils.checkpoint``, either mode): it must
    run as it ran inside the forward, not as a fresh entry. ``torch._C._current_graph_task_id``
    (-1 outside backward) is what ``torch.utils.checkpoint`` itself reads; there is no
    public equivalent.
    """
    return bool(torch._C._current_graph_task_id() != -1)


# -------------------------------------------------------------------------------------------
# O1 at torch's Autocast dispatch keys (mixprec_torch.o1.autocast_kernels, mixprec_torch.o1.regions)


def dispatch_key(kind: str, device_type: str) -> torch.DispatchKey:
    """The dispatch key of ``kind`` (``"Autocast"``, ``"Autograd"``) for a device type:
    ``("Autocast", "cpu")`` -> ``AutocastCPU``.

    Why private: ``torch._C._dispatch_key_for_device`` is the only map from a device type to
    its dispatch key name (``torch.library.register_autocast`` builds the key the same way).
    """
    return getattr(torch.DispatchKey, kind + torch._C._dispatch_key_for_device(device_type))  # type: ignore[no-any-return]


def keys_after(key: torch.DispatchKey) -> torch.DispatchKeySet:
    """Every dispatch key below ``key``: the keys a kernel at ``key`` that falls through
    hands its call on to (``op.redispatch(keyset & keys_after(key), ...)``).

    Why private: ``torch._C._dispatch_keyset_full_after`` is the only way to build that set
    (what the C++ dispatcher does for a fallthrough kernel).
    """
    return torch._C._dispatch_keyset_full_after(key)


def excluding(keys: torch.DispatchKey | torch.DispatchKeySet) -> Any:
    """A context manager under which ``keys`` are skipped for every op (the thread's
    excluded set), as torch's own autocast kernels run the op they cast.

    Why private: ``torch._C._ExcludeDispatchKeyGuard`` is what ``torch.library.register_autocast``
    itself uses; there is no public name.
    """
    if isinstance(keys, torch.DispatchKey):
        keys = torch.DispatchKeySet(keys)
    return torch._C._ExcludeDispatchKeyGuard(keys)


def kernel_origin(op_name: str, key: torch.DispatchKey) -> str | None:
    """Where the kernel registered for ``op_name`` (``"aten::softmax.int"``) at ``key`` itself
    was registered (``"registered at /path/file.py:12"``); None when nothing is registered at
    that key (a fallthrough, or a kernel that comes from an alias key such as Autograd).

    Why private: ``torch._C._dispatch_has_kernel_for_dispatch_key`` tells a registration at
    the key itself from a computed one; the origin is the debug text of the public
    ``torch.library.get_kernel``.
    """
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key):
        return None
    text = repr(torch.library.get_kernel(op_name, key))
    found = re.search(r"debug='(.*)'\)$", text)
    return found.group(1) if found else text


_TORCH_OWN = re.compile(r"aten/src/ATen/|torch/csrc/")


def registered_by_torch(origin: str) -> bool:
    """Whether a :func:`kernel_origin` is torch's own C++ registration (autocast's kernels,
    the autograd kernels), not a Python ``torch.library`` one."""
    return _TORCH_OWN.search(origin) is not None


def never_compiled(fn: Callable[..., Any]) -> None:
    """Make ``torch.compile`` run ``fn`` (and what it calls) as it is, never trace it.

    The O1 kernels are Python called by the C++ dispatcher; where a compiled function runs
    part of its code eagerly, dynamo would otherwise try to compile a kernel's frame as a
    function of its own. Why private: ``torch._dynamo.eval_frame.set_code_exec_strategy``
    marks a code object once, at no cost per call (``torch.compiler.disable`` wraps every
    call).
    """
    from torch._dynamo.eval_frame import set_code_exec_strategy  # type: ignore[attr-defined]
    from torch._dynamo.types import (  # type: ignore[attr-defined]
        FrameAction,
        FrameExecStrategy,
    )

    code = getattr(fn, "__code__", None)
    if code is not None:
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def op_schema(op: Any) -> Any:
    """The schema (``torch._C.FunctionSchema``) of an ATen operator overload.

    Why private: ``OpOverload._schema`` is the only way to read an operator's arguments
    from Python (``torch.library`` and torch's decompositions read it the same way).
    """
    return op._schema


def next_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get.

    Why private: ``torch.autograd._get_sequence_nr`` (what torch.fx uses to pair backward
    nodes with their forward ops) is the only way to mark which nodes a region created; a
    checkpoint's recomputation in backward belongs to the region whose range holds the node
    that runs it.
    """
    return int(torch.autograd._get_sequence_nr())  # type: ignore[attr-defined]


def running_node_sequence_nr() -> int | None:
    """The sequence number of the autograd node this thread's backward is running now, or
    None outside backward.

    Why private: ``torch._C._current_autograd_node`` (used by ``torch.autograd.graph``'s
    debugging hooks) is the only way to ask the engine which node runs; a checkpoint
    recomputes inside the node that needs its tensors.
    """
    if torch._C._current_graph_task_id() == -1:
        return None
    node = torch._C._current_autograd_node()
    return None if node is None else int(node._sequence_nr())


def tracing_context() -> Any:
    """The ``torch.compile`` tracing context of the compilation running now, or None.

    Why private: ``torch._guards.TracingContext`` is dynamo's and AOTAutograd's shared state
    of one compilation; the regions a compiled forward opens live on it while it is traced,
    so a compilation that fails half-way leaves nothing behind.
    """
    from torch._guards import TracingContext

    return TracingContext.try_get()


def load_strict() -> bool | None:
    """The ``strict`` argument of the ``nn.Module.load_state_dict`` call running now, or
    None when the caller is not inside one.

    Why private: PyTorch hands every module's load pre-hooks ``strict=True`` whatever the
    caller passed (the flag decides only at the very end, after every matching entry was
    copied, whether missing and unexpected keys raise). A hook that must refuse a strict
    load *before* anything is copied reads the flag from that call's frame.
    """
    code = torch.nn.Module.load_state_dict.__code__
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return None


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode``: tensors made inside it have a device and a dtype but no data, so
    CUDA tensors exist without a GPU and ops compute only their results' dtypes and shapes.

    Why private: ``torch._subclasses.fake_tensor`` is how torch itself (``torch.compile``)
    traces without running kernels; there is no public equivalent. The lockfile
    (:mod:`mixprec_torch.o1.framework_autocast`) runs CUDA autocast's own kernels on fake tensors to
    record what it does with each op on a machine without a GPU.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _doubled(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _check_dispatch(need: Callable[[bool, str], None]) -> None:
    """The names the O1 kernels rely on (see the section above)."""
    from torch.utils.checkpoint import checkpoint

    key = dispatch_key("Autocast", "cpu")
    need(key == torch.DispatchKey.AutocastCPU, "_dispatch_key_for_device('cpu') is not 'CPU'")
    need(
        kernel_origin("aten::linear", key) is not None and kernel_origin("aten::sin", key) is None,
        "_dispatch_has_kernel_for_dispatch_key no longer tells autocast's own kernels apart",
    )
    need(
        keys_after(key).has(torch.DispatchKey.AutogradCPU) and not keys_after(key).has(key),
        "_dispatch_keyset_full_after no longer gives the keys below a key",
    )
    with torch.autocast("cpu", dtype=torch.bfloat16), excluding(key):
        excluded = torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
    need(excluded, "_ExcludeDispatchKeyGuard no longer skips a dispatch key")
    leaf = torch.ones(1, requires_grad=True)
    start = next_sequence_nr()
    out = checkpoint(_doubled, leaf * 1, use_reentrant=True)
    seen: list[int | None] = []
    out.grad_fn.register_prehook(lambda grads: seen.append(running_node_sequence_nr()))
    out.sum().backward()
    need(
        running_node_sequence_nr() is None
        and len(seen) == 1
        and seen[0] is not None
        and start <= seen[0] < next_sequence_nr(),
        "_get_sequence_nr / _current_autograd_node no longer number the nodes a forward made",
    )
    need(tracing_context() is None, "TracingContext.try_get() is not None outside compile")


def problems() -> list[str]:
    """One line per private name above that this torch build no longer has or that no
    longer behaves as the backend relies on (empty when everything is in place)."""
    found: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            found.append(f"torch {torch.__version__}: {what}; update mixprec_torch.torch_private")

    for name in (
        "_amp_foreach_non_finite_check_and_unscale_",
        "_foreach_add_",
        "_foreach_copy_",
        "_foreach_norm",
        "_foreach_zero_",
        "_scaled_mm",  # FP8 GEMMs fall back to exact emulation without it
    ):
        need(callable(getattr(torch, name, None)), f"torch.{name} is gone")
    try:
        torch.ops.mkldnn._is_mkldnn_bf16_supported  # noqa: B018 - the lookup is the check
        has_probe = True
    except (AttributeError, RuntimeError):
        has_probe = False
    need(
        has_probe or not torch.backends.mkldnn.is_available(),
        "torch.ops.mkldnn._is_mkldnn_bf16_supported is gone",
    )
    need(
        hasattr(torch.Tensor, "_version") and hasattr(torch.Tensor, "_values"),
        "Tensor._version or Tensor._values is gone",
    )
    with warnings.catch_warnings():  # importing torch._dynamo may warn about torch.jit
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.compile(torch.nn.Identity())  # wraps lazily: nothing compiles here
    need(
        compiled_inner(compiled) is not None,  # type: ignore[arg-type]
        "torch.compile no longer returns an OptimizedModule holding the model as _orig_mod",
    )
    grad = torch.ones(2)
    storage = grad.untyped_storage()
    held = sole_owner(storage)
    view = grad.view(1, 2)
    del grad
    viewed = sole_owner(storage)
    del view
    need(
        not held and not viewed and sole_owner(storage),
        "torch._C._storage_Use_Count no longer counts the tensors holding a storage",
    )
    need(not in_backward(), "torch._C._current_graph_task_id is not -1 outside backward")
    try:
        with fake_tensor_mode():
            fake = torch.ones(2, device="cuda")
        need(fake.device.type == "cuda", "FakeTensorMode no longer makes CUDA tensors")
    except Exception as exc:
        need(False, f"torch._subclasses.fake_tensor.FakeTensorMode fails: {exc}")
    seen: list[bool] = []
    leaf = torch.ones(1, requires_grad=True)
    leaf.register_hook(lambda grad: seen.append(in_backward()))
    (leaf * 2).sum().backward()
    need(seen == [True], "torch._C._current_graph_task_id no longer tells backward apart")
    _check_dispatch(need)
    if torch.distributed.is_available():
        from torch.distributed.checkpoint import state_dict as dcp_state_dict
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        need(
            hasattr(DistributedDataParallel, "_active_ddp_module"),
            "DistributedDataParallel._active_ddp_module is gone",
        )
        need(
            callable(getattr(FSDPModule, "_get_fsdp_state", None)),
            "FSDPModule._get_fsdp_state is gone",
        )
        need(
            callable(getattr(dcp_state_dict, "_init_optim_state", None)),
            "torch.distributed.checkpoint.state_dict._init_optim_state is gone",
        )
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    step = vars(opt).get("step")
    opt.step()  # no gradients: changes nothing, but the scheduler's wrapper counts the call
    need(
        step is not None and is_scheduler_step_wrapper(step),
        "LR schedulers no longer mark their step wrapper with _wrapped_by_lr_sched",
    )
    need(
        getattr(opt, "_opt_called", None) is True,
        "LR schedulers no longer count optimizer steps through optimizer._opt_called",
    )
    need(
        getattr(type(opt).step, "hooked", False) is True,
        "Optimizer no longer marks a class's wrapped step with step.hooked",
    )
    seen_strict: list[bool | None] = []
    model.register_load_state_dict_pre_hook(lambda *args: seen_strict.append(load_strict()))
    model.load_state_dict(model.state_dict(), strict=False)
    model.load_state_dict(model.state_dict())
    need(
        seen_strict == [False, True] and load_strict() is None,
        "nn.Module.load_state_dict no longer runs the load pre-hooks inside its own frame "
        "with a local named strict",
    )
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    run_step_hooks(opt, lambda: calls.append("update"))
    need(
        calls == ["pre", "update", "post"],
        "Optimizer.profile_hook_step no longer runs the step hooks around the step",
    )
    return found
