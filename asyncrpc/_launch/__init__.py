"""Launching and supervising worlds: asyncrpc.run, asyncrpc-launch, liveness."""
