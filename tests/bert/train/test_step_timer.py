"""bert.train.step_timer.StepTimer times the whole forward and backward, whichever parameter's gradient comes last."""

import time

import torch

from bert.train.step_timer import StepTimer


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.05)  # the backward's work, after the head's gradient
        return grad


class _Model(torch.nn.Module):
    """Like BERT: the first parameter is the head's bias, whose gradient is accumulated first."""

    def __init__(self):
        super().__init__()
        self.head_bias = torch.nn.Parameter(torch.zeros(3))
        self.embedding = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return _SlowBackward.apply(x * self.embedding) + self.head_bias


def test_the_backward_is_inside_the_interval():
    model = _Model()
    timer = StepTimer(model, torch.device("cpu"))
    for step in range(3):
        timer.mark(step)
        for _ in range(2):  # two micro-batches, summed
            model(torch.ones(3)).sum().backward()
    timer.mark(3)
    got = timer.ready()
    assert [s for s, _ in got] == [0, 1, 2]
    assert all(t >= 2 * 0.05 for _, t in got), got
    model.eval()
    with torch.no_grad():
        model(torch.ones(3))  # an eval forward is not timed
    timer.mark(4)
    assert timer.ready() == []  # nothing timed since mark(3)
