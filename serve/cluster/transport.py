"""How a KV snapshot (kiln.runtime.kv_transfer) travels from the engine that exported it to the one
that imports it.

A transport's `send` runs where the snapshot was made and returns a small handle that is passed
along with the request; `receive` runs on the importing side and gives the snapshot back. Ray's
object store is the one built: on one node the pages are shared memory and the importer reads
them without a copy until they are written into its KV tensors; across nodes Ray moves them. A GPU
transport (NCCL through CuPy, or NIXL) would send device pages directly and keep this interface.
"""
from __future__ import annotations

from typing import Protocol

from kiln.runtime.kv_transfer import KVSnapshot


class KVTransport(Protocol):
    name: str

    def send(self, snapshot: KVSnapshot) -> object: ...

    async def receive(self, handle: object) -> KVSnapshot: ...


class InlineTransport:
    """The snapshot itself is the handle: it travels inside the request (pickled with it)."""
    name = "inline"

    def send(self, snapshot: KVSnapshot) -> object:
        return snapshot

    async def receive(self, handle: object) -> KVSnapshot:
        return handle


class ObjectStoreTransport:
    """Through Ray's object store: the handle is an ObjectRef."""
    name = "ray-object-store"

    def send(self, snapshot: KVSnapshot) -> object:
        import ray
        return ray.put(snapshot)

    async def receive(self, handle: object) -> KVSnapshot:
        return await handle


TRANSPORTS = {t.name: t for t in (InlineTransport, ObjectStoreTransport)}
