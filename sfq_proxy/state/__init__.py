"""Where a pool's dispatch state lives when several processes or replicas share it: Redis
(``state: {redis: URL}``), each decision one Lua script (docs/shared-state.md). The default,
``state: memory``, needs nothing here: the pool keeps its scheduler in its own process."""
