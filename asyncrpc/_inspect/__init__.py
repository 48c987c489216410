"""Seeing inside a running world from outside it: `asyncrpc-dump` and `asyncrpc-top`."""
