"""A Q-ensemble of small MLPs on the "vmap" engine: one batched call for all members.

Eight critics of one architecture, as in ensemble RL (clipped double-Q,
REDQ): `asyncrpc.Fanout(members, engine="vmap")` runs them as one batched
GEMM per layer over their stacked weights. The script checks the outputs
against the members run one by one, takes a fused Adam step on the members
themselves and a Polyak update of a target ensemble (`.data` writes, which
torch does not count as changes), shows the next stacked calls see both,
and times both ways.

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
    params = [p for c in critics for p in c.parameters()]
    optimizer = torch.optim.Adam(params, lr=0.01, fused=True)  # no version counter bump
    loss = torch.stack(q(state_action)).pow(2).mean()  # gradients reach every member
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = q(state_action)
        now = [c(state_action) for c in critics]
    seen = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after, now, strict=True))
    print(f"after one fused Adam step on the members: stacked call sees it: {seen}")

    # The target network's Polyak update, through .data: the target ensemble sees it.
    targets = [critic() for _ in range(MEMBERS)]
    q_target = asyncrpc.Fanout(targets, engine="vmap")
    tau = 0.005
    with torch.no_grad():
        q_target(state_action)  # the first call runs the members one by one, then stacks
        for t, c in zip(targets, critics, strict=True):
            for tp, p in zip(t.parameters(), c.parameters(), strict=True):
                tp.data.mul_(1 - tau).add_(tau * p.data)
        stacked_target = q_target(state_action)
        own_target = [t(state_action) for t in targets]
    polyak = all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(stacked_target, own_target, strict=True)
    )
    print(f"after a Polyak update of the target ensemble: stacked call sees it: {polyak}")

    with torch.no_grad():
        serial = seconds_per_call(lambda: [c(state_action) for c in critics])
        batched = seconds_per_call(lambda: q(state_action))
    print(f"one by one {serial * 1e6:.0f} us, vmap engine {batched * 1e6:.0f} us per call")
    print(f"declined engines: {q.declined or 'none'}")


if __name__ == "__main__":
    main()
