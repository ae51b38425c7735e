"""tools.device_reads: each way a host reads a device tensor is counted, host tensors are not."""

from __future__ import annotations

import threading

import pytest
import torch

from tools.device_reads import DeviceReads


@pytest.mark.parametrize(
    "read, kind",
    [
        (lambda t: t.sum().item(), "item"),
        (lambda t: float(t.sum()), "item"),
        (lambda t: int(t.sum()), "item"),
        (lambda t: bool(t.sum() > 0), "item"),
        (lambda t: (t * 2).tolist(), "tolist"),
        (lambda t: t.grad.cpu(), "cpu"),
        (lambda t: t.detach().numpy(), "numpy"),
        (lambda t: (t > 0).nonzero(), "nonzero"),
        (lambda t: t.detach()[t.detach() > 0], "mask-index"),
        (lambda t: torch.unique(t.detach()), "_unique2"),
    ],
)
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
def test_each_read_of_a_device_tensor_is_counted(read, kind):
    w = torch.nn.Parameter(torch.randn(6))
    w.grad = torch.ones(6)
    with DeviceReads([w, w.grad]) as reads:
        read(w)
    assert reads.by_kind == {kind: 1}, reads.by_kind
    assert "test_device_reads.py" in reads.report()  # where it happened


def test_moved_and_derived_tensors_are_device_tensors_host_ones_are_not():
    w = torch.nn.Parameter(torch.randn(3))
    host = torch.arange(4)
    with DeviceReads([w]) as reads:
        host.tolist()
        host.cpu()
        (host + 1).tolist()
        host.to(torch.float32).tolist()  # a dtype cast stays on the host
        moved = host.to("cpu")  # to a device: on the CPU the same tensor, from now on a device tensor
        assert reads.total == 0
        moved.tolist()
        loss = (w * moved[:3]).sum()
        loss.backward()
        w.grad.tolist()  # a gradient made by backward from device tensors
    assert reads.by_kind == {"tolist": 2}


def test_other_threads_and_paused_stretches_are_not_counted():
    w = torch.randn(3)
    with DeviceReads([w]) as reads:
        t = threading.Thread(target=lambda: w.tolist())
        t.start()
        t.join()
        with reads.paused():
            w.sum().item()
        assert reads.total == 0
        w.sum().item()
    assert reads.total == 1
    assert torch.Tensor.tolist is not None and w.tolist()  # methods restored after the context
