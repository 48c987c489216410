"""The "vmap" engine reads what the members hold, whatever was done to them between calls.

Each test does to the members what users do (writes through `.data`, fused
optimizer steps, Polyak updates, attribute changes, buffers updated in
forward, frozen parameters, dropout) and compares the Fanout's outputs and
the members' state with the members run one by one.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch

import asyncrpc

pytestmark = pytest.mark.timeout(120)


def mlp(slope: float = 0.01) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LeakyReLU(slope), torch.nn.Linear(16, 2)
    )


def _members(n: int = 3, factory: type | None = None) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [(factory or mlp)().eval() for _ in range(n)]


def _same(fan: asyncrpc.Fanout, members: list[torch.nn.Module], x: torch.Tensor) -> None:
    with torch.no_grad():
        got = fan(x)
        want = [m(x) for m in members]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert "vmap" not in fan.declined, fan.declined


@pytest.mark.parametrize(
    "write",
    [
        lambda p: p.data.copy_(torch.randn_like(p)),
        lambda p: p.data.mul_(0),
        lambda p: p.data.add_(1.5),
    ],
    ids=["data.copy_", "data.mul_", "data.add_"],
)
def test_writes_through_data_reach_the_stacked_call(write: object) -> None:
    members = _members()
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    _same(fan, members, x)
    for p in members[1].parameters():
        write(p)  # type: ignore[operator]
    _same(fan, members, x)


@pytest.mark.parametrize("kind", ["fused", "foreach", "plain"])
def test_adam_steps_of_every_kind_reach_the_stacked_call(kind: str) -> None:
    members = _members()
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    _same(fan, members, x)
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "plain": {"foreach": False}}
    params = [p for m in members for p in m.parameters()]
    optimizer = torch.optim.Adam(params, lr=0.1, **options[kind])
    for _ in range(3):
        optimizer.zero_grad()
        sum(out.square().sum() for out in fan(x)).backward()
        optimizer.step()
        _same(fan, members, x)


def test_polyak_updates_of_a_target_q_ensemble_are_seen() -> None:
    online, target = _members(4), _members(4)
    for t in target:
        for p in t.parameters():
            p.data.normal_()
    fan = asyncrpc.Fanout(target)  # engine="auto", as examples/q_ensemble.py does
    x, tau = torch.rand(16, 8), 0.5
    for _ in range(3):
        with torch.no_grad():
            for t, o in zip(target, online, strict=True):
                for tp, p in zip(t.parameters(), o.parameters(), strict=True):
                    tp.data.mul_(1 - tau).add_(tau * p.data)
        for _ in range(12):  # auto times its plans over these calls
            _same(fan, target, x)


def test_attributes_changed_after_construction_are_read_on_every_call() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 2)
            self.scale = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale * self.linear(x)

    for members in (_members(3, Scaled), _members(3)):
        fan = asyncrpc.Fanout(members, engine="vmap")
        x = torch.rand(4, 8) - 0.5
        _same(fan, members, x)
        for m in members:  # all alike: still stacked, with the new value
            if isinstance(m, torch.nn.Sequential):
                m[1].negative_slope = 0.7
            else:
                m.scale = 3.0  # type: ignore[assignment]
        _same(fan, members, x)
        if isinstance(members[0], torch.nn.Sequential):  # one member unlike the rest
            members[2][1].negative_slope = 0.2
        else:
            members[2].scale = -1.0  # type: ignore[assignment]
        _same(fan, members, x)


class Counter(torch.nn.Module):
    """Counts its calls in a buffer it updates in place in forward (eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * self.calls


def test_buffers_updated_in_forward_land_in_the_members() -> None:
    members = _members(3, Counter)
    fan = asyncrpc.Fanout(members, engine="vmap")
    twins = copy.deepcopy(members)
    x = torch.rand(4, 8)
    for _ in range(4):
        with torch.no_grad():
            got = fan(x)
            want = [m(x) for m in twins]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    assert [float(m.calls) for m in members] == [4.0, 4.0, 4.0]  # type: ignore[arg-type]
    assert "vmap" not in fan.declined and fan.plan is not None and fan.plan.engine == "vmap"


def test_a_forward_that_rebinds_a_buffer_is_declined_with_the_way_out() -> None:
    class Rebinding(Counter):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = self.calls + 1  # a new tensor: a stacked call would lose it
            return self.linear(x)

    members = _members(3, Rebinding)
    fan = asyncrpc.Fanout(members, engine="vmap")
    with torch.no_grad():
        fan(torch.rand(4, 8))
        fan(torch.rand(4, 8))
    assert "calls" in fan.declined["vmap"] and "in place" in fan.declined["vmap"]
    assert [float(m.calls) for m in members] == [2.0, 2.0, 2.0]  # type: ignore[arg-type]


def test_frozen_members_get_outputs_that_need_no_gradient() -> None:
    members = _members()
    for p in members[0].parameters():
        p.requires_grad_(False)
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    fan(x)  # the first call runs the members one by one
    got = fan(x)
    assert [out.requires_grad for out in got] == [False, True, True]
    sum(out.sum() for out in got[1:]).backward()
    assert all(p.grad is None for p in members[0].parameters())
    assert all(p.grad is not None for p in members[1].parameters())


def test_dropout_in_training_gives_each_member_its_own_mask_and_is_not_declined(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(1)
    one = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.5))
    members = [copy.deepcopy(one).train() for _ in range(4)]  # equal weights
    x = torch.rand(2, 8)
    with caplog.at_level(logging.INFO, logger="asyncrpc"):
        fan = asyncrpc.Fanout(members, engine="vmap")
        fan(x)
        outputs = fan(x)
    assert "vmap" not in fan.declined, caplog.text
    masks = [(out == 0) for out in outputs]
    assert any(not torch.equal(masks[0], m) for m in masks[1:])  # masks differ per member


def test_a_members_state_dict_saves_and_copies_as_its_own() -> None:
    members = [torch.nn.Linear(256, 256) for _ in range(8)]
    fan = asyncrpc.Fanout(members, engine="vmap")
    with torch.no_grad():
        fan(torch.rand(2, 256))
        fan(torch.rand(2, 256))  # stacked: the members' tensors are rows of the stacks
    assert members[3].weight.untyped_storage().nbytes() == 8 * 256 * 256 * 4

    def saved(obj: object) -> int:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return len(buffer.getvalue())

    plain = torch.nn.Linear(256, 256)
    state = members[3].state_dict()
    assert saved(state) < 1.1 * saved(plain.state_dict())
    loaded = torch.load(io.BytesIO(_bytes(state)))
    torch.testing.assert_close(loaded["weight"], members[3].weight.detach())
    copied = copy.deepcopy(state)
    assert copied["weight"].untyped_storage().nbytes() == 256 * 256 * 4
    state["bias"].add_(1)  # an entry still aliases the member, as a plain module's does
    torch.testing.assert_close(members[3].bias.detach(), state["bias"])
    fan.close()  # the members hold memory of their own again
    assert members[3].weight.untyped_storage().nbytes() == 256 * 256 * 4
    _same(asyncrpc.Fanout(members, engine="serial"), members, torch.rand(2, 256))


def _bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_dtype_moves_and_load_state_dict_are_followed() -> None:
    members = _members()
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    _same(fan, members, x)
    fresh = mlp()
    members[1].load_state_dict(fresh.state_dict())
    _same(fan, members, x)
    members[2].load_state_dict(mlp().state_dict(), assign=True)  # new tensor objects
    _same(fan, members, x)
    for m in members:
        m.to(torch.float64)
    _same(fan, members, x.double())


def test_a_tensor_that_shares_memory_with_the_users_stays_shared() -> None:
    members = _members()
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    _same(fan, members, x)
    mine = torch.zeros(2, 16)
    members[1][2].weight.data = mine  # the member now shares the user's tensor
    _same(fan, members, x)
    mine.add_(0.25)  # written through the user's own tensor
    _same(fan, members, x)
    assert members[1][2].weight.data_ptr() == mine.data_ptr()


def test_two_fanouts_over_the_same_members_share_one_stack() -> None:
    members = _members()
    first = asyncrpc.Fanout(members, engine="vmap")
    second = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    for fan in (first, second, first, second):
        _same(fan, members, x)
    assert first._stacked is not None and second._stacked is not None
    assert first._stacked.storage is second._stacked.storage  # no tug of war per call
    pointer = members[0][0].weight.data_ptr()
    first.close()  # the other still uses the stack: the members stay its rows
    assert members[0][0].weight.data_ptr() == pointer
    _same(second, members, x)
    second.close()  # the last one out gives the members memory of their own
    assert members[0][0].weight.untyped_storage().nbytes() == 16 * 8 * 4


def test_a_replaced_layer_is_stacked_anew() -> None:
    members = _members()
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    for _ in range(2):
        _same(fan, members, x)
    for m in members:
        m[2] = torch.nn.Linear(16, 2)  # a new head, its own tensors
    _same(fan, members, x)
    for m in members:
        m[1] = torch.nn.Tanh()  # other code
    _same(fan, members, x)
    members[0][1] = torch.nn.ReLU()  # one member unlike the rest: its layer's class
    with torch.no_grad():
        got = fan(x)
    for a, m in zip(got, members, strict=True):
        torch.testing.assert_close(a, m(x))


def test_a_data_write_that_keeps_the_pointer_but_not_the_layout_is_seen() -> None:
    members = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(3)]
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(5, 4)
    _same(fan, members, x)
    _same(fan, members, x)
    for m in members:
        m[0].weight.data = m[0].weight.data.t()  # same memory, transposed
    _same(fan, members, x)


def test_in_place_buffer_updates_reach_a_buffer_the_user_shares() -> None:
    members = _members(3, Counter)
    views = [m.calls.view(-1) for m in members]  # the user shares each buffer's memory
    fan = asyncrpc.Fanout(members, engine="vmap")
    with torch.no_grad():
        for _ in range(4):
            fan(torch.rand(4, 8))
    assert [float(m.calls) for m in members] == [4.0, 4.0, 4.0]  # type: ignore[arg-type]
    assert [float(v) for v in views] == [4.0, 4.0, 4.0]
    assert "vmap" not in fan.declined


def test_a_forward_that_changes_a_parameter_in_place_changes_the_members() -> None:
    members = [torch.nn.Embedding(10, 4, max_norm=0.5) for _ in range(3)]
    twins = copy.deepcopy(members)
    fan = asyncrpc.Fanout(members, engine="vmap")
    index = torch.arange(6)
    with torch.no_grad():
        fan(index)
        for m in members + twins:
            m.weight.mul_(10)
    for _ in range(2):  # with gradients on: the renorm writes a copy stacked in the graph
        got = fan(index)
        want = [t(index) for t in twins]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    for m, t in zip(members, twins, strict=True):
        torch.testing.assert_close(m.weight.detach(), t.weight.detach())
    assert "vmap" not in fan.declined


def test_members_made_in_inference_mode_work_during_and_after() -> None:
    x = torch.rand(2, 4)
    with torch.inference_mode():
        members = [torch.nn.Linear(4, 3) for _ in range(3)]
        fan = asyncrpc.Fanout(members, engine="vmap")
        fan(x)
        got = fan(x)
        for a, m in zip(got, members, strict=True):
            torch.testing.assert_close(a, m(x))
        fan.close()
        members[0](x)  # still a working module


def test_a_member_stays_picklable_and_so_does_its_copy() -> None:
    members = [torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(3)]
    fan = asyncrpc.Fanout(members, engine="vmap")
    with torch.no_grad():
        fan(torch.rand(2, 4))
        fan(torch.rand(2, 4))
    twin = copy.deepcopy(members[0])
    loaded = torch.load(io.BytesIO(_bytes(members[0])), weights_only=False)
    torch.testing.assert_close(loaded[0].weight, members[0][0].weight.detach())
    fan.close()
    torch.load(io.BytesIO(_bytes(twin)), weights_only=False)


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        (lambda m: [m, mlp(), m], "member 2 is member 0 again"),
        (
            lambda m: [
                torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(2, 2))
                for _ in range(2)
            ],
            "is parametrized (torch.nn.utils.parametrizations",
        ),
    ],
    ids=["repeated", "parametrized"],
)
def test_members_the_engine_cannot_stack_are_declined_with_the_reason(
    members: object, reason: str
) -> None:
    fan = asyncrpc.Fanout(members(mlp()), engine="vmap")  # type: ignore[operator]
    assert reason in fan.declined["vmap"], fan.declined


def _write_shared(members: list[torch.nn.Module], value: float) -> None:
    with torch.no_grad():  # another process: a Hogwild learner writing the shared weights
        for m in members:
            for p in m.parameters():
                p.fill_(value)


def _learner(members: list[torch.nn.Module], value: float) -> None:
    proc = torch.multiprocessing.get_context("fork").Process(
        target=_write_shared, args=(members, value)
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


def test_members_in_shared_memory_are_declined_and_see_another_processs_writes() -> None:
    members = _members()
    for m in members:
        m.share_memory()
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    for _ in range(2):
        with torch.no_grad():
            fan(x)
    assert "shared memory" in fan.declined["vmap"], fan.declined
    assert all(p.is_shared() for m in members for p in m.parameters())  # left where they are
    _learner(members, 0.5)
    with torch.no_grad():
        got = fan(x)
    for out in got:  # every weight and bias 0.5: 0.5 * (16 * 0.5 * (x.sum() * 0.5 ...))
        torch.testing.assert_close(out, members[0](x).detach())
    assert torch.all(members[2][0].weight == 0.5)


def test_members_shared_after_stacking_stay_in_the_shared_stack() -> None:
    members = _members()
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8)
    _same(fan, members, x)
    for m in members:
        m.share_memory()  # moves the stack itself into shared memory: the rows follow
    _learner(members, 0.25)
    _same(fan, members, x)
    assert torch.all(members[1][2].weight == 0.25)
    fan.close()  # another process may hold the stack: the rows stay in it
    assert all(p.is_shared() for m in members for p in m.parameters())


def _critic_step(fan: asyncrpc.Fanout, members: list[torch.nn.Module], x: torch.Tensor) -> None:
    q = fan(x)
    optimizer = torch.optim.SGD([p for m in members for p in m.parameters()], lr=0.1)
    optimizer.zero_grad()
    sum(out.sum() for out in q).backward()
    optimizer.step()


@pytest.mark.parametrize("engine", ["vmap", "serial"])
@pytest.mark.parametrize(
    "change",
    [
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.0),
        lambda m: [p.mul_(0.5) for p in m.parameters()],
        lambda m: m[2].weight.add_(1.0),
    ],
    ids=["sgd-step", "mul_", "add_"],
)
def test_a_change_in_place_before_backward_raises_torchs_own_error(
    engine: str, change: object
) -> None:
    members = _members()
    fan = asyncrpc.Fanout(members, engine=engine)  # type: ignore[arg-type]
    x = torch.rand(4, 8, requires_grad=True)
    _critic_step(fan, members, x)  # the first call: the members one by one
    q = fan(x)  # stacked on "vmap"
    with torch.no_grad():
        made = change(members[1])  # type: ignore[operator]
        if isinstance(made, torch.optim.Optimizer):
            for p in members[1].parameters():
                p.grad = torch.ones_like(p)
            made.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sum(out.sum() for out in q).backward()
    assert "vmap" not in fan.declined


def test_a_change_through_data_before_backward_is_used_without_error_as_eagerly() -> None:
    members, twins = _members(), _members()
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(4, 8, requires_grad=True)
    _critic_step(fan, members, x)
    _critic_step(asyncrpc.Fanout(twins, engine="serial"), twins, x)
    q, want = fan(x), [t(x) for t in twins]
    for m in (*members, *twins):
        m[2].weight.data.mul_(2)  # `.data`: autograd does not count it
    sum(out.sum() for out in q).backward()
    sum(out.sum() for out in want).backward()
    for m, t in zip(members, twins, strict=True):
        torch.testing.assert_close(m[0].weight.grad, t[0].weight.grad)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("engine", ["vmap", "auto", "serial"])
def test_an_output_changed_in_place_works_on_every_call(engine: str) -> None:
    members, twins = _members(), _members()
    fan = asyncrpc.Fanout(members, engine=engine)  # type: ignore[arg-type]
    x = torch.rand(4, 8) - 0.5
    for _ in range(12):  # auto: every plan it times, and the one it picks
        for m in (*members, *twins):
            m.zero_grad()
        q, want = fan(x), [t(x) for t in twins]
        for out in (*q, *want):
            out.masked_fill_(out > 0, -1e4)  # an illegal action's Q
        sum(out.sum() for out in q).backward()
        sum(out.sum() for out in want).backward()
        for a, b in zip(q, want, strict=True):
            torch.testing.assert_close(a, b)
        for m, t in zip(members, twins, strict=True):
            torch.testing.assert_close(m[0].weight.grad, t[0].weight.grad)


def _saved(obj: object) -> int:
    return len(_bytes(obj))


def test_a_member_saves_and_copies_its_own_rows_under_a_full_and_a_subset_fanout() -> None:
    critics = _members(10, Counter)  # a buffer too: plain tensors copy their whole storage
    full, subset = asyncrpc.Fanout(critics, engine="vmap"), asyncrpc.Fanout(critics[:2])
    x = torch.rand(4, 8)
    for _ in range(14):  # REDQ: every critic, then a subset, in turn
        with torch.no_grad():
            full(x)
            subset(x)
    plain = _saved(Counter().state_dict())
    for member in (critics[0], critics[1], critics[5]):
        assert abs(_saved(member.state_dict()) - plain) < 2048
        copied = copy.deepcopy(member)
        sizes = [t.untyped_storage().nbytes() for t in copied.state_dict().values()]
        assert sizes == [t.nbytes for t in copied.state_dict().values()]
        torch.testing.assert_close(copied(x), member(x))
    assert "vmap" not in full.declined
