"""The one lease store over the store driver protocol (`pglease.driver.store`):
`LeaseStore` (blocking) and `AsyncLeaseStore` (asyncio), which the backends'
stores subclass with their own driver."""

from ._store import LeaseStore
from ._store_async import AsyncLeaseStore

__all__ = ["AsyncLeaseStore", "LeaseStore"]
