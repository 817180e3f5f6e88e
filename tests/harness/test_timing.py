"""CUDA graph capture in the timing helper: a failed capture raises and leaves the process usable."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mosaicquant.harness.timing import CaptureFailed, capture_graph, time_calls


class _Generator:
    def __init__(self, name):
        self.name, self.state = name, f"{name}-before"

    def clone_state(self):
        return f"{self.state}-copy"

    def graphsafe_set_state(self, state):
        self.state = state


def test_a_failed_capture_puts_the_generator_states_back(monkeypatch):
    generators = [_Generator("cuda:0"), _Generator("cuda:1")]

    @contextlib.contextmanager
    def graph(_):
        for g in generators:  # what a capture's prologue does: the states enter capture mode
            g.state = f"{g.name}-capturing"
        yield

    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(generators))
    monkeypatch.setattr(torch.cuda, "default_generators", generators, raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def host_sync():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(CaptureFailed, match=r"operation not permitted.*cuda_graphs=false"):
        capture_graph([host_sync])
    assert [g.state for g in generators] == ["cuda:0-before-copy", "cuda:1-before-copy"]


def test_a_capture_that_succeeds_keeps_the_generators_as_the_capture_left_them(monkeypatch):
    generators = [_Generator("cuda:0")]

    @contextlib.contextmanager
    def graph(_):
        yield
        generators[0].state = "after-epilogue"

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "default_generators", generators, raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    calls = []
    assert capture_graph([lambda: calls.append(1), lambda: calls.append(2)]) == "graph"
    assert calls == [1, 2] and generators[0].state == "after-epilogue"


@pytest.mark.gpu
def test_after_a_failed_capture_random_ops_and_captures_still_run():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.randn(256, device="cuda")

    def syncs():
        torch.nn.functional.dropout(x, 0.5)  # a random op inside the capture: the generator enters capture mode
        x.sum().item()  # a host synchronisation invalidates the capture

    with pytest.raises(CaptureFailed):
        time_calls([syncs], min_us=0.0, replays=2)
    assert torch.rand(4, device="cuda").shape == (4,)  # failed before the reset: "Offset increment outside graph capture"
    out = torch.empty_like(x)
    result = time_calls([lambda: out.copy_(torch.nn.functional.dropout(x, 0.5))], min_us=0.0, replays=3)
    assert result.how == "cudagraph" and result.median_us > 0
