"""The engine's side of the worker processes: `WorkerPool` and what it is made of (slots, the
rank processes' handles, launching and restarting groups, matching answers). All of it runs in
the engine process on its event loop; what runs inside a worker process is `aioprefill.workers`."""
