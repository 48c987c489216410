"""The package's layers: each module imports only from the layers below it (no import cycle).

    __init__ (the facade)  ->  _ensemble
      ->  _handles, _batch, _fanout/, _trace/, _launch/  (features, apart from each other)
      ->  _core/  (the RPC core: named tiers, `CORE_TIERS`, each in its own order)

A subpackage (`_core/_torch/`) has its place among its siblings and its own
order inside; its `__init__` gathers its modules, so it ranks above them.
Imports are read from the source with `ast`, lazy ones inside functions included.
An import made for types only (under `if TYPE_CHECKING:`) may point up, but never
closes a circle: every ordinary import-graph tool counts it.
"""

from __future__ import annotations

import ast
import pathlib

import asyncrpc

PACKAGE = pathlib.Path(asyncrpc.__file__).parent

# Lowest first. A unit is a module, or a package whose modules are listed in their order.
LAYERS: list[list[str]] = [
    ["_core"],
    ["_actor", "_placement", "_wait"],
    ["_family", "_retry"],
    ["_handles", "_batch", "_fanout", "_trace", "_launch", "_inspect"],
    ["_spawn"],
    ["_actor_pool", "_ensemble"],
    ["__init__"],
]
# The RPC core in tiers, lowest first; each tier's modules in their own order. A module
# imports only from the modules before it: earlier in its tier, or in a lower tier.
CORE_TIERS: dict[str, list[str]] = {
    # What everything stands on: the exceptions, where a world's state hangs, waiting.
    "kernel": ["_errors", "_runtime", "_polling"],
    # Every private torch name, text and patch (a subpackage with its own order).
    "torch boundary": ["_torch"],
    # A call's outcome: its failure as a value, its Future, its cancel, in flight.
    "outcomes": [
        "_failures",
        "_unwaited",
        "_futures",
        "_cancel",
        "_watcher",
        "_activity",
        "_reply",
    ],
    # What a world is made of: options, addresses, the store, members and their records.
    "world state": [
        "_device_options",
        "_context",
        "_net",
        "_environ",
        "_rendezvous",
        "_liveness",
        "_events",
        "_membership",
        "_records",
        "_devices",
        "_forks",
    ],
    # Seeing inside a running world: registration, snapshots, the side channel, hangs.
    "diagnostics": ["_registry", "_snapshot", "_side", "_waits", "_hang"],
    # Starting, healing, growing and ending a world.
    "world lifecycle": [
        "_healing",
        "_hooks",
        "_threadstates",
        "_world",
        "_elastic",
        "_init",
    ],
    # The verbs: what runs on the callee (its event loop, objects' mailboxes), the one call
    # path, streams.
    "call path": [
        "_loop",
        "_sendable",
        "_promised",
        "_kept",
        "_objects",
        "_execution",
        "_job",
        "_mailbox",
        "_calls",
        "_stream_items",
        "_stream",
    ],
}
INSIDE: dict[str, list[str]] = {
    "_core": [module for tier in CORE_TIERS.values() for module in tier],
    "_fanout": [
        "_tuner",
        "_exit",
        "_pool",
        "_options",
        "_forked",
        "_randomness",
        "_grads",
        "_alone",
        "_storage",
        "_reads",
        "_allowlist",
        "_attributes",
        "_check",
        "_decline",
        "_stacked",
        "_calling",
        "_copies",
        "_fanout",
    ],
    "_core._torch": [
        "_versions",
        "_originals",
        "_texts",
        "_process",
        "_modules",
        "_launcher",
        "_agent",
        "_static",
        "_listener",
        "_patches",
        "_notes",
        "_unread",
        "_sending",
        "_shared",
        "_releases",
        "_rrefs",
        "_reads",
        "_install",
    ],
    "_trace": ["_timeline", "_render", "_trace"],
    "_launch": [
        "_parent",
        "_forking",
        "_signals",
        "_warm",
        "_quiet",
        "_child",
        "_forkserver",
        "_launched",
        "_healer",
        "_changes",
        "_spares",
        "_replacing",
        "_local",
        "_healing_world",
        "_supervisor",
        "_plan",
        "_node_changes",
        "_nodes",
        "_cli",
    ],
    "_inspect": ["_worlds", "_dump", "_top"],
}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name below `asyncrpc` (`_core._torch`)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _rank(module: str) -> tuple[int, ...]:
    """(layer, unit, position inside the unit[, position inside a subpackage]) of a module."""
    unit, _, inner = module.partition(".")
    for layer, units in enumerate(LAYERS):
        if unit in units:
            return (layer, units.index(unit), *_position(unit, inner))
    raise AssertionError(f"asyncrpc.{module} is not placed in LAYERS; add it to the order")


def _position(unit: str, inner: str) -> tuple[int, ...]:
    """Where `inner` (a dotted name below `unit`) sits in `unit`'s order; 0: `unit` itself."""
    if not inner:
        return (0,)
    head, _, rest = inner.partition(".")
    order = INSIDE.get(unit, [])
    if head not in order:
        raise AssertionError(f"asyncrpc.{unit}.{head} is not in INSIDE[{unit!r}]; place it")
    place = order.index(head) + 1
    package = f"{unit}.{head}"
    if package not in INSIDE:
        return (place,)
    if not rest:  # a subpackage's __init__: above every module of its own
        return (place, len(INSIDE[package]) + 1)
    return (place, *_position(package, rest))


def _imports(
    module: str, source: str, is_package: bool, known: set[str], types_too: bool = False
) -> set[str]:
    """The package's own modules that `module` (whose code is `source`) imports.

    `types_too`: also those imported under `if TYPE_CHECKING:` (for types only).
    """
    parts = [] if module == "__init__" else module.split(".")
    base = parts if is_package else parts[:-1]
    targets = set()
    tree = ast.parse(source)
    for node in ast.walk(tree) if types_too else _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = [*anchor, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.startswith("asyncrpc"):
                prefix = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                whole = ".".join([*prefix, alias.name])
                targets.add(whole if whole in known else ".".join(prefix))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("asyncrpc."):
                    targets.add(alias.name.removeprefix("asyncrpc."))
    return {t for t in targets if t and t != module}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those inside `if TYPE_CHECKING:` (types only, never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return [node for node in ast.walk(tree) if id(node) not in skipped]


def test_types_only_imports_are_left_out_of_the_order() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._world import World\n"
    kept = [n for n in _runtime_nodes(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    assert [n.module for n in kept] == ["typing"]


def test_every_module_imports_only_from_lower_layers() -> None:
    modules = _modules()
    known = set(modules)
    wrong = []
    for module, path in sorted(modules.items()):
        mine = _rank(module)
        imported = _imports(module, path.read_text(), path.name == "__init__.py", known)
        for target in sorted(imported):
            theirs = _rank(target)
            same_layer_other_unit = theirs[0] == mine[0] and theirs[1] != mine[1]
            if theirs >= mine or same_layer_other_unit:
                wrong.append(f"asyncrpc.{module} imports asyncrpc.{target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_every_module_has_a_place_in_the_order() -> None:
    for module in _modules():
        _rank(module)  # raises for a module nobody placed
    for unit, order in INSIDE.items():
        below = [m.removeprefix(unit + ".") for m in _modules() if m.startswith(unit + ".")]
        present = {name.partition(".")[0] for name in below}  # a subpackage's modules: itself
        assert present == set(order), (unit, sorted(present ^ set(order)))


def test_the_check_sees_a_wrong_import() -> None:
    # The core must never import a feature: a made-up import of one is caught.
    source = "def f():\n    from .._trace import _trace\n"
    found = _imports("_core._calls", source, False, set(_modules()))
    assert found == {"_trace._trace"}
    assert _rank("_trace._trace") > _rank("_core._calls")


def test_a_subpackage_has_its_own_order_and_its_init_ranks_above_it() -> None:
    # The torch boundary's modules sit between _runtime and _failures, in their own order.
    inside = [_rank(f"_core._torch.{name}") for name in INSIDE["_core._torch"]]
    assert _rank("_core._runtime") < inside[0] and inside == sorted(inside)
    assert inside[-1] < _rank("_core._torch") < _rank("_core._failures")
    # A module of it importing a later one of its own is caught, as anywhere.
    source = "from ._install import install\n"
    found = _imports("_core._torch._agent", source, False, set(_modules()))
    assert found == {"_core._torch._install"}
    assert _rank("_core._torch._install") > _rank("_core._torch._agent")


def _graph(types_too: bool) -> dict[str, set[str]]:
    """Every module's imports of the package's own modules (a package's `__init__`
    gathering its own submodules left out: that is how a package is made, not a circle)."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        found = _imports(module, path.read_text(), path.name == "__init__.py", known, types_too)
        graph[module] = {t for t in found if not t.startswith(module + ".") and t != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected parts of two or more (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_even_counting_imports_for_types_only() -> None:
    circles = _circles(_graph(types_too=True))
    assert not circles, "import circles (type-only imports counted):\n" + "\n".join(
        " <-> ".join(f"asyncrpc.{m}" for m in circle) for circle in circles
    )


def test_the_circle_check_sees_a_types_only_import_that_closes_one() -> None:
    # The runtime importing the world for one annotation closed a circle of 28 modules once.
    graph = _graph(types_too=True)
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._world import World\n"
    graph["_core._runtime"] = _imports("_core._runtime", source, False, set(graph), True)
    assert graph["_core._runtime"] == {"_core._world"}
    circle = next(c for c in _circles(graph) if "_core._runtime" in c)
    assert {"_core._runtime", "_core._world"} <= set(circle)
    # Left out of the layer order, as before: only the circle check sees it.
    assert _imports("_core._runtime", source, False, set(graph)) == set()


def test_the_core_tiers_place_every_module_once_and_design_md_names_them() -> None:
    placed = [module for tier in CORE_TIERS.values() for module in tier]
    assert len(placed) == len(set(placed)), "a module placed in two tiers"
    assert placed == INSIDE["_core"]
    # docs/design.md draws the same tiers, each with every one of its modules.
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    drawn: dict[str, list[str]] = {}
    for line in design.split("<!-- core-tiers -->", 2)[1].splitlines():
        text = line.strip()
        if ":" in text and not text.startswith("->"):  # a tier's line; "->" continues one
            tier, _, text = text.partition(":")
            drawn[tier] = []
        if drawn and text and not text.startswith("```"):
            drawn[list(drawn)[-1]] += text.replace("->", " ").split()
    assert list(drawn) == list(reversed(CORE_TIERS)), "docs/design.md draws the tiers, top first"
    for tier, modules in CORE_TIERS.items():
        assert drawn[tier] == modules, (tier, drawn[tier], modules)
