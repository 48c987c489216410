"""A script that calls asyncrpc.run at import, without `if __name__ == "__main__":`."""

import asyncrpc


def main(ctx: asyncrpc.Context) -> None:
    print(ctx.name, "ran")


asyncrpc.run(main, world_size=2)
