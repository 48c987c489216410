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
    assert issubclass(asyncrpc.StoreTimeoutError, asyncrpc.RendezvousError)
    assert issubclass(asyncrpc.StoreTimeoutError, TimeoutError)
    for name in asyncrpc.__all__:
        obj = getattr(asyncrpc, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, asyncrpc.AsyncRPCError)


def test_every_public_name_is_asyncrpcs_own_and_exported_once() -> None:
    import pickle

    for name in asyncrpc.__all__:
        obj = getattr(asyncrpc, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == "asyncrpc", (name, obj.__module__)
            assert pickle.loads(pickle.dumps(obj)) is obj  # found by that name
    assert not hasattr(asyncrpc, "futures")  # one home per name: asyncrpc.gather
    error = asyncrpc.CallTimeoutError("late", "worker1")
    assert repr(type(error)) == "<class 'asyncrpc.CallTimeoutError'>"
