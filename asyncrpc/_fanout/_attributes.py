"""The members' plain attributes (a scale, a slope, `training`), read on every stacked call.

A stacked call runs one module's code for every member: right only while all
members' plain attributes are equal. Every call reads each submodule's plain
attributes (C-level maps over itemgetters, about 0.1 us a submodule) and
compares them with what the previous call read; only when something changed
are the members compared with each other, and the engine's template (the
code it runs, on the meta device) given member 0's values::

    call ── read every member's attributes ── as last call? ── yes ─> stacked
                                               │ no
                                               └─ all members alike? ── yes ─> template
                                                                     │        updated, stacked
                                                                     └─ no ──> member by member

A plain attribute is one in a module's ``__dict__`` that is not a
parameter, buffer, submodule or hook table (its name has no leading ``_``).
A value mutated in place (a list appended to) reads as unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Attributes", "plain_attributes"]


def plain_attributes(module: torch.nn.Module) -> dict[str, Any]:
    """A module's own plain attributes, `training` included."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


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
        """True when every member's attributes are equal (the template then has them)."""
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
        self.difference = self._compare()
        self._uniform = self.difference is None
        self._seen = self._read()
        if self._uniform:
            for sub, tsub in zip(self._subs[0], self._template, strict=True):
                vars(tsub).update(plain_attributes(sub))
        return self._uniform

    def _compare(self) -> str | None:
        first = [plain_attributes(sub) for sub in self._subs[0]]
        for i, subs in enumerate(self._subs[1:], start=1):
            for p, sub in enumerate(subs):
                theirs = plain_attributes(sub)
                for key in (first[p].keys() | theirs.keys()) - self._ignore:
                    if not _equal(first[p].get(key, _MISSING), theirs.get(key, _MISSING)):
                        where = _where(self._subs[0][0], self._subs[0][p])
                        return f"member {i}'s {where}{key} differs from member 0's"
        return None


_MISSING = object()


def _equal(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # an array's ambiguous truth, say: count it as a difference
        return False


def _where(root: torch.nn.Module, sub: torch.nn.Module) -> str:
    for name, module in root.named_modules():
        if module is sub:
            return f"{name}." if name else ""
    return ""
