"""A node's agent, a process of its own beside the warm server (_server) and the rank
(_rank): started once per node of a World across nodes (``python -m
mplaunch._agent.agent``, by its scheduler: _engine.nodes.schedulers), it
connects back to the launching process and runs its node's share of the World with the
engine's own servers and spawners. Nothing imports it; it imports the engine, never a
front-end."""
