"""A REDQ/SAC training step over 10 critics: the loop, the engine, and the hand-written floor.

One step is what REDQ and SAC do each environment step with an ensemble of
critics (each `Linear(obs+act, 256) -> ReLU -> Linear(256, 256) -> ReLU ->
Linear(256, 1)`):

    critic update: q_i = critic_i(cat(s, a)); loss = sum_i mse(q_i, y);
                   backward; one Adam step over every critic's parameters
    actor update:  a' = actor(s) (a non-leaf that needs gradients);
                   q_i = critic_i(cat(s, a')); loss = -mean_i q_i; backward;
                   an Adam step of the actor

Ways, alternating round by round in one run (medians of the rounds):

    loop     a Python loop over the critics; one Adam (foreach) over all of them
    vmap     asyncrpc.Fanout(critics, engine="vmap"); one Adam over the stacks
             (`fan.parameters()`), which the critics' tensors are rows of
    auto     asyncrpc.Fanout(critics) (engine "auto"), same optimizer as the loop's
    floor    written by hand: torch.func.stack_module_state, vmap(functional_call),
             one Adam over the stacked parameters

at batch 32 and 256; then forward-only acting (batch 1, no gradients): the
loop, the engine and the floor. Ratios are the loop's median over each way's
(above 1: faster than the loop) and each engine way over the floor.

    python benchmarks/ensemble_training.py [--rounds 7] [--batches 32 256] [--device cuda]
                                           [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc

import run_record
import timing

CRITICS, OBS, ACT, HIDDEN = 10, 17, 6, 256


def critic() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(OBS + ACT, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def actor() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(OBS, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, ACT),
        torch.nn.Tanh(),
    )


class Way:
    """One way of running the critics: `qs(x)` gives the critics' outputs stacked (N, B, 1)."""

    def __init__(
        self,
        qs: Callable[[torch.Tensor], torch.Tensor],
        params: list[torch.Tensor],
        actor_net: torch.nn.Module,
        fan: asyncrpc.Fanout | None = None,
    ) -> None:
        self.qs, self.fan = qs, fan
        self.critic_opt = torch.optim.Adam(params, lr=1e-3)
        self.actor = actor_net
        self.actor_opt = torch.optim.Adam(actor_net.parameters(), lr=1e-3)

    def close(self) -> None:
        if self.fan is not None:
            self.fan.close()

    def step(self, s: torch.Tensor, a: torch.Tensor, y: torch.Tensor) -> float:
        q = self.qs(torch.cat([s, a], -1))
        critic_loss = (q - y).pow(2).mean(dim=(1, 2)).sum()
        self.critic_opt.zero_grad()
        critic_loss.backward()
        self.critic_opt.step()
        q = self.qs(torch.cat([s, self.actor(s)], -1))
        actor_loss = -q.mean()
        self.actor_opt.zero_grad()
        actor_loss.backward()
        self.actor_opt.step()
        return float(critic_loss.detach())


def make_ways(seed: int = 0) -> dict[str, Way]:
    torch.manual_seed(seed)
    critics, pi = [critic() for _ in range(CRITICS)], actor()
    ways: dict[str, Way] = {}
    mine = [copy.deepcopy(c) for c in critics]
    ways["loop"] = Way(
        lambda x: torch.stack([c(x) for c in mine]),
        [p for c in mine for p in c.parameters()],
        copy.deepcopy(pi),
    )
    for engine in ("vmap", "auto"):
        members = [copy.deepcopy(c) for c in critics]
        fan = asyncrpc.Fanout(members, engine=engine)  # type: ignore[arg-type]
        params = (
            list(fan.parameters())
            if engine == "vmap"
            else [p for c in members for p in c.parameters()]
        )
        ways[engine] = Way(lambda x, f=fan: torch.stack(f(x)), params, copy.deepcopy(pi), fan)
    ways["floor"] = _floor(critics, copy.deepcopy(pi))
    return ways


def _floor(critics: list[torch.nn.Module], pi: torch.nn.Module) -> Way:
    params, buffers = torch.func.stack_module_state(critics)  # type: ignore[arg-type]
    base = copy.deepcopy(critics[0]).to("meta")

    def one(p: dict[str, Any], b: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(base, (p, b), (x,))  # type: ignore[no-any-return]

    batched = torch.func.vmap(one, in_dims=(0, 0, None))
    return Way(lambda x: batched(params, buffers, x), list(params.values()), pi)


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, a, y = (torch.randn(size, n, generator=g, device="cpu") for n in (OBS, ACT, 1))
    device = torch.get_default_device()
    return s.to(device), a.to(device), y.to(device)


def _synced(way: Callable[[], object]) -> Callable[[], object]:
    """`way`, waiting for the GPU's work to end where the default device is one."""
    if torch.get_default_device().type != "cuda":
        return way

    def call() -> object:
        out = way()
        torch.cuda.synchronize()
        return out

    return call


ROUNDS: dict[str, list[float]] = {}  # the last `medians` call's samples, round by round


def medians(ways: dict[str, Callable[[], object]], rounds: int, sample: float) -> dict[str, float]:
    """Median seconds per call of each way: rounds alternate the order (forward, backward)."""
    ways = {name: _synced(way) for name, way in ways.items()}
    for way in ways.values():
        way()
    repeat = {name: timing.repeats(way, sample) for name, way in ways.items()}
    samples: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(timing.mean_seconds(ways[name], repeat[name]))
    ROUNDS.clear()
    ROUNDS.update(samples)
    return {name: statistics.median(times) for name, times in samples.items()}


def by_round(way: str, other: str) -> float:
    """The median over rounds of `way`'s time over `other`'s in the same round."""
    return statistics.median(a / b for a, b in zip(ROUNDS[way], ROUNDS[other], strict=True))


def time_steps(ways: dict[str, Way], size: int, rounds: int, sample: float) -> dict[str, float]:
    data = batch(size, 1)
    for way in ways.values():
        for _ in range(3):  # warm up: pools, caches, "auto"'s first trials
            way.step(*data)
    settle(ways["auto"].fan, lambda: ways["auto"].step(*data))
    steps = {name: functools.partial(way.step, *data) for name, way in ways.items()}
    return medians(steps, rounds, sample)  # type: ignore[arg-type]


def settle(fan: asyncrpc.Fanout | None, call: Callable[[], object]) -> None:
    """Call until "auto" has chosen its plan (so that its timed calls are the chosen plan's)."""
    for _ in range(400):
        if fan is None or fan.plan is not None:
            return
        call()


def losses_agree(steps: int, size: int = 32) -> dict[str, float]:
    """Largest difference of each way's critic loss from the loop's, over `steps` steps."""
    ways = make_ways(seed=3)
    worst = dict.fromkeys(ways, 0.0)
    for i in range(steps):
        data = batch(size, 100 + i)
        got = {name: way.step(*data) for name, way in ways.items()}
        for name, value in got.items():
            worst[name] = max(worst[name], abs(value - got["loop"]))
    for way in ways.values():
        way.close()
    return worst


def acting(rounds: int, sample: float) -> dict[str, float]:
    """Forward only at batch 1, no gradients: the loop, the engine and the floor."""
    torch.manual_seed(0)
    critics = [critic() for _ in range(CRITICS)]
    fan = asyncrpc.Fanout(critics, engine="vmap")
    floor = _floor(critics, actor()).qs
    x = torch.randn(1, OBS + ACT)
    ways: dict[str, Callable[[], object]] = {
        "loop": lambda: [c(x) for c in critics],
        "vmap": lambda: fan(x),
        "floor": lambda: floor(x),
    }
    with torch.no_grad():
        found = medians(ways, rounds, sample)
    fan.close()
    return found


class SoftQNetwork(torch.nn.Module):
    """CleanRL's SAC critic: a class of its own, F.relu in forward (the functional_call path)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(OBS + ACT, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.relu(self.fc1(x))
        return self.fc3(torch.nn.functional.relu(self.fc2(x)))  # type: ignore[no-any-return]


def normed_critic() -> torch.nn.Module:
    """A LayerNorm + SiLU critic (DroQ-style): the batched-GEMM path since LayerNorm joined it."""
    return torch.nn.Sequential(
        torch.nn.Linear(OBS + ACT, HIDDEN), torch.nn.LayerNorm(HIDDEN), torch.nn.SiLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.LayerNorm(HIDDEN), torch.nn.SiLU(),
        torch.nn.Linear(HIDDEN, 1),
    )  # fmt: skip


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "SAC critic (Sequential)": critic,
    "LayerNorm+SiLU critic (Sequential)": normed_critic,
    "CleanRL SoftQNetwork (own class)": SoftQNetwork,
}


def auto_against_fixed(rounds: int, sample: float, sizes: list[int]) -> dict[str, Any]:
    """Forward only, no gradients: each fixed engine and "auto" (settled), per model and batch."""
    found: dict[str, Any] = {}
    for model, make in MODELS.items():
        for size in sizes:
            torch.manual_seed(0)
            members = [make() for _ in range(CRITICS)]
            x = torch.randn(size, OBS + ACT)
            fans = {e: asyncrpc.Fanout(members, engine=e) for e in ("serial", "vmap", "threads")}
            fans["auto"] = asyncrpc.Fanout(members)
            with torch.no_grad():
                settle(fans["auto"], functools.partial(fans["auto"], x))
                times = medians(
                    {e: functools.partial(f, x) for e, f in fans.items()}, rounds, sample
                )
            best = min((e for e in times if e != "auto"), key=times.__getitem__)
            title = f"{model}, batch {size}"
            found[title] = row = {e: t * 1e3 for e, t in times.items()}
            row["auto_plan"] = str(fans["auto"].plan)
            row["auto_over_best"] = times["auto"] / times[best]
            print(f"  {title:48s} " + "  ".join(f"{e} {t * 1e3:7.3f} ms" for e, t in times.items())
                  + f"   auto chose {row['auto_plan']}: {row['auto_over_best']:.2f}x the best "
                  f"fixed ({best})")  # fmt: skip
            for fan in fans.values():
                fan.close()
    return found


def report(title: str, medians: dict[str, float]) -> dict[str, Any]:
    """Print one table; its figures, for --json."""
    print(f"\n{title}")
    loop, floor = medians["loop"], medians["floor"]
    figures: dict[str, Any] = {}
    for name, seconds in medians.items():
        found = figures[name] = {"ms": seconds * 1e3, "vs_loop": loop / seconds}
        line = f"  {name:6s} {seconds * 1e3:8.3f} ms   {loop / seconds:5.2f}x the loop's speed"
        if name in ("vmap", "auto"):
            found["vs_floor"] = seconds / floor
            line += f"   {seconds / floor:5.2f}x the floor's time"
        print(line)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--sample", type=float, default=0.3, help="seconds per timed sample")
    parser.add_argument("--agree-steps", type=int, nargs="+", default=[40, 200])
    parser.add_argument("--auto-batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--device", default="cpu", help="where the modules and data live")
    parser.add_argument("--json", help="also write every figure printed here")
    args = parser.parse_args()
    torch.set_default_device(args.device)
    threads = torch.get_num_threads()
    print(f"{CRITICS} critics, obs {OBS} + act {ACT}, hidden {HIDDEN}; {args.device}; "
          f"{threads} intra-op threads; torch {torch.__version__}")  # fmt: skip
    options = {k: v for k, v in vars(args).items() if k != "json"}
    record: dict[str, Any] = {"benchmark": "ensemble_training", "options": options}
    record |= {"critics": CRITICS, "hidden": HIDDEN, "intra_op_threads": threads}
    record["device"] = args.device
    record["steps"] = {}
    for size in args.batches:
        ways = make_ways()
        medians = time_steps(ways, size, args.rounds, args.sample)
        found = record["steps"][str(size)] = {
            "ways": report(f"training step, batch {size}", medians)
        }
        auto = ways["auto"].fan
        found["auto_plan"] = str(auto.plan) if auto is not None else None
        found["vmap_over_floor_by_round"] = by_round("vmap", "floor")
        print(f"  auto chose: {found['auto_plan']}; vmap's time over the floor's, by round: "
              f"{found['vmap_over_floor_by_round']:.2f}x")  # fmt: skip
        for way in ways.values():
            way.close()
    acted = acting(args.rounds, args.sample)
    record["acting"] = {"ways": report("acting, batch 1, no gradients", acted)}
    print("\nforward, no gradients: auto against the fixed engines, 10 members")
    record["auto"] = auto_against_fixed(args.rounds, args.sample, args.auto_batches)
    record["loss_difference"] = {}
    for steps in args.agree_steps:
        worst = losses_agree(steps)
        print(f"\ncritic loss vs the loop's, largest difference over {steps} steps:")
        for name, value in worst.items():
            if name != "loop":
                print(f"  {name:6s} {value:.2g}")
        record["loss_difference"][str(steps)] = {k: v for k, v in worst.items() if k != "loop"}
    if args.json:
        run_record.write(args.json, record)


if __name__ == "__main__":
    main()
