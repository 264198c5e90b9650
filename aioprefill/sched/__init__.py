"""Scheduling as pure bookkeeping: no asyncio, no I/O, no clock but what it is handed.

Data flow: `units.Request` (a prompt while the engine owns it) -> `scheduler.Scheduler` (the
queue, the staged batch, the counters) -> `batching.take_batch` picks `units.Chunk`s within a
`units.Budget` -> `columns.Columns` packs them as wire columns -> the pool sends them and
holds an `units.InFlight` batch until its answer. `policies/` decide when and to which group
a batch goes; `prefix/` is the prefix cache's engine side; `invariants` recounts the counters.

May import: `wire` (the message types), the specs and the base; never `engine`, `workers`,
asyncio or anything that does I/O.
"""
