"""The engine: what runs on the event loop or touches processes and file descriptors.

`loop.Engine` is the facade (lifecycle, admission, wiring); beside it `controls` (state,
drain, close), `affinity` (the loop an engine belongs to), `timer` (a policy's one-shot
timer), `validate` (prompts refused before anything is queued), `outcomes` (answers to
callers' futures), `recovery` (a dead group's requests), `health`, `stats` and `histogram`
(`engine.stats()`), and `pool/` (the worker processes, their rings and eventfds).

May import: `sched`, `wire`, `workers` (to launch them), `transfer`, `kv_events`, `text`, the
specs and the base; never `serve` or `bench`.
"""
