"""Train the NumPy MLP on scikit-learn's 8x8 digits under any mixprec policy.

    python examples/train_digits.py O2              # float16 params, float32 masters, loss scaling
    python examples/train_digits.py O0 O2 O2-bf16   # compare

``tests/test_digits.py`` runs :func:`train` and checks that O2 (float16) matches float32.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from mixprec_numpy import MLP, SGD, Trainer


@dataclass
class Result:
    policy: str
    accuracy: float
    skipped_steps: int
    loss_scale: float
    trainer: Trainer


def train(
    policy: str,
    *,
    epochs: int = 20,
    batch_size: int = 32,
    seed: int = 0,
    inject_overflow_at: int | None = None,
) -> Result:
    """Train a 64-64-10 MLP; ``inject_overflow_at`` writes an inf into a gradient at that step."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )
    model = MLP([64, 64, 10], seed=seed)
    trainer = Trainer(model, SGD(lr=0.1, momentum=0.9), policy=policy)
    rng = np.random.default_rng(seed)
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            model.loss(x_train[batch], y_train[batch])
            trainer.backward()
            if step == inject_overflow_at:
                model.parameters()[0].grad[0, 0] = np.inf  # type: ignore[index]
            trainer.step()
            step += 1
    accuracy = float((model.predict(x_test).argmax(axis=1) == y_test).mean())
    return Result(policy, accuracy, trainer.skipped_steps, trainer.loss_scale, trainer)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["O0", "O2"]:
        r = train(name)
        print(
            f"{name:8} accuracy {r.accuracy:.3f}  skipped {r.skipped_steps}  "
            f"loss scale {r.loss_scale:g}"
        )
