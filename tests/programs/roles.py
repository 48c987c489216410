"""Prints every worker's name and role, from the parameter server."""

import asyncrpc


def describe() -> str:
    ctx = asyncrpc.current_context()
    return f"{ctx.name}:{ctx.role}"


def main(ctx: asyncrpc.Context, greeting: str) -> None:
    if ctx.name == "ps0":
        print(greeting)
        print(" ".join(asyncrpc.rpc_sync(n, describe) for n in ctx.names))
        print("trainers", ",".join(ctx.workers("trainer")))


if __name__ == "__main__":
    asyncrpc.run(main, roles={"ps": 1, "trainer": 2}, args=("hello from ps0",))
