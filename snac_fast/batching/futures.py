"""Handing results to futures (asyncio's or concurrent.futures'), whoever made them."""

from __future__ import annotations


def resolve(future, result) -> None:
    """Set a future's result (or exception), unless its caller gave up on it (cancelled)."""
    if future is None or future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def resolve_all(futures: list, values: list) -> None:
    for future, value in zip(futures, values):
        resolve(future, value)
