"""The RPC core: everything a call needs, nothing a feature needs.

The torch boundary, the world, the one call path, failures, async_execution
and Future composition. Features (handles, Batch, fan-out, trace, launch)
are built on it; nothing here imports them.
"""
