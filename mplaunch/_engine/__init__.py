"""The launching process's machinery: arguments into a frozen config, the run and its
attempts, a group of ranks and how they are started (spawners, servers), their output,
the store and other nodes, and what an attempt amounts to (ending, outcome)."""
