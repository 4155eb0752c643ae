"""torch.compile helpers the torch tests share: a backend that counts the graphs it is
handed, so a test can assert that new shapes do not recompile."""

from __future__ import annotations

import torch


class Compiles:
    """How many graphs a backend was handed (compiles and recompiles)."""

    def __init__(self, backend: str) -> None:
        self.backend, self.count, self.after_first_call = backend, 0, None

    def __call__(self, graph, example_inputs):
        self.count += 1
        return torch._dynamo.lookup_backend(self.backend)(graph, example_inputs)

    def first_call_done(self) -> None:
        if self.after_first_call is None:
            self.after_first_call = self.count

    def assert_no_recompile(self) -> None:
        recompiles = self.count - self.after_first_call
        assert recompiles == 0, f"{self.backend}: {recompiles} recompiles"


def compile_counting(fn, dynamic=None, backend="aot_eager"):
    """``fn`` compiled with fullgraph=True, and a counter of the graphs handed to backend."""
    torch._dynamo.reset()
    counter = Compiles(backend)
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=counter), counter


def backends(place: str) -> tuple[str, ...]:
    """The backends a place is compiled with: inductor needs a device."""
    return ("aot_eager",) if place == "cpu" else ("aot_eager", "inductor")
