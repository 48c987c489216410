"""worker2 raises from main; the others wait for it."""

import asyncrpc


class ExampleFailure(Exception):
    pass


def main(ctx: asyncrpc.Context) -> None:
    if ctx.name == "worker2":
        raise ExampleFailure("worker2 could not load its shard")


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3)
