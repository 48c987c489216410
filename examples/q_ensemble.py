"""A Q-ensemble of small MLPs on the "vmap" engine: one batched call for all members.

Eight critics of one architecture, as in ensemble RL (clipped double-Q,
REDQ): `asyncrpc.Fanout(members, engine="vmap")` runs them as one batched
GEMM per layer over their stacked weights. The script checks the outputs
against the members run one by one, takes an optimizer step on the
members themselves and shows the next call sees it, and times both ways.

    python examples/q_ensemble.py
"""

from __future__ import annotations

import time

import torch

import asyncrpc

MEMBERS, OBSERVATION, ACTION, HIDDEN = 8, 17, 6, 256


def critic() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(OBSERVATION + ACTION, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )  # fmt: skip


def seconds_per_call(call: object, repeat: int = 200) -> float:
    assert callable(call)
    call()
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    torch.manual_seed(0)
    critics = [critic() for _ in range(MEMBERS)]
    q = asyncrpc.Fanout(critics, engine="vmap")
    state_action = torch.rand(4, OBSERVATION + ACTION)

    with torch.no_grad():
        stacked = q(state_action)
        one_by_one = [c(state_action) for c in critics]
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(stacked, one_by_one, strict=True))
    print(f"plan: {q.plan}; {MEMBERS} outputs equal to the members' own: {same}")

    # A training step on the members themselves: the next stacked call sees it.
    optimizer = torch.optim.SGD([p for c in critics for p in c.parameters()], lr=0.1)
    loss = torch.stack(q(state_action)).pow(2).mean()  # gradients reach every member
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = q(state_action)
        now = [c(state_action) for c in critics]
    seen = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after, now, strict=True))
    print(f"after one SGD step on the members: stacked call sees it: {seen}")

    with torch.no_grad():
        serial = seconds_per_call(lambda: [c(state_action) for c in critics])
        batched = seconds_per_call(lambda: q(state_action))
    print(f"one by one {serial * 1e6:.0f} us, vmap engine {batched * 1e6:.0f} us per call")
    print(f"declined engines: {q.declined or 'none'}")


if __name__ == "__main__":
    main()
