"""Ensembles on real workers: placement, every combine mode, equality with serial, errors."""

from __future__ import annotations

import pytest
import torch

import asyncrpc

from conftest import ROOT, run_program

X = torch.rand(6, 3, 8, generator=torch.Generator().manual_seed(1))


class BiLSTM(torch.nn.Module):
    """The reference member, small: two LSTMs over the sequence, one reversed."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.cell_f = torch.nn.LSTM(channels, channels)
        self.cell_b = torch.nn.LSTM(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward, _ = self.cell_f(x)
        backward, _ = self.cell_b(torch.flip(x, dims=[0]))
        return torch.cat((forward, torch.flip(backward, dims=[0])), dim=2)


class Homebody(torch.nn.Module):
    """Reports where it was built, and refuses to be pickled."""

    def __init__(self) -> None:
        super().__init__()
        context = asyncrpc.current_context()
        self.rank = float(context.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, self.rank)

    def __reduce__(self) -> object:
        raise TypeError("a Homebody never leaves the worker it was built on")


def spread(outputs: list[torch.Tensor]) -> torch.Tensor:
    return outputs[0] - outputs[-1]


PLACEMENTS = {
    "local": None,
    "even over 2 workers": ["worker1", "worker2"],
    "mapping incl. the caller": {"worker0": 1, "worker2": 3},
    "one worker": ["worker1"],
}
COMBINES = {"sum": "sum", "mean": "mean", "stack": "stack", "custom": spread}


@pytest.mark.parametrize("combine", COMBINES.values(), ids=list(COMBINES))
@pytest.mark.parametrize("workers", PLACEMENTS.values(), ids=list(PLACEMENTS))
def test_ensemble_equals_the_serial_ensemble(
    world: asyncrpc.Context, workers: object, combine: object
) -> None:
    serial = asyncrpc.Ensemble(BiLSTM, 4, seed=7, engine="serial", combine=combine)  # type: ignore[arg-type]
    ens = asyncrpc.Ensemble(BiLSTM, 4, seed=7, workers=workers, combine=combine)  # type: ignore[arg-type]
    with torch.no_grad():
        expected = serial(X)
        assert torch.allclose(ens(X), expected, atol=1e-6)
        assert torch.allclose(ens.call_async(X).wait(), expected, atol=1e-6)


@pytest.mark.parametrize("engine", ["serial", "threads", "fork"])
def test_every_engine_on_the_workers_gives_the_same_output(
    world: asyncrpc.Context, engine: str
) -> None:
    reference = asyncrpc.Ensemble(BiLSTM, 4, seed=3, engine="serial")
    ens = asyncrpc.Ensemble(BiLSTM, 4, seed=3, workers=["worker1", "worker2"], engine=engine)  # type: ignore[arg-type]
    with torch.no_grad():
        assert torch.allclose(ens(X), reference(X), atol=1e-6)


def test_members_are_built_on_their_worker_and_never_pickled(world: asyncrpc.Context) -> None:
    ens = asyncrpc.Ensemble(Homebody, 5, workers=["worker1", "worker2"], combine="stack")
    ranks = ens(torch.zeros(1))[:, 0].tolist()
    assert ranks == [1.0, 1.0, 1.0, 2.0, 2.0]  # 5 over 2 workers: 3 then 2, in member order
    assert ens.placement == ("worker1",) * 3 + ("worker2",) * 2
    placed = {"worker2": 1, "worker1": 2}
    explicit = asyncrpc.Ensemble(Homebody, 3, workers=placed, combine="stack")
    assert explicit(torch.zeros(1))[:, 0].tolist() == [2.0, 1.0, 1.0]


def test_repeated_worker_names_keep_member_order(world: asyncrpc.Context) -> None:
    workers = ["worker1", "worker2", "worker1", "worker2"]
    ens = asyncrpc.Ensemble(Indexed, 4, workers=workers, combine="stack", seed=0)
    assert ens(torch.zeros(1))[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert ens.placement == tuple(workers)


class Indexed(torch.nn.Module):
    """Outputs its member index (built under seed + index) and the rank it lives on."""

    def __init__(self) -> None:
        super().__init__()
        self.index = float(torch.initial_seed())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.index == 2.0:
            raise ValueError("member 2 refuses a 2-d input")
        return torch.full_like(x, self.index)


def test_a_spread_members_error_names_its_index_in_the_ensemble(world: asyncrpc.Context) -> None:
    ens = asyncrpc.Ensemble(Indexed, 4, workers=["worker1", "worker2"], seed=0)
    with pytest.raises(ValueError, match="refuses") as raised:
        ens(torch.zeros(1, 1))
    text = str(raised.value) + str(getattr(raised.value, "__notes__", ""))
    assert "member 2 (Indexed) of the ensemble" in text and "worker2" in text, text


def test_spread_equals_serial_to_float_rounding_and_never_requires_grad(
    world: asyncrpc.Context,
) -> None:
    local = asyncrpc.Ensemble(BiLSTM, 4, seed=5)
    spread = asyncrpc.Ensemble(BiLSTM, 4, seed=5, workers=["worker1", "worker2"])
    ours, theirs = local(X), spread(X)
    # Partial sums per worker, then across workers: the same sum in another order.
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6)
    assert ours.requires_grad and not theirs.requires_grad  # as the README says
    with torch.no_grad():
        assert not local(X).requires_grad


def test_seeds_make_members_differ_and_placements_agree(world: asyncrpc.Context) -> None:
    stack = asyncrpc.Ensemble(BiLSTM, 2, seed=0, combine="stack", workers=["worker1", "worker2"])
    with torch.no_grad():
        first, second = stack(X)
    assert not torch.allclose(first, second)


@pytest.mark.parametrize(
    ("args", "options", "error", "match"),
    [
        ((BiLSTM(), 2), {}, TypeError, "pass the class itself"),
        ((BiLSTM, 0), {}, ValueError, "n must be a positive int"),
        ((BiLSTM, 2), {"combine": "max"}, ValueError, "combine must be one of"),
        ((BiLSTM, 2), {"workers": "worker1"}, TypeError, "list of worker names"),
        ((BiLSTM, 3), {"workers": {"worker1": 1}}, ValueError, "add up to n=3"),
        ((BiLSTM, 2), {"seed": 1.5}, TypeError, "seed must be an int"),
    ],
)
def test_bad_input_says_what_to_do(
    world: asyncrpc.Context,
    args: tuple[object, ...],
    options: dict[str, object],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        asyncrpc.Ensemble(*args, **options)  # type: ignore[arg-type]


def test_unknown_worker_is_named(world: asyncrpc.Context) -> None:
    with pytest.raises(asyncrpc.UnknownWorkerError, match="worker9"):
        asyncrpc.Ensemble(BiLSTM, 2, workers=["worker1", "worker9"])


def test_a_failing_member_reaches_the_caller(world: asyncrpc.Context) -> None:
    ens = asyncrpc.Ensemble(BiLSTM, 2, workers=["worker1"])
    with pytest.raises(Exception, match=r"input.size|input_size|Expected"):
        ens(torch.rand(2, 2, 5))  # wrong channel count
    with torch.no_grad():
        assert ens(X).shape == (6, 3, 16)


@pytest.mark.subprocess
@pytest.mark.timeout(150)  # past run_program's own: a stuck run shows its stacks
def test_bilstm_example_runs_its_four_steps_and_each_equals_serial() -> None:
    result = run_program("python", str(ROOT / "examples" / "bilstm_ensemble.py"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [line for line in result.stdout.splitlines() if line[:2] in ("1.", "2.", "3.", "4.")]
    assert [s.split()[0] for s in steps] == ["1.", "2.", "3.", "4."], result.stdout
    assert sum(s.endswith("equal to serial: True") for s in steps) == 3, result.stdout
    assert "auto settled on: " in result.stdout
