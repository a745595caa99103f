"""Real training: a Gluon CNN on scikit-learn's 8x8 digits under O2-bf16 matches float32."""

from __future__ import annotations

import functools

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
datasets = pytest.importorskip("sklearn.datasets")

from _mx_nets import array, cnn, train_step  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from mixprec_mxnet import Trainer  # noqa: E402

pytestmark = [pytest.mark.mxnet, pytest.mark.slow]

TRAIN, EPOCHS, BATCH = 1400, 8, 32


@functools.cache
def _accuracy(policy: str) -> float:
    digits = datasets.load_digits()
    images = digits.images.astype("float32")[:, None] / 16.0
    order = np.random.RandomState(0).permutation(len(images))
    images, labels = images[order], digits.target[order].astype("float32")
    net = cnn()
    trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=policy)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x, y = array(images[:TRAIN]), array(labels[:TRAIN])
    for _ in range(EPOCHS):
        for start in range(0, TRAIN, BATCH):
            train_step(net, trainer, x[start : start + BATCH], y[start : start + BATCH], loss_fn)
    with autograd.predict_mode():
        scores = net(array(images[TRAIN:]))
    return float((scores.argmax(axis=1).asnumpy() == labels[TRAIN:]).mean())


def test_o2_bf16_cnn_reaches_float32_accuracy() -> None:
    fp32, bf16 = _accuracy("O0"), _accuracy("O2-bf16")
    assert fp32 > 0.95
    assert bf16 >= fp32 - 0.01


def test_o1_bf16_cnn_reaches_float32_accuracy() -> None:
    fp32, bf16 = _accuracy("O0"), _accuracy("O1-bf16")
    assert bf16 >= fp32 - 0.01
