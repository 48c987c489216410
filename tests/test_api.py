"""The public facade: `__all__` is exactly what the package exports, all documented."""

import inspect

import asyncrpc


def test_all_is_a_tuple_of_the_public_names() -> None:
    public = {n for n in vars(asyncrpc) if not n.startswith("_")}
    # Submodules are attributes of a package once imported; they are not API.
    modules = {n for n in public if inspect.ismodule(getattr(asyncrpc, n))}
    assert isinstance(asyncrpc.__all__, tuple)
    assert set(asyncrpc.__all__) == public - modules
    assert len(set(asyncrpc.__all__)) == len(asyncrpc.__all__)


def test_every_public_name_has_a_docstring_with_an_example() -> None:
    for name in asyncrpc.__all__:
        obj = getattr(asyncrpc, name)
        doc = inspect.getdoc(obj) or ""
        assert doc, f"{name} has no docstring"
        if inspect.isfunction(obj):
            assert "Example" in doc, f"{name} has no example in its docstring"


def test_errors_derive_from_the_base_and_a_builtin() -> None:
    assert issubclass(asyncrpc.UnknownWorkerError, LookupError)
    assert issubclass(asyncrpc.PortInUseError, OSError)
    assert issubclass(asyncrpc.NotInitializedError, RuntimeError)
    for name in asyncrpc.__all__:
        obj = getattr(asyncrpc, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, asyncrpc.AsyncRPCError)
