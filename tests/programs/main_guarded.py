"""`run(main, args=(helper,))` where `helper` is defined under `if __name__ == "__main__":`.

A worker imports this file as a module, so it cannot find `helper`: the
WorkerFailedError must say so (printed), not "exited with code 1".
"""

import asyncrpc


def main(ctx: asyncrpc.Context, step: object) -> None:
    print(f"{ctx.name} ran {step}")


if __name__ == "__main__":

    def helper() -> None:
        pass

    try:
        asyncrpc.run(main, world_size=1, args=(helper,))
    except asyncrpc.WorkerFailedError as failure:
        print(f"failed: {failure}")
