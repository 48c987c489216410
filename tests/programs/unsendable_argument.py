"""A handle's calls whose arguments cannot be pickled: refused, and the world still ends at once.

torch forks an RRef as it pickles it; a fork never sent holds torch's
shutdown until its timeout (100 s). A handle's call pickles its arguments
before the object's RRef, so the refused send forks nothing. Prints one line,
``RESULT {json}``: what each verb raised and how long the world took to end.
"""

from __future__ import annotations

import json
import threading
import time

import asyncrpc


class Box:
    def take(self, x: object) -> int:
        return 1

    def items(self, x: object) -> list[int]:
        return [1]


def main(ctx: asyncrpc.Context) -> dict[str, object]:
    seen: dict[str, object] = {}
    if ctx.rank == 0:
        box = asyncrpc.spawn("worker1", Box)
        verbs = {
            "call": lambda: box.call("take", threading.Lock()),
            "call_async": lambda: box.call_async("take", threading.Lock()).wait(),
            "call_remote": lambda: box.call_remote("take", threading.Lock()).to_here(),
            "stream": lambda: list(box.stream("items", threading.Lock())),
        }
        for verb, run in verbs.items():
            try:
                run()
                seen[verb] = "sent"
            except asyncrpc.SerializationError:
                seen[verb] = "SerializationError"
        seen["after"] = box.call("take", 0)  # the handle still works
    return seen


if __name__ == "__main__":
    started = time.monotonic()
    result = asyncrpc.run(main, world_size=2)
    print("RESULT " + json.dumps({**result, "seconds": round(time.monotonic() - started, 1)}))
