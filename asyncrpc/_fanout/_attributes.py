"""What a stacked call reads besides tensors, read on every call: settings and hooks.

A stacked call runs one module's code for every member: right only while all
members' settings (plain attributes: a scale, a slope, `training`) are equal
and no hook would run. Every call first asks `CallHooks` (_allowlist) whether
a call would run a hook (a member's, a global one, a tensor's under grad: a
scan of dict lengths), then reads each submodule's settings (C-level maps
over itemgetters, about 0.1 us a submodule) and compares them with what the
previous call read; only when something changed are the members compared
with each other, and the engine's template (the code it runs, on the meta
device) given member 0's values::

    call ── a hook to run? ── yes ─> member by member
             │ no
             └─ read every member's settings ── as last call? ── yes ─> stacked
                                               │ no
                                               └─ all immutable, all alike? ── yes ─> template
                                                                     │        updated, stacked
                                                                     └─ no ──> member by member

A setting is an entry of a module's ``__dict__`` that is not nn.Module's
bookkeeping (_allowlist.plain_attributes). Settings are immutable values
(`decline` checked; one rebound to a list, a dict, ... runs member by
member), so a change is always a rebinding, which `==` sees.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from ._allowlist import CallHooks, article, immutable, plain_attributes, same_setting

__all__ = ("Attributes", "plain_attributes")


class Attributes:
    """Reads the members' plain attributes each call; keeps the template in step."""

    def __init__(
        self,
        members: Sequence[torch.nn.Module],
        template: torch.nn.Module,
        ignore: Sequence[str] = (),
    ) -> None:
        self.count = len(members)
        self._ignore = frozenset(ignore)  # attributes that may differ between members
        self._subs = [list(m.modules()) for m in members]
        self._hooks = CallHooks(members)
        self._template = list(template.modules())
        self._seen: list[Any] | None = None
        self._uniform = False
        self.difference: str | None = None  # why the last change left the members unlike
        self._read_keys()

    def _read_keys(self) -> None:
        # Keys are member 0's, per submodule; every member's dict is read by them.
        ignore = self._ignore
        keys = [
            tuple(k for k in plain_attributes(sub) if k not in ignore) for sub in self._subs[0]
        ]
        self._getters: list[operator.itemgetter[Any]] = []
        self._dicts: list[dict[str, Any]] = []
        for subs in self._subs:
            for sub, names in zip(subs, keys, strict=True):
                if names:
                    self._getters.append(operator.itemgetter(*names))
                    self._dicts.append(vars(sub))
        self._every_dict = [vars(sub) for subs in self._subs for sub in subs]

    def alike(self) -> bool:
        """True when no hook would run and every member's settings are equal and immutable
        (the template then has them); else `difference` says why not."""
        if self._hooks.present():
            self.difference = self._hooks.reason()
            self._seen = None  # read again once the hooks are gone
            return False
        now = self._read()
        try:
            same = now is not None and now == self._seen
        except Exception:  # a value whose `==` is no bool (an array): read it as changed
            same = False
        return self._uniform if same else self._changed()

    def _read(self) -> list[Any] | None:
        try:
            # operator.call keeps the loop in C; `==` on the result tries identity first.
            now = list(map(operator.call, self._getters, self._dicts))
            now.append(list(map(len, self._every_dict)))  # an attribute added anywhere
            return now
        except KeyError:  # member 0 has an attribute another lacks
            return None

    def _changed(self) -> bool:
        self._read_keys()
        self.difference = self._mutable() or self._compare()
        self._uniform = self.difference is None
        self._seen = self._read()
        if self._uniform:
            for sub, tsub in zip(self._subs[0], self._template, strict=True):
                vars(tsub).update(plain_attributes(sub))
        return self._uniform

    def _mutable(self) -> str | None:
        for i, subs in enumerate(self._subs):
            for sub in subs:
                for key, value in plain_attributes(sub).items():
                    if not immutable(value):
                        where = _where(self._subs[i][0], sub)
                        return (
                            f"member {i}'s {where}{key} is {article(type(value).__name__)}, "
                            "which can change in place unseen; rebind it to an immutable value"
                        )
        return None

    def _compare(self) -> str | None:
        first = [plain_attributes(sub) for sub in self._subs[0]]
        for i, subs in enumerate(self._subs[1:], start=1):
            for p, sub in enumerate(subs):
                theirs = plain_attributes(sub)
                for key in (first[p].keys() | theirs.keys()) - self._ignore:
                    if not same_setting(first[p].get(key, _MISSING), theirs.get(key, _MISSING)):
                        where = _where(self._subs[0][0], self._subs[0][p])
                        return f"member {i}'s {where}{key} differs from member 0's"
        return None


_MISSING = object()


def _where(root: torch.nn.Module, sub: torch.nn.Module) -> str:
    for name, module in root.named_modules():
        if module is sub:
            return f"{name}." if name else ""
    return ""
