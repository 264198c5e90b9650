"""What crosses the process boundary between the engine and its workers.

`protocol`: every message (msgspec Structs, one union per direction); `outputs`: a request's
output options on the wire and its answer read back; `kv`: the KV export's segment layout and
the engine's ledger of open exports. The byte layout of the rings themselves is `shm/ring.py`.

May import: the specs (`models`, `parallel`), `shm`, `kvstore.options` and the base.
"""
