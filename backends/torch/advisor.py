"""``mixprec.torch.advise``: which policy for this model on this machine, and which modules
to keep in float32.

Everything runs on ``copy.deepcopy`` copies of the model with optimizers built by the
user's factory, inside ``torch.random.fork_rng``: the user's model, optimizer and random
state are never touched. The run itself (candidates, rules, the advice) is
:func:`mixprec.advisor.run_advice`; this module supplies the copies and the measurements,
among them each copy's optimizer state between steps (:func:`optimizer_state_bytes`).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.kit import (
    FP8_RECIPES,
    RSS_MEASURE,
    AdviceError,
    AdviceReport,
    Capabilities,
    FP8Statistics,
    LossScaler,
    ModuleSensitivity,
    get_policy,
    run_advice,
)

from .devices import capabilities, device_key
from .fp8.statistics import fp8_statistics
from .step.diagnostics import underflow_fraction
from .step.loop import scale_loss, state
from .wrapping.wrap import wrap

__all__ = ["advise", "optimizer_state_bytes"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """``(bytes, parameters)``: the bytes of every tensor ``optimizer.state`` keeps for its
    parameters (the moments, a low-bit state's codes and absmax), its scalar counters
    (Adam's ``step``) left out, and the elements of the parameters it updates (the float32
    masters under ``O2``). Weights and masters are not state; read between two steps."""
    total = params = 0
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in seen:
                continue
            seen.add(id(param))
            params += param.numel()
            for value in (optimizer.state.get(param) or {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
    return total, params


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Trainee:
    def __init__(self, model: nn.Module, optimizer: Any, loss_fn: LossFn, device: Any) -> None:
        self.model, self.optimizer, self.loss_fn, self.device = model, optimizer, loss_fn, device
        self.compute = state(optimizer).policy.compute

    def step(self, batch: Any) -> float:
        inputs, target = batch
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(inputs), target)
        with scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
        self.optimizer.step()
        _sync(self.device)
        return float(loss.detach().float())

    def loss_scale(self) -> float:
        return float(state(self.optimizer).loss_scale)

    def skipped_steps(self) -> int:
        return int(state(self.optimizer).skipped_steps)

    def underflow_fraction(self) -> float | None:
        fractions = underflow_fraction(self.optimizer, self.compute)
        return statistics.fmean(fractions.values()) if fractions else None

    def peak_memory(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None

    def state_bytes(self) -> tuple[int, int]:
        return optimizer_state_bytes(self.optimizer)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def _rel_error(low: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """``|low - ref| / |ref|`` over the tensor; inf where low is not finite but ref is."""
    if low is None or ref is None or low.shape != ref.shape:
        return 0.0
    low, ref = low.detach().float(), ref.detach().float()
    if not torch.isfinite(low).all():
        return float("inf") if torch.isfinite(ref).all() else 0.0
    return float((low - ref).norm() / ref.norm().clamp(min=1e-30))


class _Capture:
    """Forward hooks keeping each module's first input and output, and the output's grad."""

    def __init__(self, model: nn.Module) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.classes: dict[str, str] = {}
        self.handles = [
            module.register_forward_hook(self._hook(name, module))
            for name, module in model.named_modules()
            if name
        ]

    def _hook(self, name: str, module: nn.Module) -> Callable[..., None]:
        def hook(_module: nn.Module, args: Any, output: Any) -> None:
            if name in self.outputs:  # a module called twice: its first call stands for it
                return
            inp, out = _first_tensor(args), _first_tensor(output)
            if inp is None or out is None:
                return
            self.inputs[name], self.outputs[name] = inp, out
            self.classes[name] = type(module).__name__
            if out.requires_grad:
                out.register_hook(lambda grad: self.grads.setdefault(name, grad))

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _TorchTarget:
    backend = "torch"

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn, seed: int
    ) -> None:
        self.model, self.make_optimizer, self.loss_fn, self.seed = (
            model,
            make_optimizer,
            loss_fn,
            seed,
        )
        param = next(model.parameters(), None)
        self.torch_device = param.device if param is not None else torch.device("cpu")
        self.device = device_key(self.torch_device)

    def capabilities(self) -> Capabilities:
        return capabilities()

    def memory_measure(self) -> str:
        if self.torch_device.type == "cuda":
            return "peak CUDA memory allocated by torch (torch.cuda.max_memory_allocated)"
        return RSS_MEASURE

    def start(self, policy: str) -> _Trainee:
        torch.manual_seed(self.seed)
        model = copy.deepcopy(self.model)
        optimizer = self.make_optimizer(model.parameters())
        model, optimizer = wrap(model, optimizer, policy=policy)
        model.train()
        if self.torch_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.torch_device)
        return _Trainee(model, optimizer, self.loss_fn, self.torch_device)

    def _measure(self, policy: str | None, batch: Any) -> _Capture:
        model = copy.deepcopy(self.model)
        scale = 1.0
        if policy is not None:
            resolved = get_policy(policy)
            model = wrap(model, policy=resolved)
            scale = LossScaler(resolved.loss_scale).scale
        model.eval()  # no dropout: both copies see the same function of the same weights
        capture = _Capture(model)
        inputs, target = batch
        try:
            loss = self.loss_fn(model(inputs), target).float()
            (loss * scale).backward()
        finally:
            capture.close()
        if scale != 1.0:
            capture.grads = {name: g.float() / scale for name, g in capture.grads.items()}
        return capture

    def fp8_statistics(self, policy: str, batch: Any) -> FP8Statistics:
        """The FP8 what-if statistics of one step of a copy under ``policy`` (its recipe)."""
        resolved = get_policy(policy)
        recipes = (resolved.fp8.name,) if resolved.fp8 is not None else FP8_RECIPES
        model = wrap(copy.deepcopy(self.model), policy=resolved)
        inputs, target = batch
        with fp8_statistics(model, recipes) as stats:
            self.loss_fn(model(inputs), target).float().backward()
        return stats

    def sensitivity(self, policy: str, batch: Any) -> list[ModuleSensitivity]:
        ref, low = self._measure(None, batch), self._measure(policy, batch)
        rows = []
        for name, output in low.outputs.items():
            out_err = _rel_error(output, ref.outputs.get(name))
            in_err = _rel_error(low.inputs[name], ref.inputs.get(name))
            added = 0.0 if out_err == in_err else max(0.0, out_err - in_err)
            grad_err = _rel_error(low.grads.get(name), ref.grads.get(name))
            rows.append(ModuleSensitivity(name, low.classes[name], out_err, added, grad_err))
        return rows


def _check_factory(make_optimizer: Any) -> None:
    if isinstance(make_optimizer, torch.optim.Optimizer) or not callable(make_optimizer):
        raise AdviceError(
            f"advise needs a function that builds an optimizer for a copy's parameters, got "
            f"{type(make_optimizer).__name__}; pass e.g. "
            "make_optimizer=lambda params: torch.optim.Adam(params, lr=1e-3)"
        )


def advise(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    batches: Sequence[tuple[Any, Any]],
    loss_fn: LossFn,
    candidates: Sequence[str] | None = None,
    steps: int = 20,
    *,
    warmup: int = 2,
    tolerance: float = 0.05,
    threshold: float = 0.01,
    max_rules: int = 3,
    max_skip_fraction: float = 0.2,
    seed: int = 0,
    progress: bool | None = None,
    objective: str = "speed",
    states: str | Sequence[str] | None = ("int8",),  # mixprec.advisor.run.DEFAULT_STATES
) -> AdviceReport:
    """Train short copies of ``model`` under each candidate policy and advise which to use.

    :param model: the model, left untouched (each candidate trains a ``deepcopy``).
    :param make_optimizer: builds an optimizer for a copy: ``lambda p: torch.optim.Adam(p)``.
    :param batches: ``(inputs, target)`` pairs, cycled for ``steps`` steps; every candidate
        sees the same ones.
    :param loss_fn: ``loss_fn(model(inputs), target)`` gives the scalar loss.
    :param candidates: policies to try (``O0`` is always added as the reference); by
        default every built-in preset the model's device computes in (``capabilities()``).
    :param steps: training steps per candidate; the first ``warmup`` are not timed.
    :param tolerance: the largest mean relative loss distance from float32 to recommend.
    :param threshold: the relative error per module the proposed rules aim under.
    :param max_rules: at most this many module rules are proposed.
    :param max_skip_fraction: a policy skipping more of its steps is not recommended.
    :param seed: the seed every copy starts from (the caller's random state is restored).
    :param progress: show a tqdm bar; None shows one on a terminal and one line per
        candidate otherwise (piped output); False shows nothing.
    :param objective: what the recommendation answers: ``"speed"`` (the default) the
        fastest policy on this machine, float32 included; ``"memory"`` the smallest peak
        memory; ``"numerics"`` the low-precision policy closest to float32's loss. Ties within
        10% go to the run closest to float32's loss, never to an ``O3`` preset first.
    :param states: the low-bit optimizer-state formats to offer (``"int8"``, ``"int4"``,
        ``"fp8"``, settings in parentheses: ``"int8(min_size=0)"``): for each, the advisor
        also trains float32's twin (``O0,state=int8``) and the recommendation's
        (``O2-bf16,state=int8``), each recommended only when its loss stays within
        ``tolerance`` of its float32-state twin's. Default ``("int8",)``: one or two more
        short runs; ``()`` offers none. Every run reports its optimizer state per parameter.
    :returns: an :class:`~mixprec.kit.AdviceReport`; ``report.recommended`` is the policy.

    Example (a complete run: a small model, its batches and loss)::

        import torch
        import mixprec
        import mixprec.torch as mpt

        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 2))
        x = torch.randn(256, 20)
        batches = [(x[i : i + 64], (x[i : i + 64, 0] > 0).long()) for i in range(0, 256, 64)]
        report = mpt.advise(model, lambda p: torch.optim.Adam(p, lr=1e-3), batches,
                            torch.nn.functional.cross_entropy, ["O1-bf16", "O2-bf16"], 8)
        print(report.table())
        policy = mixprec.get_policy(report.recommended)
    :raises AdviceError: bad arguments, before anything runs.
    :raises PolicyError: a candidate that is not a policy.
    """
    _check_factory(make_optimizer)
    if not isinstance(model, nn.Module):
        raise AdviceError(f"advise needs an nn.Module, got {type(model).__name__}")
    target = _TorchTarget(model, make_optimizer, loss_fn, seed)
    devices = [target.torch_device] if target.torch_device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return run_advice(
            target,
            list(batches),
            candidates=candidates,
            steps=steps,
            warmup=warmup,
            tolerance=tolerance,
            threshold=threshold,
            max_rules=max_rules,
            max_skip_fraction=max_skip_fraction,
            progress=progress,
            objective=objective,
            states=states,
        )
