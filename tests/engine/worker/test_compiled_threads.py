"""A frozen model serves its compiled graphs and never compiles, in its own thread only: while it serves, a
compile in another thread (a background warm-up, a model loaded later) still compiles."""

from __future__ import annotations

import threading

import torch
from torch._dynamo.utils import counters

from engine.worker.compiled import CompiledForward


class Toy(torch.nn.Module):
    """Counts the forwards that ran eagerly (a compiled graph skips the count); may block inside one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.eager = 0
        self.inside = threading.Event()
        self.hold: threading.Event | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.eager += 1
            if self.hold is not None:
                self.inside.set()
                self.hold.wait(timeout=60)
        return self.linear(x).relu()


def test_a_frozen_forward_runs_its_graph_and_runs_a_new_layout_eagerly_without_compiling():
    toy = Toy()
    forward = CompiledForward(toy, "toy")
    x = torch.randn(2, 4)
    frames = counters["stats"]["unique_graphs"]
    forward(True, x=x)
    assert counters["stats"]["unique_graphs"] > frames and toy.eager == 0, "the warm-up compiled its layout"
    forward.frozen = True
    frames = counters["stats"]["unique_graphs"]
    torch.testing.assert_close(forward(True, x=x), toy(x))
    assert toy.eager == 1, "the warmed-up layout ran its graph (the 1 is the reference's own call)"
    new = torch.randn(2, 4, dtype=torch.float64)  # another dtype: no graph fits it
    toy.double()
    torch.testing.assert_close(forward(True, x=new), toy(new))
    assert toy.eager == 3 and counters["stats"]["unique_graphs"] == frames, "ran eagerly, compiled nothing"
    assert not forward.failed


def test_a_compile_in_one_thread_is_not_turned_eager_by_a_frozen_forward_in_another():
    """With set_stance("eager_on_recompile") around each frozen forward, dynamo's stance for the whole process,
    a graph-breaking model compiled meanwhile ran eagerly without failing; and two threads' overlapping stances
    could leave it set, for every later compile of the process (as once in CI)."""
    serving = Toy()
    frozen = CompiledForward(serving, "serving")
    frozen.frozen = True
    serving.hold = threading.Event()
    thread = threading.Thread(target=lambda: frozen(True, x=torch.randn(3, 4)))
    thread.start()
    try:
        assert serving.inside.wait(timeout=60), "the serving thread is inside its frozen forward"
        breaking = Toy()
        breaking.linear.register_forward_hook(lambda *_: torch._dynamo.graph_break())
        other = CompiledForward(breaking, "loaded meanwhile")
        x = torch.randn(2, 4)
        torch.testing.assert_close(other(True, x=x), breaking(x))
        assert other.failed, "its compile ran (and failed on the break), not eagerly in silence"
    finally:
        serving.hold.set()
        thread.join(timeout=60)
    assert not frozen.failed
